"""CPU replays of RMSNorm's kernels (``samepath.kernels.rms_norm``): ``_rms_norm_fwd_kernel``,
``_rms_norm_bwd_kernel`` and ``_rms_norm_dw_reduce_kernel``, every ``WEIGHT_MODE``, with and without
the residual (forward) and its gradient (backward), whole rows and rows read in chunks.

Rows are independent, so many rows are computed at once (a few whole tiles of rows at a time, to stay
in the CPU's cache) as ``[rows, NUM_CHUNKS * BLOCK_N]`` fp32 arrays whose masked-off columns hold the
interpreter's zeros; the reductions keep the kernel's tiles:

* a row's ``sum(h * h)`` and ``sum(dn * n)`` are ``np.sum`` over the padded ``BLOCK_N`` columns of
  each row (chunked rows: the chunk-wide fp32 vector accumulated chunk by chunk in ascending order
  first), exactly the reduction the interpreter applies to a ``[ROWS, BLOCK_N]`` tile's rows;
* a dweight partial is a serial fp32 sum, in ascending order, of its group's tile sums (each
  ``np.sum`` over a ``[ROWS, BLOCK_N]`` tile's rows, padded rows included), or, for chunked rows,
  of its rows' terms; groups are stacked, and a group with fewer tiles adds exact zeros, which
  leaves its partial's bits unchanged (a partial starts at ``+0.0`` and is never ``-0.0``);
* a reduction level (``_rms_norm_dw_reduce_kernel``) adds each span's partials one by one in
  ascending order from 0 (the span sums, or dweight itself).
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import row_chunks, strided, widen
from samepath.kernels.replay.numerics import cast

_ONE = np.float32(1.0)


def _view(t: torch.Tensor, rows: int, cols: int, stride: int) -> np.ndarray:
    """``t``'s ``[rows, cols]`` elements at ``row * stride + col``."""
    return strided(t, (rows, cols), (stride, 1))


