"""The attention schedule's bookkeeping, on the host and the device: which program runs which query
block (the program map), how query heads fill a tile (GQA packing), how many KV segments a
launch needs and which of them hold keys (the split schedule's work list). Pure functions of the
shapes, the cumulative lengths and the KV lengths, on the device without host syncs; no kernel
lives here.

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


def segment_work(
    program_seq: torch.Tensor,
    num_blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_first_pos: torch.Tensor | None,
    max_kv_len: int,
    seg: int,
    max_segments: int,
) -> torch.Tensor:
    """The split schedule's work list, on the device (no host sync): ``cu[b]``, the number of KV
    segments of the program map's blocks ``0 .. b`` (inclusive; ``int32``, as long as the map).

    Block ``b`` (of sequence ``s = program_seq[b]``, clamped to a real sequence as the kernel does)
    owns the segments ``0 .. cu[b] - cu[b - 1] - 1``: those that hold any of ``s``'s keys, counted
    from the segment of its first key (``kv_first_pos[s]``, 0 without it) — the
    ``ceil((kv_pos0 + min(seq_lens[s], max_kv_len) - base) / seg)`` segments from
    ``base = (max(kv_pos0, 0) // seg) * seg``, clamped to ``[0, max_segments]`` (the workspace's
    segments, so even unchecked metadata stays inside it). Blocks past ``num_blocks`` own none.
    Every segment past them is empty for every row of the block (the kernel leaves such a row's
    state fresh), so skipping them changes no bit; the work, the grid and the merge follow the
    context, not ``max_kv_len`` (a block table's width)."""
    num_seqs = seq_lens.numel()
    mapped = program_seq.numel()
    if num_seqs == 0 or mapped == 0:
        return torch.zeros(mapped, dtype=torch.int32, device=program_seq.device)
    seq = program_seq.to(torch.int64).clamp(0, num_seqs - 1)
    kv_len = torch.clamp(seq_lens, max=max_kv_len)
    base = torch.zeros_like(kv_len)
    if kv_first_pos is not None:
        kv_pos0 = kv_first_pos.to(kv_len.dtype)
        kv_len = kv_pos0 + kv_len
        base = torch.div(kv_pos0.clamp(min=0), seg, rounding_mode="floor") * seg
    count = torch.div(kv_len.to(torch.int64) - base + (seg - 1), seg, rounding_mode="floor").clamp(0, max_segments)
    real = torch.arange(mapped, device=program_seq.device) < num_blocks.to(torch.int64)
    per_block = torch.where(real, count[seq], 0)
    return torch.cumsum(per_block, 0).to(torch.int32)
