"""CPU replays of RMSNorm's kernels (``samepath.kernels.rms_norm``): ``_rms_norm_fwd_kernel``,
``_rms_norm_bwd_kernel`` and ``_rms_norm_dw_reduce_kernel``, every ``WEIGHT_MODE``, with and without
the residual (forward) and its gradient (backward), whole rows and rows read in chunks.

Rows are independent, so all rows are computed at once as ``[M, BLOCK_N]`` fp32 arrays whose
masked-off columns hold the interpreter's zeros; the reductions keep the kernel's tiles:

* a row's ``sum(h * h)`` and ``sum(dn * n)`` are ``np.sum`` over the padded ``BLOCK_N`` columns of
  each row (chunked rows: the chunk-wide fp32 vector accumulated chunk by chunk in ascending order
  first), exactly the reduction the interpreter applies to a ``[ROWS, BLOCK_N]`` tile's rows;
* a dweight partial is a serial fp32 sum, in ascending order, of its group's tile sums (each
  ``np.sum`` over a ``[ROWS, BLOCK_N]`` tile's rows, padded rows included), or, for chunked rows,
  of its rows' terms; groups are stacked, and a group with fewer tiles adds exact zeros, which
  leaves its partial's bits unchanged (a partial starts at ``+0.0`` and is never ``-0.0``);
* the final dweight is each column's partials added one by one in ascending order.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_ONE = np.float32(1.0)


def _view(t: torch.Tensor, rows: int, cols: int, stride: int) -> np.ndarray:
    """``t``'s ``[rows, cols]`` elements at ``row * stride + col``, a writable view in the
    interpreter's representation."""
    return to_numpy(t.as_strided((rows, cols), (stride, 1)))


