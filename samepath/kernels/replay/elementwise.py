"""Helpers of the row-wise and elementwise replays (RMSNorm, rotary, gated activations): strided views
of kernel operands, C-contiguous widening, and row blocks that stay in the CPU's cache.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.replay import numerics
from samepath.kernels.replay.numerics import to_numpy

#: Elements an elementwise replay processes at once (arrays of this size stay in the CPU's cache).
CHUNK_ELEMENTS = 1 << 16


def strided(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The elements a kernel addresses as ``t + sum(index * stride)``, a writable numpy view in the
    interpreter's representation (bf16 as ``uint16`` bits)."""
    return to_numpy(t.detach().as_strided(shape, strides))


def widen(values: np.ndarray) -> np.ndarray:
    """:func:`.numerics.widen` as a C-contiguous array (what the elementwise ufuncs here take)."""
    return numerics.widen(values, order="C")


def row_chunks(rows: int, width: int, multiple: int = 1) -> list[slice]:
    """Consecutive ranges of ``rows`` of about :data:`CHUNK_ELEMENTS` elements (``width`` per row),
    each starting at a multiple of ``multiple`` rows."""
    step = max(multiple, CHUNK_ELEMENTS // max(1, width) // multiple * multiple)
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]
