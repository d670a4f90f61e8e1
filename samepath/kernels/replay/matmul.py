"""CPU replays of :mod:`samepath.kernels.matmul`'s ``_matmul_kernel`` and ``_matmul_reduce_kernel``,
and of :mod:`samepath.kernels.matmul_tma`'s ``_matmul_tma_kernel`` (the same sums with ``K_SLICES = 1``,
its operands addressed through the tensor descriptors' bases and strides).

Every output tile of every batch is computed at once. Per K piece (slice ``piece // K_SPLIT``,
part ``piece % K_SPLIT``), the piece's columns are zero padded to whole ``BLOCK_K`` tiles starting
at the piece's first column, as the kernel's masked loads pad them, and laid out as stacks of
C-contiguous tiles: A as ``[batch, k_tile, tile_m, BLOCK_M, BLOCK_K]``, B as ``[batch, k_tile,
tile_n, BLOCK_K, BLOCK_N]`` (widened to fp32). Then, per K tile in ascending order, one
``np.matmul`` of ``[batch, tile_m, 1, BLOCK_M, BLOCK_K] @ [batch, 1, tile_n, BLOCK_K, BLOCK_N]``:
numpy broadcasts the stack without copying and calls BLAS once per output tile with exactly the
operands, shapes and leading dimensions of the interpreter's ``np.matmul(a, b, dtype=float32)``,
so every tile product has the interpreter's bits on any CPU and BLAS build. The fp32 adds
(``product + acc``, piece and slice sums in the kernel's order), the epilogue (``* alpha``,
``+ beta * bias``, one cast) and the masked stores are elementwise and mirror the kernel exactly.

``PARTIALS`` stores each piece's fp32 partial to ``Partial[piece, batch, m, n]``; ``SCRATCH``
leaves in each program's scratch tile what its last work item stored there (full tiles, padded
lanes included).
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_F32 = np.float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def strided(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """The elements a kernel addresses as ``t + sum(index * stride)`` (``t``'s own storage offset),
    outside autograd."""
    return torch.as_strided(t.detach(), shape, tuple(int(s) for s in strides), t.storage_offset())


def scatter_f32(dst: np.ndarray, x: np.ndarray) -> None:
    """Write ``x [G, r, c]`` (interpreter representation) widened to fp32 into the top-left corner of
    ``dst [G, T1, B1, T2, B2]``, a view of zeros read as the 2-D ``[G, T1 * B1, T2 * B2]``."""
    g, r, c = x.shape
    b1, b2 = dst.shape[2], dst.shape[4]
    r_full, c_full = r // b1, c // b2
    r_rest, c_rest = r - r_full * b1, c - c_full * b2
    target = dst.view(np.uint32) if x.dtype == np.uint16 else dst
    target[:, :r_full, :, :c_full] = x[:, : r_full * b1, : c_full * b2].reshape(g, r_full, b1, c_full, b2)
    if c_rest:
        target[:, :r_full, :, c_full, :c_rest] = x[:, : r_full * b1, c_full * b2 :].reshape(g, r_full, b1, c_rest)
    if r_rest:
        target[:, r_full, :r_rest, :c_full] = x[:, r_full * b1 :, : c_full * b2].reshape(g, r_rest, c_full, b2)
        if c_rest:
            target[:, r_full, :r_rest, c_full, :c_rest] = x[:, r_full * b1 :, c_full * b2 :]
    if x.dtype == np.uint16:
        target <<= np.uint32(16)


def a_tiles(x: np.ndarray, block_m: int, block_k: int) -> np.ndarray:
    """``x [G, M, W]`` as zero padded C-contiguous fp32 tiles ``[G, k_tile, tile_m, block_m, block_k]``."""
    g, m, w = x.shape
    tiles = np.zeros((g, cdiv(w, block_k), cdiv(m, block_m), block_m, block_k), _F32)
    scatter_f32(tiles.transpose(0, 2, 3, 1, 4), x)
    return tiles


def b_tiles(x: np.ndarray, block_k: int, block_n: int) -> np.ndarray:
    """``x [G, W, N]`` as zero padded C-contiguous fp32 tiles ``[G, k_tile, tile_n, block_k, block_n]``."""
    g, w, n = x.shape
    tiles = np.zeros((g, cdiv(w, block_k), cdiv(n, block_n), block_k, block_n), _F32)
    scatter_f32(tiles.transpose(0, 1, 3, 2, 4), x)
    return tiles


def fold_k_tiles(at: np.ndarray, bt: np.ndarray, b_index: np.ndarray | None = None) -> np.ndarray:
    """``acc = 0; for each K tile in order: acc = tile_a @ tile_b + acc`` (fp32) for every output tile.

    ``at [G, nt, TM, BM, BK]``, ``bt [Gb, nt, TN, BK, BN]`` (fp32, C-contiguous tiles); group ``g``
    multiplies by ``bt[b_index[g]]`` (``bt[g]`` without ``b_index``). Returns ``[G, TM, TN, BM, BN]``.
    """
    g, nt, tm, bm, _ = at.shape
    tn, bn = bt.shape[2], bt.shape[4]
    acc = np.zeros((g, tm, tn, bm, bn), _F32)
    if g == 0:
        return acc
    product = np.empty_like(acc)
    for kt in range(nt):
        b = bt[:, kt] if b_index is None else bt[b_index, kt]
        np.matmul(at[:, kt, :, None], b[:, None], out=product, dtype=_F32)
        np.add(product, acc, out=acc)
    return acc


def untile(tiles: np.ndarray, m: int, n: int) -> np.ndarray:
    """``[G, TM, TN, BM, BN]`` tiles as ``[G, m, n]`` (the valid lanes)."""
    g, tm, tn, bm, bn = tiles.shape
    return tiles.transpose(0, 1, 3, 2, 4).reshape(g, tm * bm, tn * bn)[:, :m, :n]


def piece_columns(piece: int, k_split: int, slice_k: int, piece_k: int) -> tuple[int, int]:
    """``[first, end)`` columns of K piece ``piece`` (``k_piece``'s ``k_begin + [lo, hi)``), empty if none."""
    k_begin = (piece // k_split) * slice_k
    lo = (piece % k_split) * piece_k
    hi = min(lo + piece_k, slice_k)
    return k_begin + lo, k_begin + max(hi, lo)


def column_major(tiles: np.ndarray) -> np.ndarray:
    """The same tiles, each laid out column-major (the interpreter's ``tl.trans`` of a loaded tile,
    which it multiplies as such: BLAS's transposed-operand form)."""
    return np.ascontiguousarray(tiles.swapaxes(-1, -2)).swapaxes(-1, -2)


def piece_partial(
    a: np.ndarray, b: np.ndarray, first: int, end: int, bm: int, bn: int, bk: int, a_t: bool = False, b_t: bool = False
) -> np.ndarray:
    """One K piece's fp32 partial ``[G, TM, TN, BM, BN]`` of ``a [G, M, K] @ b [G, K, N]``: columns
    ``[first, end)`` in ``BLOCK_K`` tiles from ``first``; ``a_t`` / ``b_t``: that operand's tiles
    column-major (:func:`column_major`)."""
    at = a_tiles(a[:, :, first:end], bm, bk)
    bt = b_tiles(b[:, first:end, :], bk, bn)
    return fold_k_tiles(column_major(at) if a_t else at, column_major(bt) if b_t else bt)


def tile_of(work: np.ndarray, tiles_m: int, tiles_n: int, group_m: int) -> tuple[np.ndarray, ...]:
    """``_tile_of``: ``(pid_m, pid_n, rest)`` of work items ``work`` (non-negative ints)."""
    tiles = tiles_m * tiles_n
    tile = work % tiles
    per_group = group_m * tiles_n
    first_m = (tile // per_group) * group_m
    rows_in_group = np.minimum(tiles_m - first_m, group_m)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group, work // tiles


def last_work(programs: int, work_items: int) -> np.ndarray:
    """The last work item of each program ``p < min(programs, work_items)`` of a persistent loop."""
    p = np.arange(min(programs, work_items), dtype=np.int64)
    return p + ((work_items - 1 - p) // programs) * programs


def epilogue(total: np.ndarray, params: dict, batch: int, m: int, n: int) -> None:
    """``_epilogue`` on ``total [batch, m, n]`` (fp32, the valid lanes): alpha, beta * bias, cast, store."""
    if params["SCALE_ACC"]:
        total = total * _F32(params["alpha"])
    if params["HAS_BIAS"]:
        bias_strides = (params["stride_bias_batch"], params["stride_bias_m"], params["stride_bias_n"])
        bias = widen(to_numpy(strided(params["Bias"], (batch, m, n), bias_strides)))
        if params["SCALE_BIAS"]:
            bias = bias * _F32(params["beta"])
        total = total + bias
    c = params["C"]
    c_view = to_numpy(strided(c, (batch, m, n), (params["stride_c_batch"], params["stride_cm"], params["stride_cn"])))
    c_view[...] = cast(total, c.dtype)


@register_replay("samepath.kernels.matmul._matmul_kernel")
def matmul_replay(grid: tuple[int, int, int], **params) -> None:
    """``_matmul_kernel`` in every mode (plain, ``PARTIALS``, ``SCRATCH``), any strides, any grid."""
    batch, m, n = params["batch_count"], params["M"], params["N"]
    if batch * m * n == 0:
        return
    k = params["K_SLICES"] * params["slice_k"]
    a_strides = (params["stride_a_batch"], params["stride_am"], params["stride_ak"])
    b_strides = (params["stride_b_batch"], params["stride_bk"], params["stride_bn"])
    a = to_numpy(strided(params["A"], (batch, m, k), a_strides))
    b = to_numpy(strided(params["B"], (batch, k, n), b_strides))
    _sums(a, b, grid, params, params["K_SLICES"], params["slice_k"], params["SCRATCH"], (False, False))


def _operand(desc, shape: tuple[int, int, int], transposed: bool) -> np.ndarray:
    """The ``[batch, rows, cols]`` operand a descriptor over it (``transposed``: over ``[batch, cols,
    rows]``) addresses."""
    batch_stride, row_stride, _ = desc.strides
    strides = (batch_stride, 1, row_stride) if transposed else (batch_stride, row_stride, 1)
    return to_numpy(strided(desc.base, shape, strides))


@register_replay("samepath.kernels.matmul_tma._matmul_tma_kernel")
def matmul_tma_replay(grid: tuple[int, int, int], **params) -> None:
    """``_matmul_tma_kernel`` (plain and ``PARTIALS``): ``_matmul_kernel``'s sums with one K slice."""
    batch, m, n, k = params["batch_count"], params["M"], params["N"], params["K"]
    if batch * m * n == 0:
        return
    a = _operand(params["A_desc"], (batch, m, k), params["A_T"])
    b = _operand(params["B_desc"], (batch, k, n), params["B_T"])
    # The interpreter multiplies a transposed tile in its transposed layout when it widens bf16
    # (dispatch's widening keeps the layout); numpy's fp16 matmul multiplies C-contiguous copies.
    bf16 = a.dtype == np.uint16  # to_numpy's bf16 bits
    _sums(a, b, grid, params, 1, k, False, (params["A_T"] and bf16, params["B_T"] and bf16))


def _sums(
    a: np.ndarray, b: np.ndarray, grid, params: dict, k_slices: int, slice_k: int, scratch: bool, layout: tuple
) -> None:
    """The stores of a matmul kernel on ``a [batch, M, K]``, ``b [batch, K, N]``: the pieces' fp32
    partials (``PARTIALS``) or the pieces and slices summed in order, the scratch planes, the epilogue.
    ``layout``: whether the kernel multiplies A's / B's tiles transposed (:func:`piece_partial`)."""
    batch, m, n = params["batch_count"], params["M"], params["N"]
    bm, bn, bk = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"]
    k_split, piece_k = params["K_SPLIT"], params["piece_k"]
    tiles_m, tiles_n = cdiv(m, bm), cdiv(n, bn)
    pieces = k_slices * k_split

    def partial(piece: int) -> np.ndarray:
        first, end = piece_columns(piece, k_split, slice_k, piece_k)
        return piece_partial(a, b, first, end, bm, bn, bk, *layout)

    if params["PARTIALS"]:
        out = strided(params["Partial"], (pieces, batch, m, n), (batch * m * n, m * n, n, 1))
        out_np = out.numpy()
        for piece in range(pieces):
            out_np[piece] = untile(partial(piece), m, n)
        return
    total = running = None
    for s in range(k_slices):
        slice_total = partial(s * k_split)
        for part in range(1, k_split):
            if part == k_split - 1:
                running = slice_total
            slice_total = slice_total + partial(s * k_split + part)
        total = slice_total if s == 0 else total + slice_total
    if scratch:
        work = last_work(grid[0], batch * tiles_m * tiles_n)
        pid_m, pid_n, rest = tile_of(work, tiles_m, tiles_n, params["GROUP_M"])
        planes = strided(params["Scratch"], (work.shape[0], 2, bm, bn), (2 * bm * bn, bm * bn, bn, 1)).numpy()
        batch_index = rest % batch
        if running is not None:
            planes[:, 0] = running[batch_index, pid_m, pid_n]
        planes[:, 1] = total[batch_index, pid_m, pid_n]
    epilogue(untile(total, m, n), params, batch, m, n)


@register_replay("samepath.kernels.matmul._matmul_reduce_kernel")
def matmul_reduce_replay(grid: tuple[int, int, int], **params) -> None:
    """``_matmul_reduce_kernel``: the fp32 partials added in piece order per slice, slices in order, epilogue."""
    batch, m, n = params["batch_count"], params["M"], params["N"]
    k_slices, k_split = params["K_SLICES"], params["K_SPLIT"]
    if batch * m * n == 0:
        return
    partials = strided(params["Partial"], (k_slices * k_split, batch, m, n), (batch * m * n, m * n, n, 1)).numpy()
    total = None
    for s in range(k_slices):
        slice_total = partials[s * k_split]
        for part in range(1, k_split):
            slice_total = slice_total + partials[s * k_split + part]
        total = slice_total if s == 0 else total + slice_total
    epilogue(np.array(total, _F32), params, batch, m, n)
