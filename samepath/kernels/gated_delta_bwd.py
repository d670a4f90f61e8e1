"""Gated DeltaNet backward in Triton (:mod:`samepath.kernels.gated_delta`'s chunk formula), deterministic.

The forward is rerun storing the state at every chunk start (``States``) and every chunk's UT
transform ``T`` (``TMat``): the forward's bits, and no forward substitution in the backward. The
other chunk quantities are recomputed with the forward's operations (:func:`_chunk_recompute`: the
normalised q, k, the cumulative gates, the decays, the scores), and the chunk formula is
differentiated by hand in two kernels:

1. :func:`_gated_delta_bwd_state_kernel`, one program per (sequence, value head, block of
   :data:`~samepath.kernels.gated_delta.V_BLOCK` value columns), chunks in reverse: the state
   gradient chain ``dS = (q e^gc)^T dO + dS' e^{gc_C} - w^T dvnew`` in registers (``dS'``, the
   gradient of the state after the chunk, zero after the last: the output state is not
   differentiated), with ``vnew = T (v beta) - w S`` and ``dvnew = attn^T dO + kdec dS'``; it stores
   ``dS'`` per chunk, ``vnew``, ``dvnew``, ``dv = (T^T dvnew) beta``, the row sums of ``(T^T dvnew) v``
   per value block, and the initial state's gradient.
2. :func:`_gated_delta_bwd_qkg_kernel`, one program per (sequence, value head), chunk by chunk: the
   column-summed partials ``dO S^T``, ``dO vnew^T``, ``vnew dS'^T``, ``dvnew S^T``,
   ``dvnew (v beta)^T`` over the value blocks in ascending order (every operand read per block, so
   no loop-invariant tile occupies shared memory across the loop), then the chunk's shared part:
   ``dT``, ``dA = -strict(T^T dT T^T)``, the decays, the gates (the reverse cumulative sum as a masked
   column sum), ``dbeta`` (the value blocks' row sums added in ascending order first) and the L2
   norms' backward.

dq / dk come out per value head (fp32) and are summed over each q/k head's value heads in ascending
order. No atomics: every output element has one writer and every sum a fixed order, so the gradients
are identical run to run and the same on every caller of a device kind.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samepath.kernels.dispatch import jit


@jit
def _chunk_recompute(
    Q,
    K,
    G,
    Beta,
    TMat,
    chunk,
    tok,
    valid,
    hk,
    h,
    HK,
    HV,
    DK,
    SCALE,
    EPS,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_T: tl.constexpr,
):
    """The forward's chunk quantities by the forward's operations (the same bits); the UT transform
    ``T`` as the forward rerun stored it (``LOAD_T``: ``TMat [chunks, HV, CHUNK, CHUNK]``, row
    ``chunk``) or by the forward's substitution."""
    rows = tl.arange(0, CHUNK_SIZE)
    kd = tl.arange(0, BLOCK_K)
    lower = rows[:, None] >= rows[None, :]
    qk_mask = valid[:, None] & (kd[None, :] < DK)
    qk_offs = (tok[:, None] * HK + hk) * DK + kd[None, :]
    q0 = tl.load(Q + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
    k0 = tl.load(K + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
    g = tl.load(G + tok * HV + h, mask=valid, other=0.0)
    b = tl.load(Beta + tok * HV + h, mask=valid, other=0.0)
    rq = 1.0 / tl.sqrt(tl.sum(q0 * q0, axis=1) + EPS)
    q = q0 * rq[:, None]
    q = q * SCALE
    rk = 1.0 / tl.sqrt(tl.sum(k0 * k0, axis=1) + EPS)
    k = k0 * rk[:, None]
    gc = tl.cumsum(g, axis=0)
    gc_last = tl.sum(tl.where(rows == CHUNK_SIZE - 1, gc, 0.0), axis=0)
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    kb = k * b[:, None]
    m = tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION)
    if LOAD_T:
        t = tl.load(TMat + ((chunk * HV + h) * CHUNK_SIZE + rows[:, None]) * CHUNK_SIZE + rows[None, :])
    else:
        a = tl.where(rows[:, None] > rows[None, :], m * decay, 0.0)
        t = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        for i in range(1, CHUNK_SIZE):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
            row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)
            t = tl.where(rows[:, None] == i, row[None, :], t)
    egc = tl.exp(gc)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    edec = tl.exp(gc_last - gc)
    return q0, rq, q, rk, k, b, gc_last, decay, kb, m, t, egc, qk, edec


