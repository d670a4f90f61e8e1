"""CPU replay of ``_gated_delta_fwd_kernel`` (Gated DeltaNet's one schedule, see
:mod:`samepath.kernels.gated_delta`).

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
    HK,
    HV,
    DK,
    DV,
    SCALE,
    EPS,
    HAS_S0,
    SLOTS,
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
