"""Tensor parallelism with samepath's invariant: a TP-S rollout equals a one-device trainer bitwise.

A stock row-parallel linear sums its shards' partial products with an all-reduce whose order (and
precision: often the bf16 outputs) the library does not control, so TP=k and TP=1 differ in the
last bits. samepath fixes one order that both sides can run (docs/numerics.md, issue 9):

**Row-parallel linear** (K sharded). Rank ``r`` of ``S`` holds ``x[..., r*K/S:(r+1)*K/S]`` and the
matching columns of the weight, and computes its fp32 partial with the usual schedule,
``P_r = matmul(x_r, w_r.T, out_dtype=torch.float32)``. The partials are exchanged with
``dist.all_gather`` (every rank receives every partial, bit for bit) and every rank sums them in
ascending rank order in fp32, exactly as ``matmul(x, w.T, k_slices=S)`` sums its slices::

    total = P_0                      # the first partial taken as is
    total = total + P_1              # fp32, IEEE
    ...
    total = total + P_{S-1}
    total = total + bias.float()     # bias after the partials (if any)
    y = total.to(x.dtype)            # the one cast

An unsharded trainer calling ``linear(x, w, bias, k_slices=S)`` gets the same bits.

**Column-parallel linear** (N sharded). Every output column is one K reduction with the usual
schedule, so rank ``r``'s columns equal the same columns of the unsharded ``linear`` (no
reduction between ranks); ``all_gather`` concatenates them in rank order when the full output is
needed.

**Vocab-parallel token logprobs** (V sharded into S equal contiguous shards). Shard ``s`` holds
columns ``[s*Vs, (s+1)*Vs)`` of the logits. Per row, each shard computes, with samepath's chunked
fp32 online log-sum-exp (the ``_row_lse`` device function of :mod:`samepath.kernels.logprobs`,
chunks of ``vocab_chunk`` starting at the shard's first column; temperature by IEEE division of the
fp32-widened logits first of all)::

    lse_s = m_s + log(s_s)                         # -inf for a shard that holds only -inf
    zlab_s = fp32(x[label]) / fp32(T)  if label in shard s,  else -inf

and the S states are merged per row, serially in ascending shard order, in fp32::

    lse = lse_0
    for s in 1 .. S-1:
        m = max(lse, lse_s);  c = (m == -inf) ? 0 : m
        lse = c + log(exp(lse - c) + exp(lse_s - c))
    zlab = zlab_{label // Vs}
    logprob = zlab - lse                           # 0 for label == ignore_index

The merge runs in one Triton kernel (:func:`merge_shard_lse`), so the TP side (after an
``all_gather`` of every shard's ``(lse_s, zlab_s)``) and the one-process trainer
(:func:`sharded_token_logprobs`, which cuts the full logits into the same S shards) compute the
same bits. With ``S = 1`` the result equals :func:`samepath.token_logprobs` bitwise.

S (the rollout's TP degree) is part of the numerics: trainer and rollout must agree on it.
Transport is torch.distributed (gloo on CPU, NCCL/HCCL on devices); only ``all_gather`` is used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from samepath.kernels.config import RowReduceConfig, register_formula
from samepath.kernels.dispatch import jit
from samepath.kernels.logprobs import (
    IGNORE_INDEX,
    _check_config,
    _check_logits,
    _check_temperature,
    _row_lse,
    _row_offsets,
)
from samepath.kernels.matmul import linear, matmul

DISTRIBUTED_FORMULA = {
    "row_parallel": "fp32 partial per rank (matmul out_dtype=fp32), all_gather, partials summed in ascending "
    "rank order in fp32 (first taken as is), bias after, one cast == matmul(k_slices=S)",
    "column_parallel": "no reduction; all_gather concatenates the ranks' columns in rank order",
    "vocab_parallel": "S equal contiguous vocab shards; per shard fp32 chunked online lse (chunks from the "
    "shard's first column) and fp32 x[label]/T or -inf; merged in ascending shard order: "
    "c = m == -inf ? 0 : m with m = max(lse, lse_s); lse = c + log(exp(lse - c) + exp(lse_s - c)); "
    "logprob = zlab - lse",
    "collective": "all_gather only; no all_reduce",
}
register_formula("distributed", DISTRIBUTED_FORMULA)

_MERGE_BLOCK = 16


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
    stride_v,
    V_shard,
    col_begin,
    temperature,
    CHUNK: tl.constexpr,
):
    """One row of one vocab shard: the shard's lse and the label's x / T (-inf if not in the shard)."""
    row = tl.program_id(0)
    row_ptr = X + tl.load(row_offsets + row)
    lse, _ = _row_lse(row_ptr, stride_v, V_shard, temperature, CHUNK, False)
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
    rows,
    V_shard,
    ignore_index,
    NUM_SHARDS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_IGNORE: tl.constexpr,
):
    """Merge ``[S, rows]`` shard states in ascending shard order (the formula in the module doc)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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
    _check_logits(logits_shard, "logits_shard")
    temperature = _check_temperature(temperature)
    cfg = _check_config(config, logits_shard.device)
    labels_flat = labels.reshape(-1).contiguous()
    rows = labels_flat.numel()
    lse = torch.empty(rows, dtype=torch.float32, device=logits_shard.device)
    zlab = torch.empty(rows, dtype=torch.float32, device=logits_shard.device)
    if rows:
        _shard_lse_kernel[(rows,)](
            logits_shard,
            _row_offsets(logits_shard),
            labels_flat,
            lse,
            zlab,
            logits_shard.stride(-1),
            logits_shard.shape[-1],
            int(col_begin),
            temperature,
            CHUNK=cfg.vocab_chunk,
            num_warps=cfg.num_warps,
        )
    return lse, zlab


