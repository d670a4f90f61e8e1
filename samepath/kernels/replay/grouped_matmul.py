"""CPU replays of :mod:`samepath.kernels.grouped_matmul`'s ``_grouped_matmul_kernel`` and
``_grouped_weight_grad_kernel`` (the MoE expert GEMMs), bit-identical to the interpreter.

``_grouped_matmul_kernel``: the plan's real row tiles (``TileExpert >= 0``) are gathered at once,
``BLOCK_M`` rows each (rows past ``TileRows`` zero, as the masked loads give), and multiplied as
a batch of one-row-of-tiles matmuls against their expert's weight with the K pieces of
:mod:`samepath.kernels.replay.matmul` (the same C-contiguous ``[BLOCK_M, BLOCK_K] @ [BLOCK_K,
BLOCK_N]`` tile products per K tile, pieces added in order), then cast and stored at each pair's
row. ``Scratch`` (``K_SPLIT > 1``) is left holding each program's last real tile sum.

``_grouped_weight_grad_kernel``: the kernel's serial loop over an expert's pairs, ``BLOCK_P`` at a
time in plan order, is replayed step by step for all (expert, N tile, K tile) programs at once;
at step ``i`` only the experts with more than ``i * BLOCK_P`` pairs take part (the others' loops
have ended). Each step is ``trans(dy) @ x + acc`` with ``trans(dy)`` the transposed view of a
C-contiguous ``[BLOCK_P, BLOCK_N]`` tile, as the interpreter's ``tl.trans`` gives it, widened the
way the patched ``tl.dot`` widens it (bf16) or left to numpy's cast (fp16).
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import bf16_bits_to_fp32, register_replay
from samepath.kernels.replay.matmul import (
    a_tiles,
    b_tiles,
    cdiv,
    fold_k_tiles,
    piece_columns,
    strided,
    untile,
)
from samepath.kernels.replay.numerics import cast, to_numpy

_F32 = np.float32


def _gather_rows(source: np.ndarray, rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``source[rows]`` where ``valid``, zeros elsewhere (a masked row load), ``[*rows.shape, width]``."""
    out = np.zeros((*rows.shape, source.shape[1]), source.dtype)
    out[valid] = source[rows[valid]]
    return out


