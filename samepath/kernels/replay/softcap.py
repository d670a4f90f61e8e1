"""CPU replay of :func:`samepath.kernels.softcap._softcap_kernel` and the fp32 ``tanh`` the attention
replays share with it (:func:`tanh_fp32`, the kernels' ``tanh_fp32``).

Elementwise: each element goes through the kernel's fp32 operations in the kernel's order (python
floats as fp32 scalars, ``exp`` numpy's on a C-contiguous fp32 array, ``div_rn`` an IEEE division),
on chunks of the flat operands; the block a program handles decides nothing about an element's bits.
"""

from __future__ import annotations

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import CHUNK_ELEMENTS, widen
from samepath.kernels.replay.numerics import cast, to_numpy

_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_MINUS_TWO = np.float32(-2.0)


def tanh_fp32(u: np.ndarray) -> np.ndarray:
    """The kernels' ``tanh_fp32(u)``: ``2 / (1 + exp(-2 u)) - 1`` on fp32 ``u`` (overflow gives -1)."""
    with np.errstate(over="ignore"):
        return _TWO / (_ONE + np.exp(np.ascontiguousarray(_MINUS_TWO * u))) - _ONE


@register_replay("samepath.kernels.softcap._softcap_kernel")
def softcap(grid, *, X, dY, Y, n, cap, BLOCK, BACKWARD) -> None:
    """``_softcap_kernel``: ``Y = cap * tanh(X / cap)`` or, backward, ``Y = dY * (1 - t * t)``."""
    if n <= 0:
        return
    x_flat, y_flat = to_numpy(X.detach().reshape(-1)), to_numpy(Y.detach().reshape(-1))
    dy_flat = to_numpy(dY.detach().reshape(-1)) if BACKWARD else None
    cap32 = np.float32(cap)
    for start in range(0, n, CHUNK_ELEMENTS):
        part = slice(start, min(n, start + CHUNK_ELEMENTS))
        t = tanh_fp32(widen(x_flat[part]) / cap32)
        if BACKWARD:
            y_flat[part] = cast(widen(dy_flat[part]) * (_ONE - t * t), Y.dtype)
        else:
            y_flat[part] = cast(cap32 * t, Y.dtype)
