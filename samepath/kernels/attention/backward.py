"""The attention backward (training): one deterministic pass per KV tile, and the autograd Function.

:func:`launch_backward` is the Triton backend's backward launcher (``triton_backend.py`` registers
it); :class:`VarlenAttentionFunction` runs the selected backend's forward and backward
(:mod:`.backend`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

import samepath.kernels.attention.plan as plan
from samepath.kernels import grid, ub_fit
from samepath.kernels.attention.backend import run_backward, run_forward
from samepath.kernels.attention.batch import AttentionBatch, last_dim_contiguous
from samepath.kernels.attention.forward import DOT_PRECISION, LOG2E, score_scales, value_blocks
from samepath.kernels.config import padded_head_size
from samepath.kernels.dispatch import jit
from samepath.kernels.reductions import row_sum
from samepath.kernels.softcap import tanh_fp32

#: Rows (token, head) of ``delta`` per step of :func:`_attention_bwd_preprocess_kernel` (sized for an
#: Ascend core's UB by ``ub_fit``); the rows are independent, so this fixes no bit (a row's sum is over
#: its head only).
DELTA_ROWS = ub_fit.DELTA_ROWS
DELTA_NUM_WARPS = 4


@jit
def _attention_bwd_preprocess_kernel(
    Out,
    dOut,
    Delta,
    num_rows,
    num_heads,
    stride_o_tok,
    stride_o_head,
    stride_do_tok,
    stride_do_head,
    stride_delta_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The backward's preprocessing: ``delta[t, h] = 0 + sum_d fp32(dO[t, h, d]) * fp32(O[t, h, d])``, one
    ``tl.sum`` over the zero-padded head per row (``BLOCK_R`` rows ``t * num_heads + h`` per step)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    for start in range(tl.program_id(0) * BLOCK_R, num_rows, tl.num_programs(0) * BLOCK_R):
        row = start + offs_r
        valid = row < num_rows
        token = (row // num_heads).to(tl.int64)
        head = row % num_heads
        mask = valid[:, None] & d_valid[None, :]
        o = tl.load(
            Out + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :], mask=mask, other=0.0
        )
        do = tl.load(
            dOut + token[:, None] * stride_do_tok + head[:, None] * stride_do_head + offs_d[None, :],
            mask=mask,
            other=0.0,
        )
        delta = 0.0 + tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(Delta + token * stride_delta_tok + head, delta, mask=valid)


@jit
def _visible_mask_t(pos_q, pos_k, kv_len, sliding_window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """:func:`.forward.visible_mask` transposed, ``[keys, queries]`` (the backward works key-major)."""
    visible = pos_k[:, None] < kv_len
    if CAUSAL:
        visible = visible & (pos_k[:, None] <= pos_q[None, :])
    if HAS_WINDOW:
        visible = visible & (pos_q[None, :] - pos_k[:, None] < sliding_window)
    return visible


@jit
def _attention_bwd_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dQ,
    dK,
    dV,
    DqAcc,
    Sync,
    cu_seqlens,
    program_seq,
    program_block,
    num_blocks,
    num_kv_heads,
    qk_scale,
    sm_scale,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_do_tok,
    stride_do_head,
    stride_dq_tok,
    stride_dq_head,
    stride_dk_tok,
    stride_dk_head,
    stride_dv_tok,
    stride_dv_head,
    stride_acc_tok,
    stride_acc_head,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    softcap_scale,
    SOFTCAP: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_COLS: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One pass of the backward. A work item is one KV tile (``BLOCK_N`` keys of one KV head of
    one sequence): it keeps dK and dV in registers while it visits the GQA-packed query tiles that
    see it (head chunks in order, query blocks ascending), computing per pair ``S^T``, ``dP^T``,
    ``dV += P^T dO``, ``dK += dS^T Q`` and the dQ partial ``(dS K)^T`` — five tile matmuls, key-major
    (the keys are the rows, so Hopper's wgmma runs each with M = ``BLOCK_N`` or the head size; every
    element is the same products summed in the same order as the query-major forms). ``Delta`` is
    :func:`_attention_bwd_preprocess_kernel`'s ``rowsum(dO * O)``.

    dQ partials are summed in ascending KV-tile order with no atomics on data: ``Sync[1 + t]``
    (``t`` one per packed query tile) counts the KV tiles that have added theirs to the fp32 row
    sums in ``DqAcc``; KV tile ``j`` waits until the count is ``j - first`` (``first`` the lowest
    KV tile that visits the query tile), adds, and releases. The first contributor writes its
    partial, the last one scales, casts and writes dQ. Items are taken in ascending order from the
    ticket counter ``Sync[0]``, and item ``j`` only waits for item ``j - 1`` of its sequence and
    head, taken earlier by a running program: the lowest unfinished item never waits, so no grid
    size, residency or dispatch order can deadlock (and the interpreter, which runs programs one
    after the other, takes every item in program 0).

    The kernel trusts ``cu_seqlens`` and the program map built from it; the launcher hands it
    :func:`.plan.clamp_cu_seqlens` of the caller's metadata and the map of that, so every row it touches
    lies inside the tensors, query tiles of different sequences never share a counter, and every
    KV tile a counter waits for is a work item, whatever unchecked metadata held.

    The value (``dO``, ``dV``) has ``HEAD_SIZE_V`` columns, padded to ``BLOCK_DV``. ``WIDE`` (a key head
    above 256, MLA's latent): an item is a KV tile and one block ``col`` of ``BLOCK_DV`` columns, for which
    it computes dK, dV and the dQ partials (``NUM_COLS`` blocks cover the wider of the two heads); ``S^T``
    and ``dP^T`` are summed over the heads' ``BLOCK_D``-column chunks in ascending order, the same in
    every column block; a query tile's dQ partials are summed per column block (their own counters)."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, BLOCK_DV)
    num_work = tl.load(num_blocks) * num_kv_heads * NUM_COLS
    work = tl.atomic_add(Sync, 1)
    while work < num_work:
        col = work % NUM_COLS
        item = work // NUM_COLS
        kv_head = item % num_kv_heads
        seq = tl.load(program_seq + item // num_kv_heads)
        block = tl.load(program_block + item // num_kv_heads)
        start = tl.load(cu_seqlens + seq)
        seq_len = tl.load(cu_seqlens + seq + 1) - start

        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_rows = (start + offs_n).to(tl.int64)
        if WIDE:
            # This item's columns: col * BLOCK_DV + offs_dv of dK / dQ (key head) and dV (value head).
            cols = col * BLOCK_DV + offs_dv
            key_cols = cols < HEAD_SIZE
            dv_valid = cols < HEAD_SIZE_V
            kd_mask = (offs_n < seq_len)[:, None] & key_cols[None, :]
            vd_mask = (offs_n < seq_len)[:, None] & dv_valid[None, :]
            k = tl.load(
                K + kv_rows[:, None] * stride_k_tok + kv_head * stride_k_head + cols[None, :], mask=kd_mask, other=0.0
            )
            k_base = K + kv_rows[:, None] * stride_k_tok + kv_head * stride_k_head
            v_base = V + kv_rows[:, None] * stride_v_tok + kv_head * stride_v_head
            n_valid = (offs_n < seq_len)[:, None]
        else:
            cols = offs_dv
            key_cols = d_valid
            dv_valid = offs_dv < HEAD_SIZE_V
            kd_mask = (offs_n < seq_len)[:, None] & d_valid[None, :]
            vd_mask = (offs_n < seq_len)[:, None] & dv_valid[None, :]
            k = tl.load(
                K + kv_rows[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :], mask=kd_mask, other=0.0
            )
            v = tl.load(
                V + kv_rows[:, None] * stride_v_tok + kv_head * stride_v_head + offs_dv[None, :],
                mask=vd_mask,
                other=0.0,
            )

        q_begin = 0
        if CAUSAL:
            q_begin = block * BLOCK_N
        q_end = seq_len
        if HAS_WINDOW:
            q_end = tl.minimum(seq_len, (block + 1) * BLOCK_N + sliding_window - 1)
        last_tile = (seq_len - 1) // BLOCK_N

        if WIDE:
            dk = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        else:
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            head_in_group = chunk * HEAD_CHUNK + offs_r % HEAD_CHUNK
            head = kv_head * GROUP + head_in_group
            for q_block in range(q_begin // BLOCK_Q, tl.cdiv(q_end, BLOCK_Q)):
                offs_m = q_block * BLOCK_Q + offs_r // HEAD_CHUNK
                row_valid = (offs_r < BLOCK_Q * HEAD_CHUNK) & (head_in_group < GROUP) & (offs_m < seq_len)
                rows = (start + offs_m).to(tl.int64)
                qd_mask = row_valid[:, None] & key_cols[None, :]
                if WIDE:
                    q = tl.load(
                        Q + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + cols[None, :],
                        mask=qd_mask,
                        other=0.0,
                    )
                else:
                    q = tl.load(
                        Q + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                        mask=qd_mask,
                        other=0.0,
                    )
                do = tl.load(
                    dOut + rows[:, None] * stride_do_tok + head[:, None] * stride_do_head + cols[None, :],
                    mask=row_valid[:, None] & dv_valid[None, :],
                    other=0.0,
                )
                lse = tl.load(Lse + rows * stride_lse_tok + head, mask=row_valid, other=0.0)
                delta = tl.load(Delta + rows * stride_lse_tok + head, mask=row_valid, other=0.0)

                # Key-major: the KV tile's keys are the rows (the M of four of the five dots, the
                # head that of the dQ partial's), the packed query rows the columns.
                if WIDE:  # S^T and dP^T over the whole heads, BLOCK_D columns at a time
                    q_base = Q + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head
                    do_base = dOut + rows[:, None] * stride_do_tok + head[:, None] * stride_do_head
                    scores_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                    for d_start in range(0, HEAD_SIZE, BLOCK_D):
                        k_c = tl.load(k_base + d_start + offs_d[None, :], mask=n_valid, other=0.0)
                        q_c = tl.load(q_base + d_start + offs_d[None, :], mask=row_valid[:, None], other=0.0)
                        scores_t = tl.dot(k_c, tl.trans(q_c), scores_t, input_precision=DOT_PRECISION)
                    dp_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                    for d_start in range(0, HEAD_SIZE_V, BLOCK_D):
                        v_c = tl.load(v_base + d_start + offs_d[None, :], mask=n_valid, other=0.0)
                        do_c = tl.load(do_base + d_start + offs_d[None, :], mask=row_valid[:, None], other=0.0)
                        dp_t = tl.dot(v_c, tl.trans(do_c), dp_t, input_precision=DOT_PRECISION)
                else:
                    scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
                if SOFTCAP:  # the forward's t = tanh(dot * scale / cap); d(score) / d(dot) is scale * (1 - t * t)
                    scores_t = tanh_fp32(scores_t * softcap_scale)
                visible_t = _visible_mask_t(offs_m, offs_n, seq_len, sliding_window, CAUSAL, HAS_WINDOW)
                visible_t = visible_t & row_valid[None, :]
                p_t = tl.where(visible_t, tl.exp2(scores_t * qk_scale - lse[None, :]), 0.0)
                dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
                if not WIDE:
                    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                if SOFTCAP:
                    ds_t = ds_t * (1.0 - scores_t * scores_t)
                ds_t = ds_t.to(q.dtype)
                dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
                dq_t = tl.dot(tl.trans(k), ds_t, input_precision=DOT_PRECISION)

                # The KV tiles that visit this query tile are first..last, one contiguous range.
                first = 0
                if HAS_WINDOW:
                    first = tl.maximum(0, q_block * BLOCK_Q - sliding_window + 1) // BLOCK_N
                last = last_tile
                if CAUSAL:
                    last = tl.minimum(last_tile, ((q_block + 1) * BLOCK_Q - 1) // BLOCK_N)
                q_tile = ((start + q_block * BLOCK_Q).to(tl.int64) * num_kv_heads + kv_head) * NUM_CHUNKS + chunk
                sync = Sync + 1 + (q_tile * NUM_COLS + col)
                while tl.atomic_add(sync, 0) != block - first:
                    pass
                tl.debug_barrier()
                if WIDE:
                    dq_cols = cols
                else:
                    dq_cols = offs_d
                acc_ptrs = DqAcc + rows[None, :] * stride_acc_tok + head[None, :] * stride_acc_head + dq_cols[:, None]
                dq_mask_t = key_cols[:, None] & row_valid[None, :]
                if block > first:
                    dq_t = tl.load(acc_ptrs, mask=dq_mask_t, other=0.0, cache_modifier=".cg") + dq_t
                if block == last:
                    tl.store(
                        dQ + rows[None, :] * stride_dq_tok + head[None, :] * stride_dq_head + dq_cols[:, None],
                        (dq_t * sm_scale).to(dQ.dtype.element_ty),
                        mask=dq_mask_t,
                    )
                else:
                    tl.store(acc_ptrs, dq_t, mask=dq_mask_t, cache_modifier=".cg")
                    tl.debug_barrier()
                    tl.atomic_add(sync, 1)

        dk = dk * sm_scale
        if WIDE:
            dk_cols = cols
        else:
            dk_cols = offs_d
        tl.store(
            dK + kv_rows[:, None] * stride_dk_tok + kv_head * stride_dk_head + dk_cols[None, :],
            dk.to(dK.dtype.element_ty),
            mask=kd_mask,
        )
        tl.store(
            dV + kv_rows[:, None] * stride_dv_tok + kv_head * stride_dv_head + cols[None, :],
            dv.to(dV.dtype.element_ty),
            mask=vd_mask,
        )
        work = tl.atomic_add(Sync, 1)


def backward_delta(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The backward's preprocessing: ``delta = rowsum(dO * O)`` (``[tokens, heads]`` fp32, laid out like
    ``lse``) by :func:`_attention_bwd_preprocess_kernel` — one launch reading ``out`` and ``grad_out``
    (``[tokens, heads, head_size]``, last dimension contiguous) once, no fp32 copies. Every attention
    backend's backward takes its ``delta`` from here."""
    num_tokens, num_heads, head_size = out.shape
    delta = torch.empty_like(lse)
    rows = num_tokens * num_heads
    if rows == 0:
        return delta
    block_d = padded_head_size(head_size)
    # A wide value head (MLA's 512) takes fewer rows per step, so that fp32 tiles still fit an Ascend core's
    # UB (ub_fit.attention_delta_buffers); a row's sum is over its own head only, so no bit depends on it.
    block_r = DELTA_ROWS if block_d <= 256 else max(1, DELTA_ROWS * 256 // block_d)
    programs = grid.num_programs(-(-rows // block_r), out.device)
    _attention_bwd_preprocess_kernel[(programs,)](
        out,
        grad_out,
        delta,
        rows,
        num_heads,
        out.stride(0),
        out.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        delta.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        num_warps=DELTA_NUM_WARPS,
    )
    return delta


def launch_backward(
    batch: AttentionBatch,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in one launch of :func:`_attention_bwd_kernel` (one item per KV tile and KV head),
    written into ``grads = (dq, dk, dv)`` when given (shaped like query, key, value).

    ``batch.query_start_loc`` is the clamped ``cu_seqlens`` (:func:`.backend.run_backward` clamps it),
    so whatever unchecked metadata held, the kernel reads and writes only rows of the given tensors and
    every dQ counter wait ends: the clamped sequences are disjoint, and each KV tile that a query tile's
    counter waits for is a work item of the program map built from the same clamped values. Rows
    outside every clamped sequence are left unwritten.

    Workspace, O(tokens): ``delta`` (:func:`backward_delta`), the fp32 dQ row sums
    (``[tokens, heads, head_size]``) and one int32 counter per packed query tile (plus the ticket
    counter), zeroed here on the device."""
    query, key, value, config = batch.query, batch.key, batch.value, batch.config
    cu_seqlens = batch.query_start_loc
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    delta = backward_delta(out, grad_out, lse)
    dq, dk, dv = grads if grads is not None else (torch.empty_like(t) for t in (query, key, value))
    num_seqs = cu_seqlens.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    group = num_heads // num_kv_heads
    pack = plan.packing(group, config.bwd_block_m)
    head_size_v = value.shape[-1]
    block_d, block_dv, num_cols, wide = value_blocks(head_size, head_size_v, config)
    if wide:  # the items' column blocks cover the wider head (dK and dQ: the key's, dV: the value's)
        num_cols = -(-max(head_size, head_size_v) // block_dv)
    dq_acc = torch.empty((num_tokens, num_heads, head_size), dtype=torch.float32, device=query.device)
    sync_count = 1 + num_tokens * num_kv_heads * pack.num_chunks * num_cols
    sync = torch.zeros(sync_count, dtype=torch.int32, device=query.device)
    if batch.plan is None:
        program_seq, program_block, num_blocks = plan.program_map(cu_seqlens, config.bwd_block_n, num_tokens)
    else:
        _, program_seq, program_block, num_blocks = batch.plan.clamped_program_map(config.bwd_block_n)
    programs = grid.num_programs(program_seq.numel() * num_kv_heads * num_cols, query.device, uses_dot=True)
    _attention_bwd_kernel[(programs,)](
        query,
        key,
        value,
        grad_out,
        lse,
        delta,
        dq,
        dk,
        dv,
        dq_acc,
        sync,
        cu_seqlens,
        program_seq,
        program_block,
        num_blocks,
        num_kv_heads,
        score_scales(batch)[0],
        batch.scale,
        batch.sliding_window or 0,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        dq.stride(0),
        dq.stride(1),
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        dq_acc.stride(0),
        dq_acc.stride(1),
        lse.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        BLOCK_M=config.bwd_block_m,
        BLOCK_Q=pack.block_q,
        BLOCK_N=config.bwd_block_n,
        GROUP=group,
        HEAD_CHUNK=pack.head_chunk,
        NUM_CHUNKS=pack.num_chunks,
        CAUSAL=batch.causal,
        HAS_WINDOW=batch.sliding_window is not None,
        DOT_PRECISION=DOT_PRECISION,
        softcap_scale=score_scales(batch)[1],
        SOFTCAP=batch.softcap is not None,
        HEAD_SIZE_V=head_size_v,
        BLOCK_DV=block_dv,
        NUM_COLS=num_cols,
        WIDE=wide,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return dq, dk, dv


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of each head's sink logit: ``-sum_t p_sink(t) * delta(t)`` with the sink's share
    ``p_sink = exp2(sink * log2(e) - lse)`` of each row's base-2 log-sum-exp (which counts the sink)
    and the backward's own ``delta = rowsum(dO * O)`` (:func:`backward_delta`, the one formula every
    backend's backward uses); the sum over the rows on :func:`samepath.kernels.reductions.row_sum`'s
    fixed schedule, in token order: deterministic. The sink's value is zero, so the other gradients
    need nothing more than the lse that counts it. Returned in ``sinks.dtype``."""
    delta = backward_delta(out, grad_out, lse)
    share = torch.exp2(sinks.detach().float() * LOG2E - lse)
    contribution = torch.where(torch.isfinite(lse), -(share * delta), 0.0)
    return row_sum(contribution.t().contiguous()).to(sinks.dtype)


class VarlenAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`~samepath.kernels.attention.varlen_attention` over one :class:`AttentionBatch`
    (whose query, key and value — and its sinks, or None — are the Function's tensor inputs); the
    backward is deterministic (no atomics)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, batch):  # type: ignore[override]
        out = query.new_empty((*query.shape[:2], value.shape[-1]))
        lse = run_forward(batch, out, store_lse=True)
        ctx.save_for_backward(query, key, value, out, lse, batch.query_start_loc, sinks)
        ctx.batch = batch  # its tensors are the saved ones; backward rebuilds it from those (version-checked)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        query, key, value, out, lse, cu_seqlens, sinks = ctx.saved_tensors
        batch = dataclasses.replace(ctx.batch, query=query, key=key, value=value, query_start_loc=cu_seqlens)
        grad_out = last_dim_contiguous(grad_out)
        dq, dk, dv = run_backward(batch, out, lse, grad_out)
        dsinks = sink_grad(sinks, out, lse, grad_out) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None
