"""CPU replay of ``_causal_conv1d_kernel`` (:mod:`samepath.kernels.causal_conv1d`).

Elementwise over ``[T, D]``: the block a program handles decides nothing about an element's bits. Each
element goes through the kernel's fp32 operations in the kernel's order (the bias plus a zero tile, then
``acc + w * x`` tap by tap, ascending), on arrays of whole rows; ``exp`` is numpy's on a C-contiguous
fp32 array, as the interpreter applies it to a contiguous tile.
"""

from __future__ import annotations

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import row_chunks
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_ONE = np.float32(1.0)


@register_replay("samepath.kernels.causal_conv1d._causal_conv1d_kernel")
def causal_conv1d(
    grid, *, X, W, Bias, State, SeqId, Starts, Out, T, D, WIDTH, HAS_BIAS, HAS_STATE, SILU, BLOCK_T, BLOCK_D
) -> None:
    """Every ``Out[t, d]`` of the launch."""
    if T == 0 or D == 0:
        return
    x_all, out = to_numpy(X), to_numpy(Out)
    w = widen(to_numpy(W), "C")  # [D, WIDTH]
    bias = widen(to_numpy(Bias), "C") if HAS_BIAS else None
    state = to_numpy(State) if HAS_STATE else None
    seq_all, start_all = SeqId.numpy().astype(np.int64), Starts.numpy().astype(np.int64)
    with np.errstate(all="ignore"):
        for block in row_chunks(T, D * WIDTH):
            rows = np.arange(block.start, block.stop)
            seq, start = seq_all[block], start_all[block]
            acc = np.zeros((rows.shape[0], D), dtype=np.float32)
            if HAS_BIAS:
                acc = bias[None, :] + acc
            for j in range(WIDTH):
                src = rows - (WIDTH - 1) + j
                inside = src >= start
                xv = np.zeros((rows.shape[0], D), dtype=x_all.dtype)
                xv[inside] = x_all[src[inside]]
                xv = widen(xv, "C")
                if HAS_STATE:
                    outside = ~inside
                    slot = (WIDTH - 1) + src - start
                    sv = np.zeros((rows.shape[0], D), dtype=state.dtype)
                    sv[outside] = state[seq[outside], :, slot[outside]]
                    xv = np.where(inside[:, None], xv, widen(sv, "C"))
                acc = acc + w[:, j][None, :] * xv
            y = widen(cast(acc, Out.dtype), "C")
            if SILU:
                y = y / (_ONE + np.exp(np.ascontiguousarray(np.negative(y))))
            out[block] = cast(y, Out.dtype)
