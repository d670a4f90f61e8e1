"""CPU replays of :mod:`samepath.kernels.reductions` (``batch_invariant()``'s softmax, sum, mean,
var / std and vector norms, and the column sum / mean), bit-identical to Triton's interpreter.

The row kernels fold ``CHUNK``-column tiles serially in ascending order, as the logprob kernels do:
the replays keep the ``[rows, CHUNK]`` tiles of :class:`~samepath.kernels.replay.logprobs.RowTiles`
(each row summed by ``np.sum`` over the tile's zero-padded width, as the kernel's tile is) and the per-row fp32
running totals as ``[rows]`` vectors; the 16-lane scalar division (``_scalar_div_rn``) is
:func:`~samepath.kernels.replay.logprobs.lane_quotient`. The column kernel's ``[TILE_R, TILE_C]``
tile is summed over its first axis by ``np.sum``, which adds the tile's rows one after the other:
the replay lays all programs' tiles side by side (``[TILE_R, A * C]``, the columns past ``C`` of
the last column tile left out: every column is summed alone) and sums that over its first axis,
the same additions per column. The zero rows past ``R`` of the last tile only add
``+0`` (turning a ``-0`` sum into ``+0``), so that tile is summed over its valid rows, plus ``+0``.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.logprobs import (
    RowTiles,
    contiguous_rows,
    flat,
    fp32_scalar,
    lane_quotient,
    quiet,
    row_lse,
)
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_F32 = np.float32


def _row_totals(tiles: RowTiles) -> np.ndarray:
    """``_row_total`` for every row: ``total = total + tl.sum(chunk)``, chunk by chunk."""
    total = np.zeros(tiles.rows, _F32)
    for start in range(0, tiles.V, tiles.chunk):
        total = total + tiles.sum(tiles.widened(start), start)
    return total


def _row_count(V: int) -> np.ndarray:
    """``V * 1.0``: the int32 row length converted to fp32."""
    return np.array([V], dtype=np.int32).astype(_F32)


def _store(t: torch.Tensor, rows: int, values: np.ndarray) -> None:
    flat(t)[:rows] = cast(np.ascontiguousarray(values, dtype=_F32), t.dtype)


@register_replay("samepath.kernels.reductions._softmax_kernel")
@quiet
def softmax(grid, *, X, row_offsets, Out, num_rows, stride_v, V, CHUNK):
    """``_softmax_kernel``: ``exp(x - lse)`` (lse of ``row_lse`` at temperature 1), one cast."""
    if num_rows == 0:
        return
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    lse, _ = row_lse(tiles, fp32_scalar(1.0), False)
    out = contiguous_rows(Out, num_rows, V)
    for start in range(0, V, CHUNK):
        width = min(CHUNK, V - start)
        p = np.exp(tiles.widened(start) - lse[:, None])
        out[:, start : start + width] = cast(np.ascontiguousarray(p[:, :width]), Out.dtype)


@register_replay("samepath.kernels.reductions._row_sum_kernel")
@quiet
def row_sum(grid, *, X, row_offsets, Out, num_rows, stride_v, V, MEAN, CHUNK):
    """``_row_sum_kernel``: the fp32 chunked row sum (``MEAN``: divided by ``V``), one cast."""
    if num_rows == 0:
        return
    total = _row_totals(RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK))
    if MEAN:
        total = lane_quotient(total, np.broadcast_to(_row_count(V), total.shape))
    _store(Out, num_rows, total)


@register_replay("samepath.kernels.reductions._row_var_kernel")
@quiet
def row_var(grid, *, X, row_offsets, Var, Mean, num_rows, stride_v, V, divisor, STD, STORE_MEAN, CHUNK):
    """``_row_var_kernel``: the mean, then the chunked fp32 sum of ``(x - mean)^2`` over ``divisor``."""
    if num_rows == 0:
        return
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    mean = lane_quotient(_row_totals(tiles), np.broadcast_to(_row_count(V), (num_rows,)))
    m2 = np.zeros(num_rows, _F32)
    for start in range(0, V, CHUNK):
        centered = tiles.widened(start) - mean[:, None]
        if start + centered.shape[1] > V:
            centered = np.where(tiles.valid(start), centered, _F32(0.0))
        m2 = m2 + tiles.sum(centered * centered, start)
    var = lane_quotient(m2, np.broadcast_to(fp32_scalar(divisor), (num_rows,)))
    if STD:
        var = np.sqrt(var)
    _store(Var, num_rows, var)
    if STORE_MEAN:
        _store(Mean, num_rows, mean)


@register_replay("samepath.kernels.reductions._row_norm_kernel")
@quiet
def row_norm(grid, *, X, row_offsets, Out, num_rows, stride_v, V, ORD, CHUNK):
    """``_row_norm_kernel``: chunked fp32 sum of ``|x|`` (ord 1) or ``x * x`` and ``sqrt`` (ord 2)."""
    if num_rows == 0:
        return
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    total = np.zeros(num_rows, _F32)
    for start in range(0, V, CHUNK):
        x = tiles.widened(start)
        terms = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).view(_F32) if ORD == 1 else x * x
        total = total + tiles.sum(terms, start)
    if ORD == 2:
        total = np.sqrt(total)
    _store(Out, num_rows, total)


@register_replay("samepath.kernels.reductions._column_sum_kernel")
@quiet
def column_sum(grid, *, X, Out, num_tiles, C, R, stride_a, stride_r, stride_c, MEAN, TILE_R, TILE_C):
    """``_column_sum_kernel``: over the middle axis of ``X`` seen as ``[A, R, C]`` (the given strides),
    ``TILE_R`` reduced rows per step summed over the tile's first axis, ascending, fp32."""
    if num_tiles == 0:
        return
    A = num_tiles // -(-C // TILE_C)
    view = torch.as_strided(X, (A, R, C), (stride_a, stride_r, stride_c))
    total = np.zeros(A * C, _F32)
    for start in range(0, R, TILE_R):
        height = min(TILE_R, R - start)
        tile = np.ascontiguousarray(widen(to_numpy(view[:, start : start + height])).transpose(1, 0, 2))
        tile_sum = np.sum(tile.reshape(height, A * C), axis=0)
        if height < TILE_R:
            tile_sum = tile_sum + _F32(0.0)
        total = total + tile_sum
    if MEAN:
        total = np.divide(total, np.zeros(A * C, _F32) + np.array([R], dtype=np.int32).astype(_F32))
    contiguous_rows(Out, A, C)[:, :] = cast(total.reshape(A, C), Out.dtype)