@register_replay("samepath.kernels.grouped_matmul._grouped_matmul_kernel")
def grouped_matmul_replay(grid: tuple[int, int, int], **params) -> None:
    """``Out[p] = X[p // src_div] @ W[expert(p)]^T`` for the pairs of every real row tile of the plan."""
    n, k, src_div = params["N"], params["K"], params["src_div"]
    bm, bn, bk, k_split = params["BLOCK_M"], params["BLOCK_N"], params["BLOCK_K"], params["K_SPLIT"]
    tiles_n = cdiv(n, bn)
    if tiles_n == 0:
        return
    num_tiles = cdiv(params["num_work"], tiles_n)
    tile_expert = params["TileExpert"][:num_tiles].numpy().astype(np.int64)
    real = np.nonzero(tile_expert >= 0)[0]
    if real.size == 0:
        return
    offs = np.arange(bm)
    valid = offs[None, :] < params["TileRows"].numpy()[real, None]
    positions = params["TileStart"].numpy()[real, None].astype(np.int64) + offs[None, :]
    pairs = np.where(valid, params["Order"].numpy()[np.where(valid, positions, 0)], 0).astype(np.int64)

    x_rows = int(pairs.max()) // src_div + 1
    x = to_numpy(strided(params["X"], (x_rows, k), (params["stride_xm"], params["stride_xk"])))
    a = _gather_rows(x, pairs // src_div, valid)
    experts, b_index = np.unique(tile_expert[real], return_inverse=True)
    w_tensor = params["W"]
    w_strides = (params["stride_we"], params["stride_wn"], params["stride_wk"])
    w = to_numpy(strided(w_tensor, (int(experts[-1]) + 1, n, k), w_strides))[experts].transpose(0, 2, 1)

    piece_k = cdiv(cdiv(k, k_split), bk) * bk
    total = None
    for part in range(k_split):
        first, end = piece_columns(part, k_split, k, piece_k)
        partial = fold_k_tiles(a_tiles(a[:, :, first:end], bm, bk), b_tiles(w[:, first:end], bk, bn), b_index)
        total = partial if part == 0 else total + partial
    if k_split > 1:
        _store_scratch(params["Scratch"], total, real, tiles_n, grid[0])
    out = params["Out"]
    out_rows = int(pairs.max()) + 1
    out_view = to_numpy(strided(out, (out_rows, n), (params["stride_om"], params["stride_on"])))
    out_view[pairs[valid]] = cast(untile(total, bm, n)[valid], out.dtype)


def _store_scratch(scratch: torch.Tensor, total: np.ndarray, real: np.ndarray, tiles_n: int, programs: int) -> None:
    """What each program's scratch tile holds at the end: the sum of its last real work item."""
    bm, bn = total.shape[3], total.shape[4]
    works = (real[:, None] * tiles_n + np.arange(tiles_n)[None, :]).reshape(-1)
    program = works % programs
    last = np.full(programs, -1, np.int64)
    np.maximum.at(last, program, np.arange(works.size))
    has = np.nonzero(last >= 0)[0]
    item = last[has]
    planes = strided(scratch, (programs, bm, bn), (bm * bn, bn, 1)).numpy()
    planes[has] = total[item // tiles_n, 0, item % tiles_n]


@register_replay("samepath.kernels.grouped_matmul._grouped_weight_grad_kernel")
def grouped_weight_grad_replay(grid: tuple[int, int, int], **params) -> None:
    """``dW[e] = sum over e's pairs of dY[p]^T X[p // src_div]``, folded ``BLOCK_P`` pairs at a time."""
    n, k, src_div = params["N"], params["K"], params["src_div"]
    bn, bk, bp = params["BLOCK_N"], params["BLOCK_K"], params["BLOCK_P"]
    tiles_n, tiles_k = cdiv(n, bn), cdiv(k, bk)
    if tiles_n * tiles_k == 0:
        return
    experts = params["num_work"] // (tiles_n * tiles_k)
    if experts == 0:
        return
    start = params["ExpertStart"].numpy()[:experts].astype(np.int64)
    count = params["ExpertCount"].numpy()[:experts].astype(np.int64)
    order = params["Order"].numpy()
    dy_tensor, x_tensor = params["dY"], params["X"]
    acc = np.zeros((experts, tiles_n, tiles_k, bn, bk), _F32)
    offs = np.arange(bp)
    for p0 in range(0, int(count.max(initial=0)), bp):
        active = np.nonzero(count > p0)[0]
        valid = p0 + offs[None, :] < count[active, None]
        positions = start[active, None] + p0 + offs[None, :]
        pairs = np.where(valid, order[np.where(valid, positions, 0)], 0).astype(np.int64)
        rows = int(pairs.max()) + 1
        dy = to_numpy(strided(dy_tensor, (rows, n), (params["stride_dym"], params["stride_dyn"])))
        x = to_numpy(strided(x_tensor, ((rows - 1) // src_div + 1, k), (params["stride_xm"], params["stride_xk"])))
        dy_t = _dot_operand_tiles(_gather_rows(dy, pairs, valid), bp, bn).swapaxes(-1, -2)
        x_t = _dot_operand_tiles(_gather_rows(x, pairs // src_div, valid), bp, bk)
        acc[active] = np.matmul(dy_t[:, :, None], x_t[:, None], dtype=_F32) + acc[active]
    grad = params["dW"]
    grad_strides = (params["stride_we"], params["stride_wn"], params["stride_wk"])
    grad_view = to_numpy(strided(grad, (experts, n, k), grad_strides))
    grad_view[...] = cast(untile(acc, n, k), grad.dtype)


def _dot_operand_tiles(rows: np.ndarray, block_p: int, block: int) -> np.ndarray:
    """``rows [G, block_p, W]`` as C-contiguous ``[G, tile, block_p, block]`` tiles in the operand
    representation the interpreter's ``tl.dot`` multiplies: bf16 widened to fp32, others as loaded."""
    g, _, w = rows.shape
    tiles = np.zeros((g, cdiv(w, block), block_p, block), rows.dtype)
    full = w // block
    tiles[:, :full] = rows[:, :, : full * block].reshape(g, block_p, full, block).transpose(0, 2, 1, 3)
    if w > full * block:
        tiles[:, full, :, : w - full * block] = rows[:, :, full * block :]
    return bf16_bits_to_fp32(tiles) if tiles.dtype == np.uint16 else tiles
