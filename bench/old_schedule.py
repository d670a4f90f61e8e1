"""The schedule samepath ran before issue 14, reproduced for the bench only.

The bench times the current kernels against it in the same run (a baseline named
:data:`LABEL`), so that the table shows what the new schedule buys on the device it runs on.
Nothing here is used by the library: the overrides are scoped to the bench's calls and change
neither the frozen tables, the fingerprint nor the defaults. Its bits differ from the current
schedule's (no KV segments; other matmul pieces on CUDA): it is a timing reference, not a
numerics one.

What it restores, per kernel:

* attention — one query head per tile row block (:func:`unpacked_heads`: ``head_chunk = 1``, so a
  KV group's heads are separate programs that each read the K/V tiles), no KV segments and no
  split (one segment longer than any sequence, run serially), and the old tiles (CUDA 16-bit:
  ``block_m = 32``, ``tile_n = 64``, 4 warps, 2 stages), forward only: the library's backward
  kernel is not the one that schedule ran, so the bench has no old-schedule backward row;
* matmul — the old tiles (CUDA 16-bit: 64 x 64 x 64, fp32: 64 x 32 x 32; 4 warps), K in one piece
  (``k_split = 1``), no GROUP_M swizzle (``group_m = 1``) and one program per output tile
  (:func:`non_persistent_matmul`);
* RMSNorm forward — one row per program (:func:`one_row_per_norm_program`);
* lm_head + log-probs — the unfused pair, ``token_logprobs(linear(h, w))`` with its full logits.

On the CPU (the interpreter) the old attention and matmul tiles equal the current ones; what
differs there is the head packing, the segments, the norm rows and the fused lm_head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from collections.abc import Iterator

import torch

import samepath
from samepath.kernels.config import AttentionConfig, MatmulConfig, padded_head_size
from samepath.kernels.dispatch import device_kind

# The modules themselves (samepath.kernels re-exports functions under some of these names).
attention_plan_module = importlib.import_module("samepath.kernels.attention.plan")
grid_module = importlib.import_module("samepath.kernels.grid")
matmul_module = importlib.import_module("samepath.kernels.matmul")
rms_norm_module = importlib.import_module("samepath.kernels.rms_norm")

LABEL = "samepath old schedule (pre-issue-14)"

#: A segment longer than any sequence the bench builds: one segment, no merge (a multiple of every
#: ``tile_n``).
NO_SEGMENTS = 1 << 24


def attention_config(head_size: int, dtype: torch.dtype, device: torch.device) -> AttentionConfig:
    """The attention tiles before issue 14, with no KV segments."""
    kind = device_kind(device)
    block_d = padded_head_size(head_size)
    if kind == "cuda":
        small = dtype == torch.float32 or block_d == 256
        return AttentionConfig(
            block_m=16 if small else 32,
            tile_n=32 if small else 64,
            seg=NO_SEGMENTS,
            num_warps=4,
            num_stages=2,
            bwd_block_m=16 if small else 32,
            bwd_block_n=16 if small else 32,
        )
    if kind == "npu":
        return AttentionConfig(
            block_m=16, tile_n=32 if block_d == 256 else 64, seg=NO_SEGMENTS, num_warps=1, num_stages=1
        )
    return AttentionConfig(block_m=16, tile_n=32, seg=NO_SEGMENTS)


def matmul_config(dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The matmul tiles before issue 14: one K piece, no GROUP_M swizzle."""
    kind = device_kind(device)
    if kind == "cuda":
        wide = dtype != torch.float32
        return MatmulConfig(64, 64 if wide else 32, 64 if wide else 32, num_warps=4, num_stages=3, k_split=1, group_m=1)
    if kind == "npu":
        return MatmulConfig(64, 64, 64, num_warps=1, num_stages=1, k_split=1, group_m=1)
    return MatmulConfig(16, 32, 32, k_split=1, group_m=1)


@contextlib.contextmanager
def unpacked_heads() -> Iterator[None]:
    """Every query tile holds one query head (``head_chunk = 1``, ``block_q = block_m``): a KV
    group's heads run as separate programs, each loading the group's K/V tiles."""
    original = attention_plan_module.packing

    def one_head(group: int, block_m: int) -> attention_plan_module.Packing:
        return attention_plan_module.Packing(1, block_m, group)

    attention_plan_module.packing = one_head
    try:
        yield
    finally:
        attention_plan_module.packing = original


@contextlib.contextmanager
def non_persistent_matmul() -> Iterator[None]:
    """One matmul program per output tile (the grid before the persistent one)."""

    def num_programs(work_items, device, *, uses_dot=False, persistent=False):
        return grid_module.num_programs(work_items, device, uses_dot=uses_dot)

    shim = types.SimpleNamespace(**{name: getattr(grid_module, name) for name in dir(grid_module)})
    shim.num_programs = num_programs
    matmul_module.grid = shim
    try:
        yield
    finally:
        matmul_module.grid = grid_module


@contextlib.contextmanager
def one_row_per_norm_program() -> Iterator[None]:
    """RMSNorm with one row per program (before several short rows shared a tile)."""
    original = rms_norm_module._tiling

    def one_row(hidden: int, device: torch.device) -> rms_norm_module.NormTiling:
        return dataclasses.replace(original(hidden, device), rows=1)

    rms_norm_module._tiling = one_row
    try:
        yield
    finally:
        rms_norm_module._tiling = original


def paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale):
    """:func:`samepath.paged_attention` on the old schedule, unvalidated as the vLLM integration calls it."""
    config = attention_config(query.shape[-1], query.dtype, query.device)
    with unpacked_heads():
        return samepath.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, config=config,
            split_kv=False, validate=False,
        )  # fmt: skip


def varlen_attention(query, key, value, cu_seqlens, scale):
    """:func:`samepath.varlen_attention` (causal, unvalidated as the Hugging Face integration calls it)
    on the old schedule's forward (call it inside :func:`unpacked_heads`)."""
    config = attention_config(query.shape[-1], query.dtype, query.device)
    return samepath.varlen_attention(query, key, value, cu_seqlens, scale, True, config=config, validate=False)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with non_persistent_matmul():
        return samepath.linear(x, weight, config=matmul_config(x.dtype, x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    with one_row_per_norm_program():
        return samepath.rms_norm(x, weight, eps)


def lm_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """The unfused lm_head + log-probs: ``[rows, vocab]`` logits, then the token log-probs."""
    return samepath.token_logprobs(samepath.linear(hidden, weight), labels, temperature, validate=False)
