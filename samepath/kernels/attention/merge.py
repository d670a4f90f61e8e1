"""The split schedule's second step: fold the KV segments' softmax states of every (token, head) row.

The forward (``forward.py``) runs the fixed KV segments either serially inside one program or as
one program each, writing each segment's state ``(m, l, acc)`` to a workspace; this kernel then
folds a row's segments in ascending order with :func:`merge_segment` — the serial schedule's very
merge — and divides and casts with :func:`store_rows`, so both executions give the same bits.
"""

from __future__ import annotations

import torch
import triton.language as tl

from samepath.kernels import grid, ub_fit
from samepath.kernels.dispatch import jit

#: Rows of the merge kernel's programs (``ub_fit`` sizes its buffers from the same number).
MERGE_BLOCK_ROWS = ub_fit.MERGE_BLOCK_ROWS
#: Warps of the merge kernel's programs.
MERGE_NUM_WARPS = 4
#: log2(e): a sink logit joins the base-2 running state as ``sink * SINK_LOG2E`` (the scores' scale).
SINK_LOG2E = tl.constexpr(1.4426950408889634)


@jit
def initial_state(Sinks, head, row_valid, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The running state ``(m, l, acc)`` a row's segments are folded into: empty ``(-inf, 0, 0)``, or
    with ``HAS_SINKS`` the head's sink logit ``(sink * log2(e), 1, 0)`` — a key of value zero that every
    row sees, counted once whatever the segments (its fp32 ``Sinks[head]``, scaled by the constant)."""
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(Sinks + head, mask=row_valid, other=0.0).to(tl.float32) * SINK_LOG2E
        return sink, tl.full([BLOCK_R], 1.0, dtype=tl.float32), acc
    return tl.full([BLOCK_R], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_R], dtype=tl.float32), acc


@jit
def merge_segment(m_run, l_run, acc_run, m_seg, l_seg, acc_seg):
    """Fold one segment's state into the running state (segments in ascending order). A segment
    in which a row sees nothing (``m_seg = -inf``) leaves that row's running state bitwise as it was."""
    m_new = tl.maximum(m_run, m_seg)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_shift)
    beta = tl.exp2(m_seg - m_shift)
    l_new = l_run * alpha + l_seg * beta
    acc_new = acc_run * alpha[:, None] + acc_seg * beta[:, None]
    empty = m_seg == float("-inf")
    return (
        tl.where(empty, m_run, m_new),
        tl.where(empty, l_run, l_new),
        tl.where(empty[:, None], acc_run, acc_new),
    )


@jit
def store_rows(
    m_i,
    l_i,
    acc,
    Out,
    Lse,
    q_rows,
    head,
    row_valid,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    col_start,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """``acc / l`` cast once to the output dtype (and the base-2 log-sum-exp, ``+inf`` for a row
    that saw nothing). ``acc`` holds the output columns ``col_start ..`` (a wide head's value-column
    block; 0 otherwise) of the ``HEAD_SIZE`` columns; the block at column 0 stores the lse."""
    offs_d = tl.arange(0, BLOCK_D)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + (col_start + offs_d)[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (col_start + offs_d < HEAD_SIZE)[None, :],
    )
    if STORE_LSE:
        lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
        tl.store(Lse + q_rows * stride_lse_tok + head, lse, mask=row_valid & (q_rows * 0 + col_start == 0))


@jit
def _attention_merge_kernel(
    PartM,
    PartL,
    PartAcc,
    RowSegments,
    Out,
    Lse,
    Sinks,
    num_rows,
    num_heads,
    num_segments,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Second step of the split schedule: each (token, head) row folds its segments' states into
    one, in ascending segment order with :func:`merge_segment` (the serial schedule's merge), from
    the serial schedule's :func:`initial_state`, then divides and casts as the serial schedule does.
    A row folds the segments its block owns in the forward's work list (``RowSegments``, clamped to
    the workspace's ``num_segments``); the segments past them are empty for the row, as folding them
    would leave its state unchanged."""
    offs_d = tl.arange(0, BLOCK_D)
    num_work = tl.cdiv(num_rows, BLOCK_R)
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        offs_r = work * BLOCK_R + tl.arange(0, BLOCK_R)
        row_valid = offs_r < num_rows
        rows = offs_r.to(tl.int64)
        row_segments = tl.load(RowSegments + rows, mask=row_valid, other=0)
        row_segments = tl.minimum(tl.maximum(row_segments, 0), num_segments)
        m_run, l_run, acc_run = initial_state(Sinks, rows % num_heads, row_valid, BLOCK_R, BLOCK_D, HAS_SINKS)
        for segment in range(0, tl.max(row_segments, 0)):
            part = rows * num_segments + segment
            owned = row_valid & (segment < row_segments)
            m_seg = tl.load(PartM + part, mask=owned, other=float("-inf"))
            l_seg = tl.load(PartL + part, mask=owned, other=0.0)
            seen = owned & (m_seg > float("-inf"))
            acc_seg = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=seen[:, None], other=0.0)
            m_run, l_run, acc_run = merge_segment(m_run, l_run, acc_run, m_seg, l_seg, acc_seg)
        store_rows(
            m_run, l_run, acc_run, Out, Lse, rows // num_heads, rows % num_heads, row_valid, stride_o_tok,
            stride_o_head, stride_lse_tok, 0, HEAD_SIZE, BLOCK_D, STORE_LSE,
        )  # fmt: skip


def launch_merge(
    part_m: torch.Tensor,
    part_l: torch.Tensor,
    part_acc: torch.Tensor,
    row_segments: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_segments: int,
    block_d: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fold the partial states of every row of ``out`` (``[tokens, heads, head_size]``; ``num_segments``
    per row in the workspace, of which row ``r`` folds its first ``row_segments[r]``) into ``out``
    (and the base-2 ``lse`` when given), from each head's sink when ``sinks`` (fp32 ``[heads]``)."""
    num_tokens, num_heads, head_size = out.shape
    rows = num_tokens * num_heads
    merge_work = -(-rows // MERGE_BLOCK_ROWS)
    _attention_merge_kernel[(grid.num_programs(merge_work, out.device),)](
        part_m,
        part_l,
        part_acc,
        row_segments,
        out,
        out if lse is None else lse,
        out if sinks is None else sinks,
        rows,
        num_heads,
        num_segments,
        out.stride(0),
        out.stride(1),
        0 if lse is None else lse.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        BLOCK_R=MERGE_BLOCK_ROWS,
        STORE_LSE=lse is not None,
        HAS_SINKS=sinks is not None,
        num_warps=MERGE_NUM_WARPS,
    )
