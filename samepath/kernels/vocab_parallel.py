"""Vocab-parallel token log-probs, the kernels: one vocab shard's ``(lse_s, zlab_s)`` state, the
merge of ``S`` shard states in ascending shard order, and one shard's gradient with the merged lse.

The formulas, and the tensor-parallel functions built on them (the collectives, the autograd
Functions), are in :mod:`samepath.distributed`, which re-exports :func:`shard_lse` and
:func:`merge_shard_lse`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import RowReduceConfig
from samepath.kernels.dispatch import jit
from samepath.kernels.logprobs import IGNORE_INDEX, token_logprobs_backward
from samepath.kernels.row_reduce import check_logits, check_temperature, resolve_config, row_lse, row_offsets

_MERGE_BLOCK = 16
#: Local labels of the vocab-parallel backward: a row whose label is another shard's, an ignored row.
_NOT_IN_SHARD, _IGNORED = -1, -2


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@jit
def _shard_lse_kernel(
    X,
    row_offsets,
    Labels,
    Lse,
    ZLabel,
    rows,
    stride_v,
    V_shard,
    col_begin,
    temperature,
    CHUNK: tl.constexpr,
):
    """Per row of one vocab shard: the shard's lse and the label's x / T (-inf if not in the shard)."""
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        lse, _ = row_lse(row_ptr, stride_v, V_shard, temperature, CHUNK, False)
        local = tl.load(Labels + row).to(tl.int64) - col_begin
        in_shard = (local >= 0) & (local < V_shard)
        # The label's x / T as the one live lane of a 16-lane vector, as token_logprobs computes it.
        lanes = tl.arange(0, 16)
        ptrs = row_ptr + (tl.where(in_shard, local, 0) + lanes) * stride_v
        x_lanes = tl.load(ptrs, mask=lanes == 0, other=0.0).to(tl.float32)
        z_label = tl.sum(tl.math.div_rn(x_lanes, temperature), 0)
        tl.store(Lse + row, lse)
        tl.store(ZLabel + row, tl.where(in_shard, z_label, float("-inf")))


@jit
def _merge_kernel(
    Lse,
    ZLabel,
    Labels,
    LogProb,
    MergedLse,
    rows,
    V_shard,
    ignore_index,
    NUM_SHARDS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_IGNORE: tl.constexpr,
):
    """Merge ``[S, rows]`` shard states in ascending shard order (the formula in the module doc)."""
    for block in range(tl.program_id(0), tl.cdiv(rows, BLOCK), tl.num_programs(0)):
        offs = block * BLOCK + tl.arange(0, BLOCK)
        valid = offs < rows
        label = tl.load(Labels + offs, mask=valid, other=0).to(tl.int64)
        owner = label // V_shard
        lse = tl.load(Lse + offs, mask=valid, other=0.0)
        z = tl.where(owner == 0, tl.load(ZLabel + offs, mask=valid, other=0.0), float("-inf"))
        for s in tl.static_range(1, NUM_SHARDS):
            lse_s = tl.load(Lse + s * rows + offs, mask=valid, other=0.0)
            m = tl.maximum(lse, lse_s)
            c = tl.where(m == float("-inf"), 0.0, m)
            lse = c + tl.log(tl.exp(lse - c) + tl.exp(lse_s - c))
            z = tl.where(owner == s, tl.load(ZLabel + s * rows + offs, mask=valid, other=0.0), z)
        in_range = (label >= 0) & (owner < NUM_SHARDS)
        logprob = tl.where(in_range, z - lse, float("nan"))
        if HAS_IGNORE:
            logprob = tl.where(label == ignore_index, 0.0, logprob)
        tl.store(LogProb + offs, logprob, mask=valid)
        tl.store(MergedLse + offs, lse, mask=valid)


# ----------------------------------------------------------------------------------------------
# One-shard state and the merge (used by both sides)
# ----------------------------------------------------------------------------------------------


def shard_lse(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    col_begin: int,
    temperature: float = 1.0,
    *,
    config: RowReduceConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(lse_s, zlab_s)`` of one vocab shard (fp32, ``[rows]`` each, rows flattened).

    ``logits_shard`` ``[..., Vs]`` holds the global columns ``[col_begin, col_begin + Vs)``, any
    strides (a column slice of the full logits is read in place); ``labels`` are global ids.
    """
    check_logits(logits_shard, "logits_shard")
    temperature = check_temperature(temperature)
    cfg = resolve_config(config, logits_shard.device)
    labels_flat = labels.reshape(-1).contiguous()
    rows = labels_flat.numel()
    lse = torch.empty(rows, dtype=torch.float32, device=logits_shard.device)
    zlab = torch.empty(rows, dtype=torch.float32, device=logits_shard.device)
    if rows:
        _shard_lse_kernel[(grid.num_programs(rows, logits_shard.device),)](
            logits_shard,
            row_offsets(logits_shard),
            labels_flat,
            lse,
            zlab,
            rows,
            logits_shard.stride(-1),
            logits_shard.shape[-1],
            int(col_begin),
            temperature,
            CHUNK=cfg.vocab_chunk,
            num_warps=cfg.num_warps,
        )
    return lse, zlab


