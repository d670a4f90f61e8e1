"""The attention schedule's bookkeeping, on the host and the device: which program runs which query
block (the program map), how query heads fill a tile (GQA packing) and how many KV segments a
launch needs. Pure functions of the shapes and the cumulative lengths; no kernel lives here.

Every backend numbers its work the same way: the Ascend C tiling (``ascendc/tiling.py``) has the
host twins of :func:`program_map` and :func:`packing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def program_map(
    cu_seqlens: torch.Tensor, block: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Number the (sequence, block of ``block`` rows) tasks without a host sync.

    Returns ``program_seq`` and ``program_block`` (the sequence and block of task ``i``), sized
    for an upper bound of tasks (``num_tokens // block + num_seqs``; the entries past the last real
    block are never read), and ``num_blocks``, a one-element tensor with the real count, which
    the kernels read to bound their work loop.
    """
    num_seqs = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    cu_blocks = torch.cumsum((lengths + block - 1) // block, 0)
    program_ids = torch.arange(num_tokens // block + num_seqs, device=cu_seqlens.device)
    program_seq = torch.searchsorted(cu_blocks, program_ids, right=True)
    first_block = torch.cat([cu_blocks.new_zeros(1), cu_blocks[:-1]])
    program_block = program_ids - first_block[program_seq.clamp(max=num_seqs - 1)]
    return program_seq.to(torch.int32), program_block.to(torch.int32), cu_blocks[-1:].to(torch.int32)


def clamp_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``cu_seqlens`` made safe to trust, on the device (no host sync): every entry clamped to
    ``[0, num_tokens]``, then its running maximum. The sequences it describes are disjoint row
    ranges inside the ``num_tokens`` rows, each inside its unclamped range (so inside rows that the
    forward wrote), and their block counts sum to at most the program map's length. Consistent
    metadata (0, non-decreasing, ending at ``num_tokens``) comes back with the same values and dtype."""
    return torch.cummax(cu_seqlens.clamp(0, num_tokens), 0).values


@dataclass(frozen=True)
class Packing:
    """How query heads fill the ``block_m`` rows of a query tile (GQA packing, one rule for every
    caller): ``head_chunk`` heads of one KV group per query, ``block_q`` queries per tile,
    ``num_chunks`` tiles to cover the group."""

    head_chunk: int
    block_q: int
    num_chunks: int


def packing(group: int, block_m: int) -> Packing:
    """The :class:`Packing` of ``group`` query heads per KV head into ``block_m``-row tiles. The
    launchers look it up on this module at call time (the bench's old-schedule overrides replace it)."""
    head_chunk = min(group, block_m)
    return Packing(head_chunk, block_m // head_chunk, -(-group // head_chunk))


def num_segments(max_kv_len: int, seg: int) -> int:
    """KV segments of ``seg`` positions (anchored at position 0) that cover ``max_kv_len`` keys; at least one."""
    return max(1, -(-max_kv_len // seg))
