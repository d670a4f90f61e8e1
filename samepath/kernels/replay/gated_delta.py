"""CPU replays of ``_gated_delta_fwd_kernel`` (Gated DeltaNet's one schedule, see
:mod:`samepath.kernels.gated_delta`) and ``_gated_delta_bwd_kernel`` (its backward, see
:mod:`samepath.kernels.gated_delta_bwd`: program by program, chunks in reverse, value blocks in
ascending order, the same operations as below).

Program (sequence, value head) by program and chunk by chunk, the value blocks of a chunk after its
shared part (the UT transform, ``w`` and the scores, which every value block's program computes with
the same bits), on the kernel's padded tiles (``[CHUNK, BLOCK_K]``, ``[CHUNK, BLOCK_V]``,
``[CHUNK, CHUNK]``, the state ``[BLOCK_K, BLOCK_V]``)
with the interpreter's operations: ``np.sum`` / ``np.cumsum`` along the tile's axes, ``np.exp`` on
the same contiguous arrays (a 0-d one for the chunk's last cumulative gate), ``tl.dot`` as
:func:`~samepath.kernels.replay.numerics.dot` on the same operands (transposes as views).
"""

from __future__ import annotations

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def _dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    if acc is None:
        acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    return np.matmul(a, b, dtype=np.float32) + acc


def _tile(src: np.ndarray, rows: np.ndarray, valid: np.ndarray, width: int, cols: int) -> np.ndarray:
    """The masked load of ``src[rows, :cols]`` into a ``[len(rows), width]`` tile (zeros elsewhere), widened."""
    tile = np.zeros((rows.shape[0], width), dtype=src.dtype)
    tile[valid, :cols] = src[rows[valid], :cols]
    return widen(tile, "C")


def _ut_inverse(a: np.ndarray, eye: np.ndarray) -> np.ndarray:
    """``(I + A)^-1`` of the strictly lower ``A`` as the kernel forms it: forward substitution, row ``i``
    set to ``e_i - sum_m A[i, m] T[m, :]`` (a column sum over the whole tile) for ``i = 1 .. C - 1``."""
    rows = np.arange(a.shape[0])
    t = eye
    for i in range(1, a.shape[0]):
        a_i = np.sum(np.where(rows[:, None] == i, a, _ZERO), axis=0)
        row = np.where(rows == i, _ONE, _ZERO) - np.sum(a_i[:, None] * t, axis=0)
        t = np.where(rows[:, None] == i, row[None, :], t)
    return t