def merge_states(
    lse: torch.Tensor, zlab: torch.Tensor, labels_flat: torch.Tensor, shard_size: int, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob, merged lse)``, ``[rows]`` each, of ``[S, rows]`` shard states."""
    num_shards, rows = lse.shape
    out = torch.empty(rows, dtype=torch.float32, device=lse.device)
    merged = torch.empty(rows, dtype=torch.float32, device=lse.device)
    if rows:
        _merge_kernel[(grid.num_programs(triton.cdiv(rows, _MERGE_BLOCK), lse.device),)](
            lse.contiguous(),
            zlab.contiguous(),
            labels_flat,
            out,
            merged,
            rows,
            int(shard_size),
            ignore_index if ignore_index is not None else 0,
            NUM_SHARDS=num_shards,
            BLOCK=_MERGE_BLOCK,
            HAS_IGNORE=ignore_index is not None,
        )
    return out, merged


def merge_shard_lse(
    lse: torch.Tensor,
    zlab: torch.Tensor,
    labels: torch.Tensor,
    shard_size: int,
    *,
    ignore_index: int | None = IGNORE_INDEX,
) -> torch.Tensor:
    """Merge ``[S, rows]`` shard states (``lse``, ``zlab``, in shard order) into fp32 logprobs
    ``labels.shape``; the formula is in the module docstring. Not differentiable."""
    if lse.dim() != 2 or lse.shape != zlab.shape or lse.dtype != torch.float32 or zlab.dtype != torch.float32:
        raise ValueError("lse and zlab must be fp32 tensors of the same shape [num_shards, rows]")
    labels_flat = labels.reshape(-1).contiguous()
    if labels_flat.numel() != lse.shape[1]:
        raise ValueError(f"labels hold {labels_flat.numel()} rows, the shard states {lse.shape[1]}")
    out, _ = merge_states(lse, zlab, labels_flat, shard_size, ignore_index)
    return out.reshape(labels.shape)


def shard_grad(
    logits_shard: torch.Tensor,
    labels_flat: torch.Tensor,
    col_begin: int,
    merged_lse: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    ignore_index: int | None,
    config: RowReduceConfig,
) -> torch.Tensor:
    """``d logprob / d logits_shard`` (in ``logits_shard.dtype``) by ``token_logprobs``' backward
    kernel: the shard's columns with the merged lse, its local label (or none), ignored rows 0."""
    labels64 = labels_flat.to(torch.int64)
    local = labels64 - col_begin
    local = torch.where((local >= 0) & (local < logits_shard.shape[-1]), local, _NOT_IN_SHARD)
    kernel_ignore = None
    if ignore_index is not None:
        local = torch.where(labels64 == ignore_index, _IGNORED, local)
        kernel_ignore = _IGNORED
    return token_logprobs_backward(
        logits_shard,
        local,
        row_offsets(logits_shard),
        merged_lse,
        None,
        grad.reshape(-1),
        None,
        temperature,
        kernel_ignore,
        config,
    )


__all__ = ["merge_shard_lse", "merge_states", "shard_grad", "shard_lse"]