def _padded(values: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """fp32 ``values`` in the top-left corner of a ``[rows, cols]`` tile of zeros."""
    tile = np.zeros((rows, cols), dtype=np.float32)
    tile[: values.shape[0], : values.shape[1]] = widen(values)
    return tile


def _weight(W: torch.Tensor, N: int, block: int, mode: int) -> np.ndarray:
    """``_weight_factor`` of the weight loaded over ``block`` columns (zeros past ``N``)."""
    w = _padded(_view(W, 1, N, N), 1, block)[0]
    return _ONE + w if mode == 2 else w


def _rstd(squares: np.ndarray, N: int, eps: float) -> np.ndarray:
    """``rsqrt(sum(squares) / N + eps)``: python scalars are weakly typed (fp32 next to an fp32 tensor)."""
    return 1 / np.sqrt(np.sum(squares, axis=1) / np.float32(N) + np.float32(eps))


def _chunk_sum(values: np.ndarray, chunks: int, block: int) -> np.ndarray:
    """``zeros + values[:, chunk 0] + values[:, chunk 1] + ...``: a chunk-wide fp32 vector per row."""
    total = np.zeros((values.shape[0], block), dtype=np.float32)
    for chunk in range(chunks):
        total += values[:, chunk * block : (chunk + 1) * block]
    return total


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
    width = NUM_CHUNKS * BLOCK_N
    x_rows, y_rows, rstd_out = _view(X, M, N, stride_x), _view(Y, M, N, stride_y), _view(Rstd, M, 1, 1)[:, 0]
    if HAS_RESIDUAL:
        r_rows, s_rows = _view(Residual, M, N, stride_r), _view(S, M, N, stride_s)
    w = _weight(W, N, width, WEIGHT_MODE)[:N]
    with np.errstate(all="ignore"):
        for rows in row_chunks(M, width):
            x = x_rows[rows]
            if HAS_RESIDUAL:
                x = s_rows[rows] = cast(widen(x) + widen(r_rows[rows]), S.dtype)
            h = _padded(x, x.shape[0], width)
            squares = h * h
            if NUM_CHUNKS > 1:
                squares = _chunk_sum(squares, NUM_CHUNKS, BLOCK_N)
            rstd = _rstd(squares, N, eps)
            rstd_out[rows] = rstd
            n = h[:, :N] * rstd[:, None]
            if WEIGHT_MODE == 0:
                y_rows[rows] = cast(w * widen(cast(n, Y.dtype)), Y.dtype)
            else:
                y_rows[rows] = cast(n * w, Y.dtype)


def _bwd_rows(X, W, Rstd, dY, dS, dX, M, strides, N, block, chunks, rows_per_tile, has_ds, mode):
    """dx of every row; yields, per range of whole tiles of rows, the range and the rows' fp32
    dweight terms (rows past ``M`` zero, as the kernel's masked loads make them)."""
    stride_x, stride_dy, stride_ds, stride_dx = strides
    width = chunks * block
    x_rows, g_rows, dx_rows = _view(X, M, N, stride_x), _view(dY, M, N, stride_dy), _view(dX, M, N, stride_dx)
    ds_rows = _view(dS, M, N, stride_ds) if has_ds else None
    rstd_rows = _view(Rstd, M, 1, 1)
    w = _weight(W, N, width, mode)[None, :]
    padded_rows = -(-M // rows_per_tile) * rows_per_tile
    for rows in row_chunks(padded_rows, width, rows_per_tile):
        real = slice(rows.start, min(rows.stop, M))
        count = rows.stop - rows.start
        h = _padded(x_rows[real], count, width)
        g = _padded(g_rows[real], count, width)
        rstd = _padded(rstd_rows[real], count, 1)
        n = h * rstd
        dn = g * w
        products = dn * n
        if chunks > 1:
            products = _chunk_sum(products, chunks, block)
        dot = np.sum(products, axis=1)[:, None] / np.float32(N)
        if chunks > 1:
            dot = dot + np.float32(0.0)  # the kernel picks a row's dot out of a GROUP vector with tl.sum
        dx = ((dn - n * dot) * rstd)[: real.stop - real.start, :N]
        if has_ds:
            dx = dx + widen(ds_rows[real])
        dx_rows[real] = cast(dx, dX.dtype)
        yield rows, _dw_term(g, n, X.dtype, mode)


def _serial_sum(terms: np.ndarray) -> np.ndarray:
    """``zeros + terms[:, 0] + terms[:, 1] + ...`` over axis 1 of ``[groups, steps, cols]``."""
    total = np.zeros((terms.shape[0], terms.shape[2]), dtype=np.float32)
    for step in range(terms.shape[1]):
        total = total + terms[:, step]
    return total


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
    """``_rms_norm_bwd_kernel``'s stores: ``dX`` and one fp32 dweight partial per group of ``GROUP`` rows.

    Whole rows: a group's partial is its tiles' sums (``np.sum`` over each ``[ROWS, BLOCK_N]`` tile's
    rows) added in ascending order. Chunked rows (``ROWS == 1``): its rows' terms added in ascending
    order. Missing tiles / rows of the last group count as zeros (adding ``+0.0`` to a partial that
    started at ``+0.0`` changes no bits)."""
    if M == 0:
        return
    strides = (stride_x, stride_dy, stride_ds, stride_dx)
    groups = -(-M // GROUP)
    per_group = GROUP // ROWS
    width = NUM_CHUNKS * BLOCK_N
    tiles = np.zeros((groups * per_group, width), dtype=np.float32)
    with np.errstate(all="ignore"):
        for rows, terms in _bwd_rows(
            X, W, Rstd, dY, dS, dX, M, strides, N, BLOCK_N, NUM_CHUNKS, ROWS, HAS_DS, WEIGHT_MODE
        ):
            if ROWS > 1:
                terms = np.sum(terms.reshape(-1, ROWS, width), axis=1)
            tiles[rows.start // ROWS : rows.stop // ROWS] = terms
        partials = _serial_sum(tiles.reshape(groups, per_group, width))
    _view(dW_partial, groups, N, N)[...] = partials[:, :N]


def _ascending_sum(partials: np.ndarray) -> np.ndarray:
    """``0 + partials[0] + partials[1] + ...`` per column, one fp32 add at a time."""
    return _serial_sum(partials[None])[0]


@register_replay("samepath.kernels.rms_norm._rms_norm_dw_reduce_kernel")
def rms_norm_dw_reduce(grid, *, dW_partial, Out, num_partials, span, N, BLOCK, BATCH) -> None:
    """``_rms_norm_dw_reduce_kernel``'s stores: ``Out[s]`` = partials ``s * span ..`` (at most ``span``)
    added one by one in ascending order from 0, cast to ``Out``'s dtype."""
    if num_partials == 0:
        return
    spans = -(-num_partials // span)
    partials = _view(dW_partial, num_partials, N, N)
    out = _view(Out, spans, N, N)
    with np.errstate(all="ignore"):
        for s in range(spans):
            out[s] = cast(_ascending_sum(partials[s * span : (s + 1) * span]), Out.dtype)