def merge_shard_lse(
    lse: torch.Tensor,
    zlab: torch.Tensor,
    labels: torch.Tensor,
    shard_size: int,
    *,
    ignore_index: int | None = IGNORE_INDEX,
) -> torch.Tensor:
    """Merge ``[S, rows]`` shard states (``lse``, ``zlab``, in shard order) into fp32 logprobs
    ``labels.shape``; the formula is in the module docstring."""
    if lse.dim() != 2 or lse.shape != zlab.shape or lse.dtype != torch.float32 or zlab.dtype != torch.float32:
        raise ValueError("lse and zlab must be fp32 tensors of the same shape [num_shards, rows]")
    num_shards, rows = lse.shape
    labels_flat = labels.reshape(-1).contiguous()
    if labels_flat.numel() != rows:
        raise ValueError(f"labels hold {labels_flat.numel()} rows, the shard states {rows}")
    out = torch.empty(rows, dtype=torch.float32, device=lse.device)
    if rows:
        _merge_kernel[(triton.cdiv(rows, _MERGE_BLOCK),)](
            lse.contiguous(),
            zlab.contiguous(),
            labels_flat,
            out,
            rows,
            int(shard_size),
            ignore_index if ignore_index is not None else 0,
            NUM_SHARDS=num_shards,
            BLOCK=_MERGE_BLOCK,
            HAS_IGNORE=ignore_index is not None,
        )
    return out.reshape(labels.shape)


def _check_labels(labels: torch.Tensor, lead: torch.Size, vocab: int, ignore_index: int | None) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError("labels must be an int32/int64 tensor")
    if labels.shape != lead:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal the logits' leading shape {tuple(lead)}")
    values = labels.detach().cpu().to(torch.int64)
    bad = (values < 0) | (values >= vocab)
    if ignore_index is not None:
        bad &= values != ignore_index
    if bad.any():
        raise ValueError(f"labels hold values outside [0, {vocab}) that are not ignore_index={ignore_index}")


