"""GPT-OSS's clamped SwiGLU with Hugging Face's rounding points, and its backward.

``GptOssExperts._apply_gate`` (transformers 5) computes, in the model dtype, on the interleaved
``gate_up`` (gate ``[..., ::2]``, up ``[..., 1::2]``)::

    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    glu = gate * sigmoid(gate * alpha)
    out = (up + 1) * glu

Every torch op there rounds to the dtype; the kernel does the same ops on the widened values in
fp32 with one rounding after each (``r`` the cast to the dtype and back), element by element::

    g = r(min(gate, LIMIT)); u = r(clamp(up, -LIMIT, LIMIT))
    z = r(g * ALPHA); s = r(1 / (1 + exp(-z))); glu = r(g * s)
    y = r(r(u + 1) * glu)

``1 / (1 + exp(-z))`` is torch's ``sigmoid`` formula; the bits equal stock torch wherever the
``exp`` implementations agree (see :mod:`samepath.kernels.swiglu`). Both sides of an RL step (the
Hugging Face experts and vLLM's under the plugin) run this kernel, so a row is the same in any
batch. The formula is part of a GPT-OSS model's fingerprint (:func:`samepath.models.model_formulas`).

Backward (fp32, one cast per gradient; torch's clamp passes the gradient where the input is
inside the bounds, ends included), with ``s32 = 1 / (1 + exp(-z))`` unrounded::

    dgate = dy * r(u + 1) * (s32 + g * ALPHA * s32 * (1 - s32)) * (gate <= LIMIT)
    dup = dy * glu * (-LIMIT <= up <= LIMIT)
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from samepath.kernels.dispatch import jit
from samepath.kernels.swiglu import GATED_LAUNCHERS, gated_mul, launch_gated

CLAMPED_SWIGLU_FORMULA = {
    "layout": "gate = x[..., ::2], up = x[..., 1::2] (GPT-OSS's interleaved gate_up)",
    "forward": (
        "fp32 from the widened inputs, rounded to the dtype after each op: g = min(gate, limit), "
        "u = clamp(up, -limit, limit), z = g * alpha, s = 1 / (1 + exp(-z)), glu = g * s, y = (u + 1) * glu"
    ),
    "backward": "fp32, one cast per gradient; clamp passes the gradient inside the bounds, ends included",
}


@jit
def _clamped_swiglu_kernel(
    Gate,
    Up,
    dOut,
    Out,
    dUp,
    stride_g_row,
    stride_g_col,
    stride_u_row,
    stride_u_col,
    stride_do_row,
    stride_do_col,
    stride_o_row,
    stride_o_col,
    stride_du_row,
    stride_du_col,
    M,
    N,
    BLOCK_N: tl.constexpr,
    BACKWARD: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
):
    """Forward: ``Out = (clamp(up) + 1) * glu(min(gate, LIMIT))``. Backward: ``Out = dgate`` and
    ``dUp`` from ``dOut``. Work item: one BLOCK_N-column block of one row (as ``_silu_mul_kernel``)."""
    col_blocks = tl.cdiv(N, BLOCK_N)
    dtype = Out.dtype.element_ty
    for work in range(tl.program_id(0), M * col_blocks, tl.num_programs(0)):
        row = tl.cast(work // col_blocks, tl.int64)
        cols = (work % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = cols < N
        cols64 = cols.to(tl.int64)
        gate = tl.load(Gate + row * stride_g_row + cols64 * stride_g_col, mask=valid, other=0.0).to(tl.float32)
        up = tl.load(Up + row * stride_u_row + cols64 * stride_u_col, mask=valid, other=0.0).to(tl.float32)
        g = tl.minimum(gate, LIMIT).to(dtype).to(tl.float32)
        u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT).to(dtype).to(tl.float32)
        z = (g * ALPHA).to(dtype).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-z))
        s = sig.to(dtype).to(tl.float32)
        glu = (g * s).to(dtype).to(tl.float32)
        u1 = (u + 1.0).to(dtype).to(tl.float32)
        out_ptrs = Out + row * stride_o_row + cols64 * stride_o_col
        if BACKWARD:
            dy = tl.load(dOut + row * stride_do_row + cols64 * stride_do_col, mask=valid, other=0.0).to(tl.float32)
            dglu = sig + g * ALPHA * sig * (1.0 - sig)
            dgate = tl.where(gate <= LIMIT, dy * u1 * dglu, 0.0)
            dup = tl.where((up >= -LIMIT) & (up <= LIMIT), dy * glu, 0.0)
            tl.store(dUp + row * stride_du_row + cols64 * stride_du_col, dup.to(dUp.dtype.element_ty), mask=valid)
            tl.store(out_ptrs, dgate.to(dtype), mask=valid)
        else:
            tl.store(out_ptrs, (u1 * glu).to(dtype), mask=valid)


def _check_constants(limit: float, alpha: float) -> tuple[float, float]:
    for name, value in (("limit", limit), ("alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(limit), float(alpha)


@functools.cache
def _launcher(limit: float, alpha: float):
    def launch(gate2, up2, grad2, out, grad_up) -> None:
        launch_gated(_clamped_swiglu_kernel, gate2, up2, grad2, out, grad_up, LIMIT=limit, ALPHA=alpha)

    return launch


GATED_LAUNCHERS["clamped_swiglu"] = _launcher  # torch.compile: samepath::gated_mul


def clamped_swiglu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's ``(clamp(up) + 1) * glu(min(gate, limit))`` with Hugging Face's rounding points.

    Args:
        gate, up: ``[..., I]``, same shape, dtype (float32 / bfloat16 / float16) and device; any
            strides (the halves of an interleaved ``gate_up`` are views).
        limit: ``config.swiglu_limit``; alpha: ``config.swiglu_alpha`` (positive, finite).

    Returns:
        ``[..., I]`` in the input dtype; differentiable in both inputs.
    """
    limit, alpha = _check_constants(limit, alpha)
    launch = None if torch.compiler.is_compiling() else _launcher(limit, alpha)  # compiled: the op picks it
    return gated_mul(launch, gate, up, "clamped_swiglu", (limit, alpha))


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """:func:`clamped_swiglu_mul` on GPT-OSS's interleaved layout: ``gate_up[..., ::2]`` is the gate,
    ``gate_up[..., 1::2]`` up (``[..., 2 * I]`` -> ``[..., I]``)."""
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError("gate_up must be a tensor whose last dimension is even (interleaved gate and up)")
    return clamped_swiglu_mul(gate_up[..., ::2], gate_up[..., 1::2], limit, alpha)


__all__ = ["CLAMPED_SWIGLU_FORMULA", "clamped_swiglu", "clamped_swiglu_mul"]