@jit
def _gated_delta_bwd_state_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    DOut,
    States,
    TMat,
    ChunkBase,
    DStates,
    DState0,
    VNew,
    DVNew,
    DVal,
    DBPart,
    CuSeqlens,
    TOTAL,
    HK,
    HV,
    DK,
    DV,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (sequence n, value head h, value block vb), chunks in reverse: the state gradient chain
    ``dS = (q e^gc)^T dO + dS' e^{gc_C} - w^T dvnew`` in registers, ``dS'`` of every chunk stored to
    DStates (the chunk's slot of States), the initial state's to DState0 ``[N, HV, DK, DV]``; per chunk
    ``vnew`` and ``dvnew = attn^T dO + kdec dS'`` to VNew / DVNew ``[T, HV, DV]`` fp32, ``dv = (T^T
    dvnew) beta`` to DVal, the row sums of ``(T^T dvnew) v`` to DBPart ``[NVB, T, HV]``."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (HV // HK)
    start = tl.load(CuSeqlens + n).to(tl.int64)
    length = (tl.load(CuSeqlens + n + 1) - tl.load(CuSeqlens + n)).to(tl.int32)
    base = tl.load(ChunkBase + n).to(tl.int64)
    rows = tl.arange(0, CHUNK_SIZE)
    kd = tl.arange(0, BLOCK_K)
    vd = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    lower = rows[:, None] >= rows[None, :]
    st_mask = (kd[:, None] < DK) & (vd[None, :] < DV)
    st_offs = kd[:, None] * DV + vd[None, :]
    ds1 = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    n_chunks = tl.cdiv(length, CHUNK_SIZE)
    for j in range(0, n_chunks):
        c0 = (n_chunks - 1 - j) * CHUNK_SIZE
        valid = (c0 + rows) < length
        tok = start + c0 + rows
        chunk = base + c0 // CHUNK_SIZE
        _q0, _rq, q, _rk, k, b, gc_last, decay, kb, _m, t, egc, qk, edec = _chunk_recompute(
            Q,
            K,
            G,
            Beta,
            TMat,
            chunk,
            tok,
            valid,
            hk,
            h,
            HK,
            HV,
            DK,
            SCALE,
            EPS,
            CHUNK_SIZE,
            BLOCK_K,
            DOT_PRECISION,
            True,
        )
        w = tl.dot(t, kb * egc[:, None], input_precision=DOT_PRECISION)
        attn = tl.where(lower, qk * decay, 0.0)
        qg = q * egc[:, None]
        kdec = k * edec[:, None]
        egl = tl.exp(gc_last)
        s_offs = (chunk * HV + h) * DK * DV + st_offs
        s = tl.load(States + s_offs, mask=st_mask, other=0.0)
        tl.store(DStates + s_offs, ds1, mask=st_mask)
        v_mask = valid[:, None] & (vd[None, :] < DV)
        v_offs = (tok[:, None] * HV + h) * DV + vd[None, :]
        v = tl.load(V + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        do = tl.load(DOut + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        u = tl.dot(t, v * b[:, None], input_precision=DOT_PRECISION)
        vnew = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        dvnew = tl.dot(tl.trans(attn), do, input_precision=DOT_PRECISION)
        dvnew = tl.dot(kdec, ds1, dvnew, input_precision=DOT_PRECISION)
        ds0 = tl.dot(tl.trans(qg), do, ds1 * egl, input_precision=DOT_PRECISION)
        ds1 = ds0 - tl.dot(tl.trans(w), dvnew, input_precision=DOT_PRECISION)
        dvb = tl.dot(tl.trans(t), dvnew, input_precision=DOT_PRECISION)
        tl.store(VNew + v_offs, vnew, mask=v_mask)
        tl.store(DVNew + v_offs, dvnew, mask=v_mask)
        tl.store(DVal + v_offs, dvb * b[:, None], mask=v_mask)
        tl.store(DBPart + (vb * TOTAL + tok) * HV + h, tl.sum(dvb * v, axis=1), mask=valid)
    tl.store(DState0 + (n * HV + h).to(tl.int64) * DK * DV + st_offs, ds1, mask=st_mask)


@jit
def _gated_delta_bwd_qkg_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    DOut,
    States,
    ChunkBase,
    DStates,
    VNew,
    DVNew,
    DBPart,
    DQ,
    DKey,
    DG,
    DBeta,
    CuSeqlens,
    TOTAL,
    HK,
    HV,
    DK,
    DV,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NVB: tl.constexpr,
):
    """Program (sequence n, value head h), chunk by chunk: the column-summed partials over the value
    blocks in ascending order (``dO S^T``, ``dO vnew^T``, ``vnew dS'^T``, ``dvnew S^T``, ``dvnew
    (v beta)^T``, every operand read per block), then the chunk's shared part: dq, dk per value head to
    DQ / DKey ``[T, HV, DK]``, dg, dbeta to DG / DBeta ``[T, HV]``, fp32."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HV // HK)
    start = tl.load(CuSeqlens + n).to(tl.int64)
    length = (tl.load(CuSeqlens + n + 1) - tl.load(CuSeqlens + n)).to(tl.int32)
    base = tl.load(ChunkBase + n).to(tl.int64)
    rows = tl.arange(0, CHUNK_SIZE)
    kd = tl.arange(0, BLOCK_K)
    vd0 = tl.arange(0, BLOCK_V)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    for c0 in range(0, length, CHUNK_SIZE):
        valid = (c0 + rows) < length
        tok = start + c0 + rows
        chunk = base + c0 // CHUNK_SIZE
        q0, rq, q, rk, k, b, gc_last, decay, kb, m, t, egc, qk, edec = _chunk_recompute(
            Q,
            K,
            G,
            Beta,
            G,
            chunk,
            tok,
            valid,
            hk,
            h,
            HK,
            HV,
            DK,
            SCALE,
            EPS,
            CHUNK_SIZE,
            BLOCK_K,
            DOT_PRECISION,
            False,
        )
        kbg = kb * egc[:, None]
        kdec = k * edec[:, None]
        egl = tl.exp(gc_last)
        s_base = (chunk * HV + h) * DK * DV
        dqg = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dkdec = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dw = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dattn = tl.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=tl.float32)
        dt = tl.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=tl.float32)
        dgl_k = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for v0 in range(0, DV, BLOCK_V):
            vd = v0 + vd0
            st_mask = (kd[:, None] < DK) & (vd[None, :] < DV)
            st_offs = s_base + kd[:, None] * DV + vd[None, :]
            v_mask = valid[:, None] & (vd[None, :] < DV)
            v_offs = (tok[:, None] * HV + h) * DV + vd[None, :]
            s = tl.load(States + st_offs, mask=st_mask, other=0.0)
            ds1 = tl.load(DStates + st_offs, mask=st_mask, other=0.0)
            vnew = tl.load(VNew + v_offs, mask=v_mask, other=0.0)
            dvnew = tl.load(DVNew + v_offs, mask=v_mask, other=0.0)
            v = tl.load(V + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            do = tl.load(DOut + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            dqg = tl.dot(do, tl.trans(s), dqg, input_precision=DOT_PRECISION)
            dattn = tl.dot(do, tl.trans(vnew), dattn, input_precision=DOT_PRECISION)
            dkdec = tl.dot(vnew, tl.trans(ds1), dkdec, input_precision=DOT_PRECISION)
            dw = tl.dot(dvnew, tl.trans(s), dw, input_precision=DOT_PRECISION)
            dt = tl.dot(dvnew, tl.trans(v * b[:, None]), dt, input_precision=DOT_PRECISION)
            dgl_k = dgl_k + tl.sum(s * ds1, axis=1)
        db = tl.zeros((CHUNK_SIZE,), dtype=tl.float32)
        for vb in range(0, NVB):
            db = db + tl.load(DBPart + (vb * TOTAL + tok) * HV + h, mask=valid, other=0.0)
        dw = -dw
        dt = tl.dot(dw, tl.trans(kbg), dt, input_precision=DOT_PRECISION)
        dkbg = tl.dot(tl.trans(t), dw, input_precision=DOT_PRECISION)
        da = tl.dot(tl.dot(tl.trans(t), dt, input_precision=DOT_PRECISION), tl.trans(t), input_precision=DOT_PRECISION)
        da = tl.where(strict, -da, 0.0)
        dm = da * decay
        dattn = tl.where(lower, dattn, 0.0)
        dqk = dattn * decay
        de = (da * m + dattn * qk) * decay
        dgc = tl.sum(de, axis=1) - tl.sum(de, axis=0)
        dq = tl.dot(dqk, k, input_precision=DOT_PRECISION) + dqg * egc[:, None]
        dkb = tl.dot(dm, k, input_precision=DOT_PRECISION) + dkbg * egc[:, None]
        dk = tl.dot(tl.trans(dqk), q, input_precision=DOT_PRECISION)
        dk = tl.dot(tl.trans(dm), kb, dk, input_precision=DOT_PRECISION)
        dk = dk + dkdec * edec[:, None]
        dk = dk + dkb * b[:, None]
        db = db + tl.sum(dkb * k, axis=1)
        dgc = dgc + (tl.sum(dqg * q, axis=1) + tl.sum(dkbg * kb, axis=1)) * egc
        x = tl.sum(dkdec * kdec, axis=1)
        dgc = dgc - x
        dgl = tl.sum(x, axis=0) + tl.sum(dgl_k, axis=0) * egl
        dgc = dgc + tl.where(rows == CHUNK_SIZE - 1, dgl, 0.0)
        dg = tl.sum(tl.where(lower, dgc[:, None], 0.0), axis=0)
        dqn = dq * SCALE
        qn = q0 * rq[:, None]
        dq0 = rq[:, None] * (dqn - qn * tl.sum(qn * dqn, axis=1)[:, None])
        dk0 = rk[:, None] * (dk - k * tl.sum(k * dk, axis=1)[:, None])
        qk_mask = valid[:, None] & (kd[None, :] < DK)
        out_offs = (tok[:, None] * HV + h) * DK + kd[None, :]
        tl.store(DQ + out_offs, dq0, mask=qk_mask)
        tl.store(DKey + out_offs, dk0, mask=qk_mask)
        tl.store(DG + tok * HV + h, dg, mask=valid)
        tl.store(DBeta + tok * HV + h, db, mask=valid)


def gated_delta_backward(
    q, k, v, g, beta, d_out, cu_seqlens, states, t_mat, chunk_base, *, scale, eps, chunk, block_v, dot_precision
):
    """Launch the backward: operands as the forward took them (contiguous; ``g``, ``beta`` fp32),
    ``d_out`` ``[T, HV, DV]``, ``states`` / ``t_mat`` / ``chunk_base`` from the forward's
    ``STORE_STATES`` rerun,
    ``dot_precision`` the forward's ``tl.dot`` precision.
    Returns ``(dq, dk [T, HK, DK], dv [T, HV, DV], dg, dbeta [T, HV], d_state0 [N, HV, DK, DV])``, fp32
    (dq / dk summed over each q/k head's value heads, ascending)."""
    total, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = cu_seqlens.shape[0] - 1
    nvb = triton.cdiv(dv, block_v)
    block_k = max(16, triton.next_power_of_2(dk))
    f32 = {"dtype": torch.float32, "device": q.device}
    d_out = d_out.contiguous()
    d_states, d_state0 = torch.empty_like(states), torch.empty((n, hv, dk, dv), **f32)
    vnew, dvnew, d_v = (torch.empty((total, hv, dv), **f32) for _ in range(3))
    db_part = torch.empty((nvb, total, hv), **f32)
    common = {"SCALE": scale, "EPS": eps, "CHUNK_SIZE": chunk, "BLOCK_K": block_k, "BLOCK_V": block_v}
    common.update(DOT_PRECISION=dot_precision, num_warps=4)
    _gated_delta_bwd_state_kernel[(n, hv, nvb)](
        q,
        k,
        v,
        g,
        beta,
        d_out,
        states,
        t_mat,
        chunk_base,
        d_states,
        d_state0,
        vnew,
        dvnew,
        d_v,
        db_part,
        cu_seqlens,
        total,
        hk,
        hv,
        dk,
        dv,
        **common,
        num_stages=1,  # pipelined loads of T would take 240 KB of shared memory on sm_90 (128 KB at 1)
    )
    dq_h, dk_h = torch.empty((total, hv, dk), **f32), torch.empty((total, hv, dk), **f32)
    d_g, d_b = torch.empty((total, hv), **f32), torch.empty((total, hv), **f32)
    _gated_delta_bwd_qkg_kernel[(n, hv)](
        q,
        k,
        v,
        g,
        beta,
        d_out,
        states,
        chunk_base,
        d_states,
        vnew,
        dvnew,
        db_part,
        dq_h,
        dk_h,
        d_g,
        d_b,
        cu_seqlens,
        total,
        hk,
        hv,
        dk,
        dv,
        NVB=nvb,
        **common,
    )
    return _group_sum(dq_h, hk), _group_sum(dk_h, hk), d_v, d_g, d_b, d_state0


def _group_sum(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[T, HV, DK] -> [T, HK, DK]``: each q/k head's value heads added in ascending order."""
    group = x.shape[1] // hk
    x = x.view(x.shape[0], hk, group, x.shape[2])
    acc = x[:, :, 0]
    for i in range(1, group):
        acc = acc + x[:, :, i]
    return acc.contiguous()
