"""GELU-tanh(gate) * up with Hugging Face's rounding points, and its backward (Gemma's MLP).

Hugging Face's ``Gemma3MLP`` computes ``act_fn(gate_proj(x)) * up_proj(x)`` with
``hidden_activation="gelu_pytorch_tanh"`` (``F.gelu(approximate="tanh")``) in the model dtype: the
activation widens the gate to fp32, computes the tanh approximation and rounds to the dtype; the
product with ``up`` is a dtype multiply (fp32 product of the widened values, one rounding). vLLM's
``GeluAndMul(approximate="tanh")`` takes the fused ``[..., 2 * I]`` layout (gate first, then up).
Both sides run this kernel, element by element::

    z = K * (g + KAPPA * (g * g * g))                 # g = gate.float(), fp32; K = 2 * sqrt(2 / pi)
    a = (g / (1 + exp(-z))).to(dtype)                 # = 0.5 * g * (1 + tanh(z / 2))
    y = (a.float() * up.float()).to(dtype)

``g / (1 + exp(-z))`` is the tanh formula rewritten through ``0.5 * (1 + tanh(u)) =
1 / (1 + exp(-2u))``: one ``exp``, no ``tanh`` (which Triton-Ascend and the interpreter lack as a
primitive), saturating to ``g`` and ``-0`` for large ``|g|``. It is mathematically torch's formula
but not its bits (torch evaluates ``tanh``): close to the fp64 reference, and the same on the
rollout and the trainer because both call this kernel. Each element depends only on its own
inputs, so a row is the same in any batch.

Backward (fp32, one cast per gradient), with ``s = 1 / (1 + exp(-z))``: ``dup = dy * a``,
``dgate = dy * up * (s + g * s * (1 - s) * K * (1 + 3 * KAPPA * g * g))``.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from samepath.kernels.config import register_formula
from samepath.kernels.dispatch import jit
from samepath.kernels.swiglu import GATED_LAUNCHERS, gated_mul, launch_gated, split_gate_up

#: ``2 * sqrt(2 / pi)`` rounded to fp32: the factor of ``z`` (the sigmoid form of the tanh GELU).
GELU_TANH_K = float(torch.tensor(2.0 * math.sqrt(2.0 / math.pi), dtype=torch.float32))
#: The cubic coefficient of the tanh approximation (as an fp32 constant in the kernel).
GELU_TANH_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))

GELU_TANH_MUL_FORMULA = {
    "gelu_tanh": (
        f"fp32 z = {GELU_TANH_K!r} * (g + {GELU_TANH_KAPPA!r} * (g * g * g)); g / (1 + exp(-z)) from the widened "
        "gate, rounded to the input dtype"
    ),
    "multiply": "fp32 product of the widened activation and up, rounded once to the input dtype",
    "fused_layout": "gate = x[..., :I], up = x[..., I:]",
    "fp_fusion": "disabled",
    "backward": "fp32, one cast per gradient",
}
register_formula("gelu_tanh_mul", GELU_TANH_MUL_FORMULA)


@jit
def _gelu_tanh_mul_kernel(
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
    K: tl.constexpr,
    KAPPA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Forward: ``Out = gelu_tanh(gate) * up``. Backward: ``Out = dgate`` and ``dUp`` from ``dOut``.

    Every operand is addressed through its row and column strides (the halves of a fused gate/up
    tensor are read in place). Work item: one BLOCK_N-column block of one row, column blocks fastest."""
    col_blocks = tl.cdiv(N, BLOCK_N)
    for work in range(tl.program_id(0), M * col_blocks, tl.num_programs(0)):
        row = tl.cast(work // col_blocks, tl.int64)
        cols = (work % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = cols < N
        cols64 = cols.to(tl.int64)
        g = tl.load(Gate + row * stride_g_row + cols64 * stride_g_col, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(Up + row * stride_u_row + cols64 * stride_u_col, mask=valid, other=0.0).to(tl.float32)
        z = K * (g + KAPPA * (g * g * g))
        e = 1.0 + tl.exp(-z)
        a = (g / e).to(Out.dtype.element_ty).to(tl.float32)
        out_ptrs = Out + row * stride_o_row + cols64 * stride_o_col
        if BACKWARD:
            dy = tl.load(dOut + row * stride_do_row + cols64 * stride_do_col, mask=valid, other=0.0).to(tl.float32)
            s = 1.0 / e
            dgelu = s + g * s * (1.0 - s) * (K * (1.0 + 3.0 * KAPPA * (g * g)))
            tl.store(dUp + row * stride_du_row + cols64 * stride_du_col, (dy * a).to(dUp.dtype.element_ty), mask=valid)
            tl.store(out_ptrs, (dy * u * dgelu).to(Out.dtype.element_ty), mask=valid)
        else:
            tl.store(out_ptrs, (a * u).to(Out.dtype.element_ty), mask=valid)


def _launch(gate2, up2, grad2, out, grad_up) -> None:
    launch_gated(_gelu_tanh_mul_kernel, gate2, up2, grad2, out, grad_up, K=GELU_TANH_K, KAPPA=GELU_TANH_KAPPA)


GATED_LAUNCHERS["gelu_tanh"] = lambda: _launch  # torch.compile: samepath::gated_mul


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` rounded as HF's ``act_fn(gate_proj(x)) * up_proj(x)`` with
    ``gelu_pytorch_tanh`` (the formula in the module docstring).

    Args:
        gate, up: ``[..., I]``, same shape, dtype (float32 / bfloat16 / float16) and device.

    Returns:
        ``[..., I]`` in the input dtype; differentiable in both inputs.
    """
    return gated_mul(_launch, gate, up, "gelu_tanh")


def geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_tanh_mul` on vLLM's fused layout (``GeluAndMul(approximate="tanh")``):
    ``gate_up[..., :I]`` is the gate, ``[..., I:]`` up.

    Args:
        gate_up: ``[..., 2 * I]``.

    Returns:
        ``[..., I]``, the same bits as ``gelu_tanh_mul(gate_up[..., :I], gate_up[..., I:])``.
    """
    return gelu_tanh_mul(*split_gate_up(gate_up))