def sharded_token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_shards: int,
    temperature: float = 1.0,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """The trainer's side of vocab-parallel logprobs: ``token_logprobs`` computed on one process
    with the shard boundaries of a TP-``num_shards`` rollout (``V % num_shards == 0``).

    Bit-identical to :func:`vocab_parallel_token_logprobs` on ``num_shards`` ranks, and to
    :func:`samepath.token_logprobs` for ``num_shards == 1``. Not differentiable.
    """
    _check_logits(logits)
    vocab = logits.shape[-1]
    if not isinstance(num_shards, int) or num_shards < 1 or vocab % num_shards:
        raise ValueError(f"num_shards = {num_shards!r} must be a positive int dividing the vocabulary {vocab}")
    _check_labels(labels, logits.shape[:-1], vocab, ignore_index)
    size = vocab // num_shards
    states = [
        shard_lse(logits[..., s * size : (s + 1) * size], labels, s * size, temperature, config=config)
        for s in range(num_shards)
    ]
    lse = torch.stack([state[0] for state in states])
    zlab = torch.stack([state[1] for state in states])
    return merge_shard_lse(lse, zlab, labels, size, ignore_index=ignore_index)


# ----------------------------------------------------------------------------------------------
# torch.distributed side
# ----------------------------------------------------------------------------------------------


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """The rollout's side: this rank's ``[..., Vs]`` shard (rank r holds columns ``[r*Vs,
    (r+1)*Vs)``, equal shards) and the global labels (the same on every rank) give fp32 logprobs
    ``labels.shape``, identical on every rank and to :func:`sharded_token_logprobs` with S = the
    group's size."""
    _check_logits(logits_shard, "logits_shard")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = logits_shard.shape[-1]
    _check_labels(labels, logits_shard.shape[:-1], size * world, ignore_index)
    lse, zlab = shard_lse(logits_shard, labels, rank * size, temperature, config=config)
    lse_all = torch.stack(_gather(lse, group))
    zlab_all = torch.stack(_gather(zlab, group))
    return merge_shard_lse(lse_all, zlab_all, labels, size, ignore_index=ignore_index)


def sum_partials(partials: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 partials summed in list order (the first taken as is), bias after, one cast — the
    epilogue of ``matmul(k_slices=S)``."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(dtype)


def row_parallel_linear(
    x_shard: torch.Tensor,
    w_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` for a weight sharded along K: this rank's ``x_shard [..., K/S]`` and
    ``w_shard [N, K/S]`` (rank order = K order). Returns the full ``[..., N]`` on every rank,
    bit-identical to ``linear(x, w, bias, k_slices=S)`` on one process. ``bias`` (full, ``[N]``)
    is added once, after the partials. Not differentiable."""
    lead = x_shard.shape[:-1]
    x2d = x_shard.reshape(-1, x_shard.shape[-1])
    partial = matmul(x2d, w_shard.t(), out_dtype=torch.float32)
    out = sum_partials(_gather(partial, group), bias, x_shard.dtype)
    return out.reshape(*lead, w_shard.shape[0])


def column_parallel_linear(
    x: torch.Tensor,
    w_shard: torch.Tensor,
    bias_shard: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    gather_output: bool = False,
) -> torch.Tensor:
    """``x @ w_shard.T + bias_shard`` — this rank's ``[..., N/S]`` columns, equal to those columns
    of the unsharded ``linear``; with ``gather_output`` the ranks' columns are concatenated in rank
    order (``all_gather``) into the full ``[..., N]``."""
    out = linear(x, w_shard, bias_shard)
    if not gather_output:
        return out
    return torch.cat(_gather(out, group), dim=-1)


__all__ = [
    "DISTRIBUTED_FORMULA",
    "column_parallel_linear",
    "merge_shard_lse",
    "row_parallel_linear",
    "shard_lse",
    "sharded_token_logprobs",
    "sum_partials",
    "vocab_parallel_token_logprobs",
]
