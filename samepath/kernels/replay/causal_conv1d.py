"""CPU replays of :mod:`samepath.kernels.causal_conv1d`'s kernels: the forward (and its ``BACKWARD`` mode,
the pre-activation gradient), ``dx`` and the weight / bias sums.

The forward and ``dx`` are elementwise over ``[T, D]``: the block a program handles decides nothing about an
element's bits. Each element goes through the kernel's fp32 operations in the kernel's order (the bias plus
a zero tile, then ``acc + w * x`` tap by tap, ascending), on arrays of whole rows; ``exp`` is numpy's on a
C-contiguous fp32 array, as the interpreter applies it to a contiguous tile. The weight sums keep the
kernel's ``[BLOCK_T, BLOCK_D]`` tile (padded rows zero), accumulated block by block, then ``np.sum`` over
its rows.
"""

from __future__ import annotations

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import row_chunks
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_ONE = np.float32(1.0)


def _tap(x_all, state, seq, start, rows, j, width, d, has_state) -> np.ndarray:
    """The fp32 input of tap ``j`` for ``rows`` (``[len(rows), d]``): x inside the sequence, the state before it."""
    src = rows - (width - 1) + j
    inside = src >= start
    xv = np.zeros((rows.shape[0], d), dtype=x_all.dtype)
    xv[inside] = x_all[src[inside]]
    xv = widen(xv, "C")
    if has_state:
        outside = ~inside
        slot = (width - 1) + src - start
        sv = np.zeros((rows.shape[0], d), dtype=state.dtype)
        sv[outside] = state[seq[outside], :, slot[outside]]
        xv = np.where(inside[:, None], xv, widen(sv, "C"))
    return xv


@register_replay("samepath.kernels.causal_conv1d._causal_conv1d_kernel")
def causal_conv1d(
    grid, *, X, W, Bias, State, SeqId, Starts, Out, DOut, T, D, WIDTH, HAS_BIAS, HAS_STATE, SILU, BACKWARD,
    BLOCK_T, BLOCK_D,
) -> None:  # fmt: skip
    """Every ``Out[t, d]`` of the launch."""
    if T == 0 or D == 0:
        return
    x_all, out = to_numpy(X), to_numpy(Out)
    w = widen(to_numpy(W), "C")  # [D, WIDTH]
    bias = widen(to_numpy(Bias), "C") if HAS_BIAS else None
    state = to_numpy(State) if HAS_STATE else None
    d_out = to_numpy(DOut) if BACKWARD else None
    seq_all, start_all = SeqId.numpy().astype(np.int64), Starts.numpy().astype(np.int64)
    with np.errstate(all="ignore"):
        for block in row_chunks(T, D * WIDTH):
            rows = np.arange(block.start, block.stop)
            seq, start = seq_all[block], start_all[block]
            acc = np.zeros((rows.shape[0], D), dtype=np.float32)
            if HAS_BIAS:
                acc = bias[None, :] + acc
            for j in range(WIDTH):
                acc = acc + w[:, j][None, :] * _tap(x_all, state, seq, start, rows, j, WIDTH, D, HAS_STATE)
            if BACKWARD:
                dy = widen(d_out[block], "C")
                if SILU:
                    y = widen(cast(acc, X.dtype), "C")
                    sig = _ONE / (_ONE + np.exp(np.ascontiguousarray(np.negative(y))))
                    dy = dy * (sig * (_ONE + y * (_ONE - sig)))
                out[block] = dy
                continue
            y = widen(cast(acc, Out.dtype), "C")
            if SILU:
                y = y / (_ONE + np.exp(np.ascontiguousarray(np.negative(y))))
            out[block] = cast(y, Out.dtype)


@register_replay("samepath.kernels.causal_conv1d._causal_conv1d_dx_kernel")
def causal_conv1d_dx(grid, *, DAcc, W, Ends, DX, T, D, WIDTH, BLOCK_T, BLOCK_D) -> None:
    """Every ``DX[s, d]``: the taps ascending, each output row inside the sequence."""
    if T == 0 or D == 0:
        return
    dacc, dx = to_numpy(DAcc), to_numpy(DX)
    w = widen(to_numpy(W), "C")
    ends = Ends.numpy().astype(np.int64)
    for block in row_chunks(T, D * WIDTH):
        rows = np.arange(block.start, block.stop)
        acc = np.zeros((rows.shape[0], D), dtype=np.float32)
        for j in range(WIDTH):
            target = rows + (WIDTH - 1) - j
            ok = target < ends[block]
            dv = np.zeros((rows.shape[0], D), dtype=np.float32)
            dv[ok] = dacc[target[ok]]
            acc = acc + w[:, j][None, :] * dv
        dx[block] = cast(acc, DX.dtype)


@register_replay("samepath.kernels.causal_conv1d._causal_conv1d_dw_kernel")
def causal_conv1d_dw(
    grid, *, X, State, SeqId, Starts, DAcc, DW, T, D, WIDTH, HAS_STATE, BLOCK_T, BLOCK_D
) -> None:  # fmt: skip
    """Every program's ``DW[d, j]``: the ``[BLOCK_T, BLOCK_D]`` tiles of ``da * x_j`` (``da`` for the bias)
    accumulated over the token blocks in order, then summed over the rows, channel block by channel block."""
    x_all, dacc, dw = to_numpy(X), to_numpy(DAcc), to_numpy(DW)
    state = to_numpy(State) if HAS_STATE else None
    seq_all, start_all = SeqId.numpy().astype(np.int64), Starts.numpy().astype(np.int64)
    padded_d = grid[0] * BLOCK_D
    for j in range(grid[1]):
        acc = np.zeros((BLOCK_T, padded_d), dtype=np.float32)
        for t0 in range(0, T, BLOCK_T):
            rows = np.arange(t0, min(t0 + BLOCK_T, T))
            n = rows.shape[0]
            dv = np.zeros((BLOCK_T, padded_d), dtype=np.float32)
            dv[:n, :D] = dacc[rows]
            if j < WIDTH:
                xv = np.zeros((BLOCK_T, padded_d), dtype=np.float32)
                xv[:n, :D] = _tap(x_all, state, seq_all[rows], start_all[rows], rows, j, WIDTH, D, HAS_STATE)
                acc = acc + dv * xv
            else:
                acc = acc + dv
        for c0 in range(0, padded_d, BLOCK_D):
            width = max(0, min(D - c0, BLOCK_D))
            dw[c0 : c0 + width, j] = np.sum(np.ascontiguousarray(acc[:, c0 : c0 + BLOCK_D]), axis=0)[:width]
