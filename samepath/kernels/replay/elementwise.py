"""Helpers of the row-wise and elementwise replays (RMSNorm, rotary, gated activations): strided views
of kernel operands and the interpreter's casts, computed with fewer passes over memory.

:func:`widen` and :func:`cast` return exactly what :func:`.numerics.widen` / :func:`.numerics.cast`
return (bf16 widened by the same 16-bit shift; fp32 -> bf16 by the same round-to-nearest-even integer
formula as :func:`samepath.kernels.dispatch.fp32_to_bf16_bits`, NaN as ``0x7FC0``), with in-place
integer steps instead of a temporary per step.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.replay.numerics import numpy_dtype, to_numpy

#: Elements an elementwise replay processes at once (arrays of this size stay in the CPU's cache).
CHUNK_ELEMENTS = 1 << 16


def strided(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The elements a kernel addresses as ``t + sum(index * stride)``, a writable numpy view in the
    interpreter's representation (bf16 as ``uint16`` bits)."""
    return to_numpy(t.detach().as_strided(shape, strides))


def widen(values: np.ndarray) -> np.ndarray:
    """``.to(tl.float32)`` as a C-contiguous array: bf16 bits shifted into the high half of an fp32,
    fp16 / fp32 by ``astype``."""
    if values.dtype == np.uint16:
        wide = values.astype(np.uint32, order="C")
        wide <<= 16
        return wide.view(np.float32)
    return values.astype(np.float32, order="C")


def cast(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``.to(dtype)`` of fp32 ``values`` in the interpreter's representation (bf16 rounded to nearest even)."""
    if dtype != torch.bfloat16:
        return values.astype(numpy_dtype(dtype))
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def row_chunks(rows: int, width: int, multiple: int = 1) -> list[slice]:
    """Consecutive ranges of ``rows`` of about :data:`CHUNK_ELEMENTS` elements (``width`` per row),
    each starting at a multiple of ``multiple`` rows."""
    step = max(multiple, CHUNK_ELEMENTS // max(1, width) // multiple * multiple)
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]
