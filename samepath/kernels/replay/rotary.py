"""CPU replay of ``_rotary_kernel`` (``samepath.kernels.rotary``): HF's rotate-half rotation of a
``[n0, size1, size2, HEAD]`` tensor and its transpose (the backward), with the partial-rotary
pass-through; a pair is columns ``(i, i + HALF)`` or, ``INTERLEAVED`` (GPT-J), ``(2i, 2i + 1)``.

The kernel is elementwise per ``(row, column < HALF)``: each output pair is a fixed sequence of fp32
products, casts to the output dtype and one add or subtract, the same for any block of rows. The
replay addresses every row at once through the kernel's strides (``cos``/``sin`` share theirs, 0
where broadcast; the last dimension is contiguous) and applies those operations to whole arrays;
the pass-through columns are copied as stored bits. Rows are taken a block at a time (to stay in the
CPU's cache).
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import CHUNK_ELEMENTS, strided, widen
from samepath.kernels.replay.numerics import cast


def _rows(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int], cols: int) -> np.ndarray:
    """``t``'s ``[*shape, cols]`` elements at ``i0 * s0 + i1 * s1 + i2 * s2 + col``, a writable view."""
    return strided(t, (*shape, cols), (*strides, 1))


def _blocks(shape: tuple[int, int, int], cols: int):
    """Index tuples covering ``[n0, size1, size2]`` in pieces of about ``CHUNK_ELEMENTS / cols`` rows."""
    n0, size1, size2 = shape
    rows = max(1, CHUNK_ELEMENTS // max(1, cols))
    if size2 >= rows:
        for i0 in range(n0):
            for i1 in range(size1):
                for start in range(0, size2, rows):
                    yield i0, i1, slice(start, start + rows)
        return
    step1 = rows // size2
    if size1 * size2 >= rows:
        for i0 in range(n0):
            for start in range(0, size1, step1):
                yield i0, slice(start, start + step1)
        return
    step0 = rows // (size1 * size2)
    for start in range(0, n0, step0):
        yield (slice(start, start + step0),)


@register_replay("samepath.kernels.rotary._rotary_kernel")
def rotary(
    grid,
    *,
    X,
    Cos,
    Sin,
    Out,
    num_rows,
    size1,
    size2,
    stride_x0,
    stride_x1,
    stride_x2,
    stride_c0,
    stride_c1,
    stride_c2,
    stride_o0,
    stride_o1,
    stride_o2,
    HALF,
    BLOCK_H,
    HEAD,
    BLOCK_P,
    BLOCK_R,
    BACKWARD,
    INTERLEAVED=False,
) -> None:
    """``_rotary_kernel``'s stores: ``Out[..., :2 * HALF]`` rotated (or, ``BACKWARD``, counter-rotated)
    from ``X``, ``Out[..., 2 * HALF:HEAD]`` copied from ``X``."""
    if num_rows == 0:
        return
    shape = (num_rows // (size1 * size2), size1, size2)
    x = _rows(X, shape, (stride_x0, stride_x1, stride_x2), HEAD)
    cos = _rows(Cos, shape, (stride_c0, stride_c1, stride_c2), 2 * HALF)
    sin = _rows(Sin, shape, (stride_c0, stride_c1, stride_c2), 2 * HALF)
    out = _rows(Out, shape, (stride_o0, stride_o1, stride_o2), HEAD)
    with np.errstate(all="ignore"):
        for block in _blocks(shape, HEAD):
            _rotate(x[block], cos[block], sin[block], out[block], HALF, HEAD, Out.dtype, BACKWARD, INTERLEAVED)


def _pairs(half: int, interleaved: bool) -> tuple[slice, slice]:
    """The columns of each pair's first and second element: ``(i, i + half)`` or ``(2i, 2i + 1)``."""
    if interleaved:
        return slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    return slice(0, half), slice(half, 2 * half)


def _rotate(x, cos, sin, out, half, head, dtype, backward, interleaved=False) -> None:
    one, two = _pairs(half, interleaved)
    x1, x2 = widen(x[..., one]), widen(x[..., two])
    c1, c2 = widen(cos[..., one]), widen(cos[..., two])
    s1, s2 = widen(sin[..., one]), widen(sin[..., two])
    if backward:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = widen(cast(x1 * c1, dtype)) + widen(cast(np.negative(x2) * s1, dtype))
        o2 = widen(cast(x2 * c2, dtype)) + widen(cast(x1 * s2, dtype))
    out[..., one] = cast(o1, dtype)
    out[..., two] = cast(o2, dtype)
    if head > 2 * half:
        out[..., 2 * half :] = x[..., 2 * half :]