@register_replay("samepath.kernels.gated_delta._gated_delta_fwd_kernel")
def gated_delta_fwd(
    grid,
    *,
    Q,
    K,
    V,
    G,
    Beta,
    S0,
    Out,
    SOut,
    CuSeqlens,
    SlotIds,
    TailLen,
    Initial,
    TailK,
    TailV,
    TailG,
    TailB,
    States,
    TMat,
    ChunkBase,
    HK,
    HV,
    DK,
    DV,
    SCALE,
    EPS,
    HAS_S0,
    SLOTS,
    STORE_STATES,
    DOT_PRECISION,
    CHUNK_SIZE,
    BLOCK_K,
    BLOCK_V,
) -> None:
    """``_gated_delta_fwd_kernel``: every (sequence, value head) program's outputs and final boundary state
    (with ``SLOTS``, the slot's tail tokens first: the sources below are the virtual sequence)."""
    q_all, k_all = to_numpy(Q), to_numpy(K)
    v_all, g_all, b_all = to_numpy(V), to_numpy(G), to_numpy(Beta)
    out_all, s_out = to_numpy(Out), to_numpy(SOut)
    s0_all = to_numpy(S0) if HAS_S0 else None
    cu = CuSeqlens.tolist()
    if SLOTS:
        slots, tails, initial = SlotIds.tolist(), TailLen.tolist(), Initial.tolist()
        tk_all, tv_all, tg_all, tb_all = to_numpy(TailK), to_numpy(TailV), to_numpy(TailG), to_numpy(TailB)
    if STORE_STATES:
        states, t_mat, chunk_base = to_numpy(States), to_numpy(TMat), ChunkBase.tolist()
    scale, eps = np.float32(SCALE), np.float32(EPS)
    rows = np.arange(CHUNK_SIZE)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = np.where(rows[:, None] == rows[None, :], _ONE, _ZERO)
    group = HV // HK
    with np.errstate(all="ignore"):
        for n in range(grid[0]):
            start, length = cu[n], cu[n + 1] - cu[n]
            tail = tails[n] if SLOTS else 0
            slot = slots[n] if SLOTS else n
            for h in range(grid[1]):
                hk = h // group
                new = slice(start, start + length)
                q_src, k_src = q_all[new, hk], k_all[new, hk]
                v_src, g_src, b_src = v_all[new, h], g_all[new, h], b_all[new, h]
                if SLOTS:  # the tail rows (query rows zero), then the new tokens
                    q_src = np.concatenate([np.zeros((tail, DK), dtype=q_src.dtype), q_src])
                    k_src = np.concatenate([tk_all[slot, :tail, hk], k_src])
                    v_src = np.concatenate([tv_all[slot, :tail, h], v_src])
                    g_src = np.concatenate([tg_all[slot, :tail, h], g_src])
                    b_src = np.concatenate([tb_all[slot, :tail, h], b_src])
                total = tail + length
                S = np.zeros((BLOCK_K, grid[2] * BLOCK_V), dtype=np.float32)
                if HAS_S0 and (not SLOTS or initial[n]):
                    S[:DK, :DV] = s0_all[slot, h]
                for c0 in range(0, total, CHUNK_SIZE):
                    if STORE_STATES:
                        states[chunk_base[n] + c0 // CHUNK_SIZE, h] = S[:DK, :DV]
                    valid = (c0 + rows) < total
                    tok = c0 + rows
                    q = _tile(q_src, tok, valid, BLOCK_K, DK)
                    k = _tile(k_src, tok, valid, BLOCK_K, DK)
                    v = _tile(v_src, tok, valid, grid[2] * BLOCK_V, DV)
                    g = np.zeros(CHUNK_SIZE, dtype=np.float32)
                    g[valid] = g_src[tok[valid]]
                    b = np.zeros(CHUNK_SIZE, dtype=np.float32)
                    b[valid] = b_src[tok[valid]]
                    q = q * (_ONE / np.sqrt(np.sum(q * q, axis=1) + eps))[:, None]
                    q = q * scale
                    k = k * (_ONE / np.sqrt(np.sum(k * k, axis=1) + eps))[:, None]
                    gc = np.cumsum(g, axis=0)
                    gc_last = np.sum(np.where(rows == CHUNK_SIZE - 1, gc, _ZERO), axis=0)
                    decay = np.exp(np.where(lower, gc[:, None] - gc[None, :], _ZERO))
                    kb = k * b[:, None]
                    a = np.where(strict, _dot(kb, k.T) * decay, _ZERO)
                    t = _ut_inverse(a, eye)
                    if STORE_STATES:
                        t_mat[chunk_base[n] + c0 // CHUNK_SIZE, h] = t
                    egc = np.exp(gc)
                    w = _dot(t, kb * egc[:, None])
                    attn = np.where(lower, _dot(q, k.T) * decay, _ZERO)
                    qg = q * egc[:, None]
                    full = c0 + CHUNK_SIZE <= total
                    if full:
                        kdec = k * np.exp(np.ascontiguousarray(gc_last - gc))[:, None]
                        chunk_decay = np.exp(np.asarray(gc_last))
                    stored = valid & (tok >= tail)
                    for lo in range(0, grid[2] * BLOCK_V, BLOCK_V):
                        cols = slice(lo, lo + BLOCK_V)
                        s_blk = np.ascontiguousarray(S[:, cols])
                        u = _dot(t, np.ascontiguousarray(v[:, cols]) * b[:, None])
                        vnew = u - _dot(w, s_blk)
                        o = _dot(qg, s_blk)
                        o = _dot(attn, vnew, o)
                        width = max(0, min(DV - lo, BLOCK_V))
                        out_all[start + tok[stored] - tail, h, lo : lo + width] = cast(o[stored, :width], Out.dtype)
                        if full:
                            S[:, cols] = _dot(kdec.T, vnew, s_blk * chunk_decay)
                s_out[slot, h] = S[:DK, :DV]


def _recompute(q_all, k_all, g_all, b_all, t_mat, chunk, tok, valid, hk, h, DK, scale, eps, block_k, masks):
    """``_chunk_recompute``: the forward's chunk quantities of program (sequence, value head h), ``T``
    as the forward rerun stored it (``t_mat``) or, with ``t_mat`` None, by the forward substitution."""
    rows, lower, strict, eye = masks
    q0 = _tile(q_all[:, hk], tok, valid, block_k, DK)
    k0 = _tile(k_all[:, hk], tok, valid, block_k, DK)
    g = np.zeros(rows.shape[0], dtype=np.float32)
    g[valid] = g_all[tok[valid], h]
    b = np.zeros(rows.shape[0], dtype=np.float32)
    b[valid] = b_all[tok[valid], h]
    rq = _ONE / np.sqrt(np.sum(q0 * q0, axis=1) + eps)
    q = q0 * rq[:, None]
    q = q * scale
    rk = _ONE / np.sqrt(np.sum(k0 * k0, axis=1) + eps)
    k = k0 * rk[:, None]
    gc = np.cumsum(g, axis=0)
    gc_last = np.sum(np.where(rows == rows.shape[0] - 1, gc, _ZERO), axis=0)
    decay = np.exp(np.where(lower, gc[:, None] - gc[None, :], _ZERO))
    kb = k * b[:, None]
    m = _dot(kb, k.T)
    t = t_mat[chunk, h].copy() if t_mat is not None else _ut_inverse(np.where(strict, m * decay, _ZERO), eye)
    egc = np.exp(gc)
    qk = _dot(q, k.T)
    edec = np.exp(np.ascontiguousarray(gc_last - gc))
    return q0, rq, q, rk, k, b, gc_last, decay, kb, m, t, egc, qk, edec


def _masks(chunk: int):
    rows = np.arange(chunk)
    eye = np.where(rows[:, None] == rows[None, :], _ONE, _ZERO)
    return rows, rows[:, None] >= rows[None, :], rows[:, None] > rows[None, :], eye


@register_replay("samepath.kernels.gated_delta_bwd._gated_delta_bwd_state_kernel")
def gated_delta_bwd_state(
    grid,
    *,
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
    SCALE,
    EPS,
    CHUNK_SIZE,
    BLOCK_K,
    BLOCK_V,
    DOT_PRECISION,
) -> None:
    """``_gated_delta_bwd_state_kernel``: per (sequence, value head), chunks in reverse, the value blocks
    of a chunk after its shared recompute (every value block's program computes it with the same bits)."""
    q_all, k_all, v_all, do_all = to_numpy(Q), to_numpy(K), to_numpy(V), to_numpy(DOut)
    g_all, b_all, states, d_states = to_numpy(G), to_numpy(Beta), to_numpy(States), to_numpy(DStates)
    t_mat = to_numpy(TMat)
    d_state0, vnew_all, dvnew_all = to_numpy(DState0), to_numpy(VNew), to_numpy(DVNew)
    dv_all, db_part = to_numpy(DVal), to_numpy(DBPart)
    cu, chunk_base = CuSeqlens.tolist(), ChunkBase.tolist()
    scale, eps = np.float32(SCALE), np.float32(EPS)
    masks = _masks(CHUNK_SIZE)
    rows, lower = masks[0], masks[1]
    width_v = grid[2] * BLOCK_V
    group = HV // HK
    with np.errstate(all="ignore"):
        for n in range(grid[0]):
            start, length = cu[n], cu[n + 1] - cu[n]
            for h in range(grid[1]):
                hk = h // group
                ds1_full = np.zeros((BLOCK_K, width_v), dtype=np.float32)
                for c0 in reversed(range(0, length, CHUNK_SIZE)):
                    valid = (c0 + rows) < length
                    tok = start + c0 + rows
                    chunk = chunk_base[n] + c0 // CHUNK_SIZE
                    _q0, _rq, q, _rk, k, b, gc_last, decay, kb, _m, t, egc, qk, edec = _recompute(
                        q_all, k_all, g_all, b_all, t_mat, chunk, tok, valid, hk, h, DK, scale, eps, BLOCK_K, masks
                    )
                    w = _dot(t, kb * egc[:, None])
                    attn = np.where(lower, qk * decay, _ZERO)
                    qg = q * egc[:, None]
                    kdec = k * edec[:, None]
                    egl = np.exp(np.asarray(gc_last))
                    s_full = np.zeros((BLOCK_K, width_v), dtype=np.float32)
                    s_full[:DK, :DV] = states[chunk, h]
                    d_states[chunk, h] = ds1_full[:DK, :DV]
                    v_t = _tile(v_all[:, h], tok, valid, width_v, DV)
                    do_t = _tile(do_all[:, h], tok, valid, width_v, DV)
                    for vb in range(grid[2]):
                        cols = slice(vb * BLOCK_V, (vb + 1) * BLOCK_V)
                        width = max(0, min(DV - vb * BLOCK_V, BLOCK_V))
                        out_cols = slice(vb * BLOCK_V, vb * BLOCK_V + width)
                        s = np.ascontiguousarray(s_full[:, cols])
                        ds1 = ds1_full[:, cols].copy()
                        v = np.ascontiguousarray(v_t[:, cols])
                        do = np.ascontiguousarray(do_t[:, cols])
                        u = _dot(t, v * b[:, None])
                        vnew = u - _dot(w, s)
                        dvnew = _dot(attn.T, do)
                        dvnew = _dot(kdec, ds1, dvnew)
                        ds0 = _dot(qg.T, do, ds1 * egl)
                        ds1_full[:, cols] = ds0 - _dot(w.T, dvnew)
                        dvb = _dot(t.T, dvnew)
                        vnew_all[tok[valid], h, out_cols] = vnew[valid, :width]
                        dvnew_all[tok[valid], h, out_cols] = dvnew[valid, :width]
                        dv_all[tok[valid], h, out_cols] = (dvb * b[:, None])[valid, :width]
                        db_part[vb, tok[valid], h] = np.sum(dvb * v, axis=1)[valid]
                d_state0[n, h] = ds1_full[:DK, :DV]


@register_replay("samepath.kernels.gated_delta_bwd._gated_delta_bwd_qkg_kernel")
def gated_delta_bwd_qkg(
    grid,
    *,
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
    SCALE,
    EPS,
    CHUNK_SIZE,
    BLOCK_K,
    BLOCK_V,
    NVB,
    DOT_PRECISION,
) -> None:
    """``_gated_delta_bwd_qkg_kernel``: per (sequence, value head) and chunk, the partials over the value
    blocks in ascending order, then the chunk's shared part."""
    q_all, k_all, v_all, do_all = to_numpy(Q), to_numpy(K), to_numpy(V), to_numpy(DOut)
    g_all, b_all, states, d_states = to_numpy(G), to_numpy(Beta), to_numpy(States), to_numpy(DStates)
    vnew_all, dvnew_all, db_part = to_numpy(VNew), to_numpy(DVNew), to_numpy(DBPart)
    dq_all, dk_all, dg_all, db_all = to_numpy(DQ), to_numpy(DKey), to_numpy(DG), to_numpy(DBeta)
    cu, chunk_base = CuSeqlens.tolist(), ChunkBase.tolist()
    scale, eps = np.float32(SCALE), np.float32(EPS)
    masks = _masks(CHUNK_SIZE)
    rows, lower, strict = masks[0], masks[1], masks[2]
    width_v = -(-DV // BLOCK_V) * BLOCK_V
    group = HV // HK
    with np.errstate(all="ignore"):
        for n in range(grid[0]):
            start, length = cu[n], cu[n + 1] - cu[n]
            for h in range(grid[1]):
                hk = h // group
                for c0 in range(0, length, CHUNK_SIZE):
                    valid = (c0 + rows) < length
                    tok = start + c0 + rows
                    chunk = chunk_base[n] + c0 // CHUNK_SIZE
                    q0, rq, q, rk, k, b, gc_last, decay, kb, m, t, egc, qk, edec = _recompute(
                        q_all, k_all, g_all, b_all, None, chunk, tok, valid, hk, h, DK, scale, eps, BLOCK_K, masks
                    )
                    kbg = kb * egc[:, None]
                    kdec = k * edec[:, None]
                    egl = np.exp(np.asarray(gc_last))
                    s_full = np.zeros((BLOCK_K, width_v), dtype=np.float32)
                    s_full[:DK, :DV] = states[chunk, h]
                    ds_full = np.zeros((BLOCK_K, width_v), dtype=np.float32)
                    ds_full[:DK, :DV] = d_states[chunk, h]
                    vnew_t = _tile(vnew_all[:, h], tok, valid, width_v, DV)
                    dvnew_t = _tile(dvnew_all[:, h], tok, valid, width_v, DV)
                    v_t = _tile(v_all[:, h], tok, valid, width_v, DV)
                    do_t = _tile(do_all[:, h], tok, valid, width_v, DV)
                    dqg = np.zeros((CHUNK_SIZE, BLOCK_K), dtype=np.float32)
                    dkdec = np.zeros((CHUNK_SIZE, BLOCK_K), dtype=np.float32)
                    dw = np.zeros((CHUNK_SIZE, BLOCK_K), dtype=np.float32)
                    dattn = np.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=np.float32)
                    dt = np.zeros((CHUNK_SIZE, CHUNK_SIZE), dtype=np.float32)
                    dgl_k = np.zeros(BLOCK_K, dtype=np.float32)
                    for lo in range(0, DV, BLOCK_V):
                        cols = slice(lo, lo + BLOCK_V)
                        s = np.ascontiguousarray(s_full[:, cols])
                        ds1 = np.ascontiguousarray(ds_full[:, cols])
                        vnew = np.ascontiguousarray(vnew_t[:, cols])
                        dvnew = np.ascontiguousarray(dvnew_t[:, cols])
                        v = np.ascontiguousarray(v_t[:, cols])
                        do = np.ascontiguousarray(do_t[:, cols])
                        dqg = _dot(do, s.T, dqg)
                        dattn = _dot(do, vnew.T, dattn)
                        dkdec = _dot(vnew, ds1.T, dkdec)
                        dw = _dot(dvnew, s.T, dw)
                        dt = _dot(dvnew, (v * b[:, None]).T, dt)
                        dgl_k = dgl_k + np.sum(s * ds1, axis=1)
                    db = np.zeros(CHUNK_SIZE, dtype=np.float32)
                    for vb in range(NVB):
                        part = np.zeros(CHUNK_SIZE, dtype=np.float32)
                        part[valid] = db_part[vb, tok[valid], h]
                        db = db + part
                    dw = -dw
                    dt = _dot(dw, kbg.T, dt)
                    dkbg = _dot(t.T, dw)
                    da = _dot(_dot(t.T, dt), t.T)
                    da = np.where(strict, -da, _ZERO)
                    dm = da * decay
                    dattn = np.where(lower, dattn, _ZERO)
                    dqk = dattn * decay
                    de = (da * m + dattn * qk) * decay
                    dgc = np.sum(de, axis=1) - np.sum(de, axis=0)
                    dq = _dot(dqk, k) + dqg * egc[:, None]
                    dkb = _dot(dm, k) + dkbg * egc[:, None]
                    dk = _dot(dqk.T, q)
                    dk = _dot(dm.T, kb, dk)
                    dk = dk + dkdec * edec[:, None]
                    dk = dk + dkb * b[:, None]
                    db = db + np.sum(dkb * k, axis=1)
                    dgc = dgc + (np.sum(dqg * q, axis=1) + np.sum(dkbg * kb, axis=1)) * egc
                    x = np.sum(dkdec * kdec, axis=1)
                    dgc = dgc - x
                    dgl = np.sum(x, axis=0) + np.sum(dgl_k, axis=0) * egl
                    dgc = dgc + np.where(rows == CHUNK_SIZE - 1, dgl, _ZERO)
                    dg = np.sum(np.where(lower, dgc[:, None], _ZERO), axis=0)
                    dqn = dq * scale
                    qn = q0 * rq[:, None]
                    dq0 = rq[:, None] * (dqn - qn * np.sum(qn * dqn, axis=1)[:, None])
                    dk0 = rk[:, None] * (dk - k * np.sum(k * dk, axis=1)[:, None])
                    dq_all[tok[valid], h] = dq0[valid, :DK]
                    dk_all[tok[valid], h] = dk0[valid, :DK]
                    dg_all[tok[valid], h] = dg[valid]
                    db_all[tok[valid], h] = db[valid]
