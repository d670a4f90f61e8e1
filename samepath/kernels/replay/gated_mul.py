"""CPU replays of the gated activations ``act(gate) * up``: ``_silu_mul_kernel`` (SiLU, HF's
``LlamaMLP``), ``_gelu_tanh_mul_kernel`` (GELU-tanh in its sigmoid form, Gemma's MLP) and
``_clamped_swiglu_kernel`` (GPT-OSS's experts), forward and backward.

The kernels are elementwise over ``[M, N]`` operands addressed through row and column strides; the
block a program handles decides nothing about an element's bits. Each element goes through the
kernel's fp32 operations in the kernel's order, on arrays of whole rows: python-float and
constexpr constants are fp32 scalars (``3.0 * KAPPA`` folded in double first, as a constexpr
product is), and ``exp`` is numpy's on a C-contiguous fp32 array, as the interpreter applies it to a
contiguous tile.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.elementwise import row_chunks, strided, widen
from samepath.kernels.replay.numerics import cast

_ONE = np.float32(1.0)


def _silu(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    e = _ONE + np.exp(np.negative(g))

    def derivative(sig: np.ndarray) -> np.ndarray:
        return sig * (_ONE + g * (_ONE - sig))

    return g, e, derivative


def _gelu_tanh(k: float, kappa: float) -> Callable[[np.ndarray], tuple]:
    k32, kappa32, three_kappa = np.float32(k), np.float32(kappa), np.float32(3.0 * kappa)

    def act(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]]:
        z = k32 * (g + kappa32 * (g * g * g))
        e = _ONE + np.exp(np.ascontiguousarray(np.negative(z)))

        def derivative(s: np.ndarray) -> np.ndarray:
            return s + g * s * (_ONE - s) * (k32 * (_ONE + three_kappa * (g * g)))

        return g, e, derivative

    return act


def _gated(act, Gate, Up, dOut, Out, dUp, strides, M, N, backward) -> None:
    """The gated kernel's stores for every ``(row, column)`` of ``[M, N]``; ``act(g)`` returns
    ``(g, e, derivative)`` with the activation ``g / e`` and ``derivative(1 / e)``. Rows are taken
    a few at a time (each element's operations do not depend on its neighbours)."""
    if M * N == 0:
        return
    views = [strided(t, (M, N), strides[2 * i : 2 * i + 2]) for i, t in enumerate((Gate, Up, dOut, Out, dUp))]
    gate, up, grad, out, grad_up = views
    with np.errstate(all="ignore"):
        for rows in row_chunks(M, N):
            g, e, derivative = act(widen(gate[rows]))
            u = widen(up[rows])
            a = widen(cast(g / e, Out.dtype))
            if backward:
                dy = widen(grad[rows])
                grad_up[rows] = cast(dy * a, dUp.dtype)
                out[rows] = cast(dy * u * derivative(_ONE / e), Out.dtype)
            else:
                out[rows] = cast(a * u, Out.dtype)


_STRIDES = (
    "stride_g_row",
    "stride_g_col",
    "stride_u_row",
    "stride_u_col",
    "stride_do_row",
    "stride_do_col",
    "stride_o_row",
    "stride_o_col",
    "stride_du_row",
    "stride_du_col",
)


@register_replay("samepath.kernels.swiglu._silu_mul_kernel")
def silu_mul(grid, *, Gate, Up, dOut, Out, dUp, M, N, BLOCK_N, BACKWARD, **strides) -> None:
    """``_silu_mul_kernel``: ``Out = silu(gate) * up`` or, backward, ``Out = dgate`` and ``dUp``."""
    _gated(_silu, Gate, Up, dOut, Out, dUp, [strides[s] for s in _STRIDES], M, N, BACKWARD)


@register_replay("samepath.kernels.gelu_tanh_mul._gelu_tanh_mul_kernel")
def gelu_tanh_mul(grid, *, Gate, Up, dOut, Out, dUp, M, N, K, KAPPA, BLOCK_N, BACKWARD, **strides) -> None:
    """``_gelu_tanh_mul_kernel``: ``Out = gelu_tanh(gate) * up`` or, backward, ``Out = dgate`` and ``dUp``."""
    _gated(_gelu_tanh(K, KAPPA), Gate, Up, dOut, Out, dUp, [strides[s] for s in _STRIDES], M, N, BACKWARD)


@register_replay("samepath.kernels.clamped_swiglu._clamped_swiglu_kernel")
def clamped_swiglu(grid, *, Gate, Up, dOut, Out, dUp, M, N, BLOCK_N, BACKWARD, LIMIT, ALPHA, **strides) -> None:
    """``_clamped_swiglu_kernel``: ``Out = (clamp(up) + 1) * glu(min(gate, LIMIT))`` or, backward,
    ``Out = dgate`` and ``dUp``; every op of the kernel in its order, rounded where it rounds."""
    if M * N == 0:
        return
    gate_v, up_v, grad_v, out_v, grad_up_v = (
        strided(t, (M, N), (strides[_STRIDES[2 * i]], strides[_STRIDES[2 * i + 1]]))
        for i, t in enumerate((Gate, Up, dOut, Out, dUp))
    )
    limit, alpha = np.float32(LIMIT), np.float32(ALPHA)
    dtype = Out.dtype

    def r(values: np.ndarray) -> np.ndarray:
        return widen(cast(values, dtype))

    with np.errstate(all="ignore"):
        for rows in row_chunks(M, N):
            gate, up = widen(gate_v[rows]), widen(up_v[rows])
            g = r(np.minimum(gate, limit))
            u = r(np.minimum(np.maximum(up, -limit), limit))
            z = r(g * alpha)
            sig = _ONE / (_ONE + np.exp(np.ascontiguousarray(np.negative(z))))
            glu = r(g * r(sig))
            u1 = r(u + _ONE)
            if BACKWARD:
                dy = widen(grad_v[rows])
                dglu = sig + g * alpha * sig * (_ONE - sig)
                dgate = np.where(gate <= limit, dy * u1 * dglu, np.float32(0.0))
                dup = np.where((up >= -limit) & (up <= limit), dy * glu, np.float32(0.0))
                grad_up_v[rows] = cast(dup, dUp.dtype)
                out_v[rows] = cast(dgate, dtype)
            else:
                out_v[rows] = cast(u1 * glu, dtype)