def _padded(values: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """fp32 ``values`` in the top-left corner of a ``[rows, cols]`` tile of zeros."""
    tile = np.zeros((rows, cols), dtype=np.float32)
    tile[: values.shape[0], : values.shape[1]] = widen(values)
    return tile


def _weight(W: torch.Tensor, N: int, block: int, mode: int) -> np.ndarray:
    """``_weight_factor`` of the weight loaded over ``block`` columns (zeros past ``N``)."""
    w = _padded(to_numpy(W.as_strided((1, N), (N, 1))), 1, block)[0]
    return _ONE + w if mode == 2 else w


def _rstd(squares: np.ndarray, N: int, eps: float) -> np.ndarray:
    """``rsqrt(sum(squares) / N + eps)``: python scalars are weakly typed (fp32 next to an fp32 tensor)."""
    return 1 / np.sqrt(np.sum(squares, axis=1) / np.float32(N) + np.float32(eps))


def _dw_term(g: np.ndarray, n: np.ndarray, dtype: torch.dtype, mode: int) -> np.ndarray:
    if mode == 0:
        return g * widen(cast(n, dtype))
    return g * n


@register_replay("samepath.kernels.rms_norm._rms_norm_fwd_kernel")
def rms_norm_fwd(
    grid,
    *,
    X,
    Residual,
    W,
    Y,
    S,
    Rstd,
    M,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    eps,
    N,
    BLOCK_N,
    NUM_CHUNKS,
    ROWS,
    HAS_RESIDUAL,
    WEIGHT_MODE,
) -> None:
    """``_rms_norm_fwd_kernel``'s stores: ``Y``, ``Rstd`` and (with the residual) ``S``."""
    if M == 0:
        return
    with np.errstate(all="ignore"):
        width = NUM_CHUNKS * BLOCK_N
        x = _view(X, M, N, stride_x)
        if HAS_RESIDUAL:
            s = cast(widen(x) + widen(_view(Residual, M, N, stride_r)), S.dtype)
            _view(S, M, N, stride_s)[...] = s
            x = s
        h = _padded(x, M, width)
        if NUM_CHUNKS == 1:
            squares = h * h
        else:
            squares = np.zeros((M, BLOCK_N), dtype=np.float32)
            for chunk in range(NUM_CHUNKS):
                part = h[:, chunk * BLOCK_N : (chunk + 1) * BLOCK_N]
                squares += part * part
        rstd = _rstd(squares, N, eps)
        to_numpy(Rstd)[:M] = rstd
        h = h[:, :N]
        w = _weight(W, N, width, WEIGHT_MODE)[:N]
        dtype = Y.dtype
        if WEIGHT_MODE == 0:
            y = cast(w * widen(cast(h * rstd[:, None], dtype)), dtype)
        else:
            y = cast((h * rstd[:, None]) * w, dtype)
        _view(Y, M, N, stride_y)[...] = y


def _bwd_whole_rows(X, W, Rstd, dY, dS, dX, dW_partial, M, strides, N, BLOCK_N, ROWS, GROUP, HAS_DS, mode):
    stride_x, stride_dy, stride_ds, stride_dx = strides
    tiles = -(-M // ROWS)
    rows = tiles * ROWS
    w = _weight(W, N, BLOCK_N, mode)[None, :]
    h = _padded(_view(X, M, N, stride_x), rows, BLOCK_N)
    g = _padded(_view(dY, M, N, stride_dy), rows, BLOCK_N)
    rstd = np.zeros((rows, 1), dtype=np.float32)
    rstd[:M, 0] = to_numpy(Rstd)[:M]
    n = h * rstd
    dn = g * w
    dot = np.sum(dn * n, axis=1)[:, None] / np.float32(N)
    dx = ((dn - n * dot) * rstd)[:M, :N]
    if HAS_DS:
        dx = dx + widen(_view(dS, M, N, stride_ds))
    _view(dX, M, N, stride_dx)[...] = cast(dx, dX.dtype)

    tile_sums = np.sum(_dw_term(g, n, X.dtype, mode).reshape(tiles, ROWS, BLOCK_N), axis=1)
    per_group = GROUP // ROWS
    groups = -(-tiles // per_group)
    stacked = np.zeros((groups * per_group, BLOCK_N), dtype=np.float32)
    stacked[:tiles] = tile_sums
    stacked = stacked.reshape(groups, per_group, BLOCK_N)
    dw = np.zeros((groups, BLOCK_N), dtype=np.float32)
    for k in range(per_group):
        dw = dw + stacked[:, k]
    _view(dW_partial, groups, N, N)[...] = dw[:, :N]


def _bwd_chunked_rows(X, W, Rstd, dY, dS, dX, dW_partial, M, strides, N, BLOCK_N, NUM_CHUNKS, GROUP, HAS_DS, mode):
    stride_x, stride_dy, stride_ds, stride_dx = strides
    width = NUM_CHUNKS * BLOCK_N
    w = _weight(W, N, width, mode)[None, :]
    h = _padded(_view(X, M, N, stride_x), M, width)
    g = _padded(_view(dY, M, N, stride_dy), M, width)
    rstd = to_numpy(Rstd)[:M, None].astype(np.float32)
    n = h * rstd
    dn = g * w
    products = np.zeros((M, BLOCK_N), dtype=np.float32)
    for chunk in range(NUM_CHUNKS):
        part = slice(chunk * BLOCK_N, (chunk + 1) * BLOCK_N)
        products += dn[:, part] * n[:, part]
    dot = (np.sum(products, axis=1) / np.float32(N) + np.float32(0.0))[:, None]
    dx = ((dn - n * dot) * rstd)[:, :N]
    if HAS_DS:
        dx = dx + widen(_view(dS, M, N, stride_ds))
    _view(dX, M, N, stride_dx)[...] = cast(dx, dX.dtype)

    groups = -(-M // GROUP)
    terms = np.zeros((groups * GROUP, width), dtype=np.float32)
    terms[:M] = _dw_term(g, n, X.dtype, mode)
    terms = terms.reshape(groups, GROUP, width)
    dw = np.zeros((groups, width), dtype=np.float32)
    for i in range(GROUP):
        dw = dw + terms[:, i]
    _view(dW_partial, groups, N, N)[...] = dw[:, :N]


@register_replay("samepath.kernels.rms_norm._rms_norm_bwd_kernel")
def rms_norm_bwd(
    grid,
    *,
    X,
    W,
    Rstd,
    dY,
    dS,
    dX,
    dW_partial,
    M,
    stride_x,
    stride_dy,
    stride_ds,
    stride_dx,
    N,
    BLOCK_N,
    NUM_CHUNKS,
    ROWS,
    GROUP,
    HAS_DS,
    WEIGHT_MODE,
) -> None:
    """``_rms_norm_bwd_kernel``'s stores: ``dX`` and one fp32 dweight partial per group of ``GROUP`` rows."""
    if M == 0:
        return
    strides = (stride_x, stride_dy, stride_ds, stride_dx)
    tensors = (X, W, Rstd, dY, dS, dX, dW_partial)
    with np.errstate(all="ignore"):
        if NUM_CHUNKS == 1:
            _bwd_whole_rows(*tensors, M, strides, N, BLOCK_N, ROWS, GROUP, HAS_DS, WEIGHT_MODE)
        else:
            _bwd_chunked_rows(*tensors, M, strides, N, BLOCK_N, NUM_CHUNKS, GROUP, HAS_DS, WEIGHT_MODE)


def _ascending_sum(partials: np.ndarray) -> np.ndarray:
    """``0 + partials[0] + partials[1] + ...`` per column, one fp32 add at a time."""
    acc = np.zeros(partials.shape[1], dtype=np.float32)
    for partial in partials:
        acc = acc + partial
    return acc


@register_replay("samepath.kernels.rms_norm._rms_norm_dw_reduce_kernel")
def rms_norm_dw_reduce(grid, *, dW_partial, dW, num_partials, N, BLOCK) -> None:
    """``_rms_norm_dw_reduce_kernel``'s store: ``dW`` = the partials added one by one in ascending order."""
    if N == 0:
        return
    with np.errstate(all="ignore"):
        acc = _ascending_sum(_view(dW_partial, num_partials, N, N))
        to_numpy(dW.as_strided((N,), (1,)))[...] = cast(acc, dW.dtype)
