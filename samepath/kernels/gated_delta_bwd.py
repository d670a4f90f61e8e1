"""Gated DeltaNet backward in Triton (:mod:`samepath.kernels.gated_delta`'s chunk formula), deterministic.

One program per (sequence, value head) walks the sequence's chunks in reverse. For each chunk it
recomputes the forward's chunk quantities with the forward's operations (the normalised q, k, the
cumulative gates, the decays, the UT transform ``T`` by the same forward substitution, ``w``, the
scores, ``vnew``), reading the state at the chunk's start from ``States`` (stored by a rerun of the
forward kernel, the forward's bits), then differentiates the chunk formula by hand:

- value blocks of :data:`~samepath.kernels.gated_delta.V_BLOCK` columns in ascending order:
  ``dvnew = attn^T dO + kdec dS'``, ``dS = (q e^gc)^T dO + dS' e^{gc_C} - w^T dvnew`` (stored for the
  previous chunk), ``dv = (T^T dvnew) * beta``, and the column-reduced partials ``dO S^T``,
  ``dO vnew^T``, ``vnew dS'^T``, ``dvnew S^T``, ``dvnew (v beta)^T`` accumulated in that order;
- then the chunk's shared part: ``dT``, ``dA = -strict(T^T dT T^T)``, the decays, the gates (the
  reverse cumulative sum as a masked column sum), ``dbeta``, and the L2 norms' backward.

``dS'`` (the gradient of the state after the chunk) lives in ``DState`` (one ``[DK, DV]`` slice per
program, zero after the last chunk: the output state is not differentiated); after the first chunk
it holds the gradient of the initial state. dq / dk come out per value head (fp32) and are summed
over each q/k head's group in a fixed order by the caller. No atomics: every output element is
written by one program, every reduction has a fixed order, so the gradients are identical run to
run and the same on every caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samepath.kernels.dispatch import jit

#: ``tl.dot`` precision (the forward's).
DOT_PRECISION: tl.constexpr = tl.constexpr("tf32x3")


@jit
def _gated_delta_bwd_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    DOut,
    States,
    ChunkBase,
    DState,
    DQ,
    DKey,
    DVal,
    DG,
    DBeta,
    CuSeqlens,
    HK,
    HV,
    DK,
    DV,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (sequence n, value head h). Q, K ``[T, HK, DK]``, V / DOut ``[T, HV, DV]``, G / Beta
    ``[T, HV]`` fp32, States ``[chunks, HV, DK, DV]`` fp32 (chunk ``ChunkBase[n] + c``), DState ``[N,
    HV, DK, DV]`` fp32 zeros on entry; outputs DQ / DKey ``[T, HV, DK]``, DVal ``[T, HV, DV]``, DG /
    DBeta ``[T, HV]``, fp32, all contiguous."""
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
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    ds_base = (n * HV + h).to(tl.int64) * DK * DV
    n_chunks = tl.cdiv(length, CHUNK_SIZE)
    for j in range(0, n_chunks):
        c0 = (n_chunks - 1 - j) * CHUNK_SIZE
        valid = (c0 + rows) < length
        tok = start + c0 + rows
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
        a = tl.where(strict, m * decay, 0.0)
        t = eye
        for i in range(1, CHUNK_SIZE):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
            row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)
            t = tl.where(rows[:, None] == i, row[None, :], t)
        egc = tl.exp(gc)
        kbg = kb * egc[:, None]
        w = tl.dot(t, kbg, input_precision=DOT_PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        attn = tl.where(lower, qk * decay, 0.0)
        qg = q * egc[:, None]
        edec = tl.exp(gc_last - gc)
        kdec = k * edec[:, None]
        egl = tl.exp(gc_last)
        s_base = ((base + c0 // CHUNK_SIZE) * HV + h) * DK * DV
        dqg = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dkdec = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dw = tl.zeros((CHUNK_SIZE, BLOCK_K), dtype=tl.float32)
        dattn = tl.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=tl.float32)
        dt = tl.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=tl.float32)
        db = tl.zeros((CHUNK_SIZE,), dtype=tl.float32)
        dgl_k = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for v0 in range(0, DV, BLOCK_V):
            vd = v0 + vd0
            v_mask = valid[:, None] & (vd[None, :] < DV)
            st_mask = (kd[:, None] < DK) & (vd[None, :] < DV)
            st_offs = kd[:, None] * DV + vd[None, :]
            v_offs = (tok[:, None] * HV + h) * DV + vd[None, :]
            s = tl.load(States + s_base + st_offs, mask=st_mask, other=0.0)
            ds1 = tl.load(DState + ds_base + st_offs, mask=st_mask, other=0.0)
            v = tl.load(V + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            do = tl.load(DOut + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            vb = v * b[:, None]
            u = tl.dot(t, vb, input_precision=DOT_PRECISION)
            vnew = u - tl.dot(w, s, input_precision=DOT_PRECISION)
            dvnew = tl.dot(tl.trans(attn), do, input_precision=DOT_PRECISION)
            dvnew = tl.dot(kdec, ds1, dvnew, input_precision=DOT_PRECISION)
            ds0 = tl.dot(tl.trans(qg), do, ds1 * egl, input_precision=DOT_PRECISION)
            ds0 = ds0 - tl.dot(tl.trans(w), dvnew, input_precision=DOT_PRECISION)
            tl.debug_barrier()
            tl.store(DState + ds_base + st_offs, ds0, mask=st_mask)
            dqg = tl.dot(do, tl.trans(s), dqg, input_precision=DOT_PRECISION)
            dattn = tl.dot(do, tl.trans(vnew), dattn, input_precision=DOT_PRECISION)
            dkdec = tl.dot(vnew, tl.trans(ds1), dkdec, input_precision=DOT_PRECISION)
            dw = tl.dot(dvnew, tl.trans(s), dw, input_precision=DOT_PRECISION)
            dt = tl.dot(dvnew, tl.trans(vb), dt, input_precision=DOT_PRECISION)
            dvb = tl.dot(tl.trans(t), dvnew, input_precision=DOT_PRECISION)
            tl.store(DVal + v_offs, dvb * b[:, None], mask=v_mask)
            db = db + tl.sum(dvb * v, axis=1)
            dgl_k = dgl_k + tl.sum(s * ds1, axis=1)
        tl.debug_barrier()
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
        out_offs = (tok[:, None] * HV + h) * DK + kd[None, :]
        tl.store(DQ + out_offs, dq0, mask=qk_mask)
        tl.store(DKey + out_offs, dk0, mask=qk_mask)
        tl.store(DG + tok * HV + h, dg, mask=valid)
        tl.store(DBeta + tok * HV + h, db, mask=valid)


def gated_delta_backward(q, k, v, g, beta, d_out, cu_seqlens, states, chunk_base, *, scale, eps, chunk, block_v):
    """Launch the backward: operands as the forward took them (contiguous; ``g``, ``beta`` fp32),
    ``d_out`` ``[T, HV, DV]``, ``states`` / ``chunk_base`` from the forward's ``STORE_STATES`` rerun.
    Returns ``(dq, dk [T, HK, DK], dv [T, HV, DV], dg, dbeta [T, HV], d_state0 [N, HV, DK, DV])``, fp32
    (dq / dk summed over each q/k head's value heads, ascending)."""
    total, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n = cu_seqlens.shape[0] - 1
    f32 = {"dtype": torch.float32, "device": q.device}
    d_state = torch.zeros((n, hv, dk, dv), **f32)
    dq_h, dk_h = torch.empty((total, hv, dk), **f32), torch.empty((total, hv, dk), **f32)
    d_v, d_g, d_b = (
        torch.empty((total, hv, dv), **f32),
        torch.empty((total, hv), **f32),
        torch.empty((total, hv), **f32),
    )
    _gated_delta_bwd_kernel[(n, hv)](
        q,
        k,
        v,
        g,
        beta,
        d_out.contiguous(),
        states,
        chunk_base,
        d_state,
        dq_h,
        dk_h,
        d_v,
        d_g,
        d_b,
        cu_seqlens,
        hk,
        hv,
        dk,
        dv,
        SCALE=scale,
        EPS=eps,
        CHUNK_SIZE=chunk,
        BLOCK_K=max(16, triton.next_power_of_2(dk)),
        BLOCK_V=block_v,
        num_warps=4,
    )
    return _group_sum(dq_h, hk), _group_sum(dk_h, hk), d_v, d_g, d_b, d_state


def _group_sum(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[T, HV, DK] -> [T, HK, DK]``: each q/k head's value heads added in ascending order."""
    group = x.shape[1] // hk
    x = x.view(x.shape[0], hk, group, x.shape[2])
    acc = x[:, :, 0]
    for i in range(1, group):
        acc = acc + x[:, :, i]
    return acc.contiguous()
