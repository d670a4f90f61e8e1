"""SiLU(gate) * up with Hugging Face's rounding points, and its backward.

HF's ``LlamaMLP`` computes ``act_fn(gate_proj(x)) * up_proj(x)`` in the model dtype: ``F.silu``
widens the gate to fp32, computes ``g / (1 + exp(-g))`` and rounds to the dtype; the product with
``up`` is a dtype multiply (fp32 product of the widened values, one rounding). The kernel does the
same, element by element::

    a = (g / (1 + exp(-g))).to(dtype)                 # g = gate.float(), fp32
    y = (a.float() * up.float()).to(dtype)

``g / (1 + exp(-g))`` is the formula of torch's ``F.silu`` on CPU and CUDA (not ``g * sigmoid(g)``).
Bits equal stock torch wherever the ``exp`` implementations agree: ``tl.exp`` is numpy's ``exp``
under the interpreter and the device's ``exp`` when compiled, while torch uses its own vectorized
``exp``; the two differ in the last fp32 bit for some inputs, which reaches a bf16/fp16 result
only through a rounding boundary (rare). Each element depends only on its own inputs, so a row
is the same in any batch.

:func:`swiglu` takes vLLM's fused ``[..., 2 * I]`` layout (gate first, then up).

Backward (fp32, one cast per gradient): ``dup = dy * a``,
``dgate = dy * up * s * (1 + g * (1 - s))`` with ``s = 1 / (1 + exp(-g))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.checks import check_operands
from samepath.kernels.config import dtype_name, register_formula
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.opaque import refuse_compiled, register

#: Columns one program handles (elementwise: numerics-neutral).
MAX_BLOCK_N = 2048

SILU_MUL_FORMULA = {
    "silu": "fp32 g / (1 + exp(-g)) from the widened gate, rounded to the input dtype",
    "multiply": "fp32 product of the widened silu and up, rounded once to the input dtype",
    "fused_layout": "gate = x[..., :I], up = x[..., I:]",
    "fp_fusion": "disabled",
    "backward": "fp32, one cast per gradient",
}
register_formula("silu_mul", SILU_MUL_FORMULA)


@jit
def _silu_mul_kernel(
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
):
    """Forward: ``Out = silu(gate) * up``. Backward: ``Out = dgate`` and ``dUp`` from ``dOut``.

    Every operand is addressed through its row and column strides (no copies for views such as the
    halves of a fused gate/up tensor). Work item: one BLOCK_N-column block of one row, column
    blocks fastest."""
    col_blocks = tl.cdiv(N, BLOCK_N)
    for work in range(tl.program_id(0), M * col_blocks, tl.num_programs(0)):
        row = tl.cast(work // col_blocks, tl.int64)
        cols = (work % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = cols < N
        cols64 = cols.to(tl.int64)
        g = tl.load(Gate + row * stride_g_row + cols64 * stride_g_col, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(Up + row * stride_u_row + cols64 * stride_u_col, mask=valid, other=0.0).to(tl.float32)
        e = 1.0 + tl.exp(-g)
        a = (g / e).to(Out.dtype.element_ty).to(tl.float32)
        out_ptrs = Out + row * stride_o_row + cols64 * stride_o_col
        if BACKWARD:
            dy = tl.load(dOut + row * stride_do_row + cols64 * stride_do_col, mask=valid, other=0.0).to(tl.float32)
            sig = 1.0 / e
            dsilu = sig * (1.0 + g * (1.0 - sig))
            tl.store(dUp + row * stride_du_row + cols64 * stride_du_col, (dy * a).to(dUp.dtype.element_ty), mask=valid)
            tl.store(out_ptrs, (dy * u * dsilu).to(Out.dtype.element_ty), mask=valid)
        else:
            tl.store(out_ptrs, (a * u).to(Out.dtype.element_ty), mask=valid)


def launch_gated(kernel: Any, gate2, up2, grad2, out, grad_up, **constexprs: Any) -> None:
    """One launch of an elementwise ``act(gate) * up`` kernel with ``_silu_mul_kernel``'s
    signature over ``[M, N]`` operands (forward when ``grad2`` is ``None``); ``constexprs`` are the
    kernel's own constants (the GELU-tanh factors)."""
    M, N = gate2.shape
    if not (M and N):
        return
    block = min(MAX_BLOCK_N, triton.next_power_of_2(N))
    backward = grad2 is not None
    kernel[(grid.num_programs(M * triton.cdiv(N, block), gate2.device),)](
        gate2,
        up2,
        grad2 if backward else gate2,
        out,
        grad_up if backward else out,
        *gate2.stride(),
        *up2.stride(),
        *(grad2.stride() if backward else (0, 0)),
        *out.stride(),
        *(grad_up.stride() if backward else (0, 0)),
        M,
        N,
        BLOCK_N=block,
        BACKWARD=backward,
        **constexprs,
    )


def _launch(gate2, up2, grad2, out, grad_up) -> None:
    launch_gated(_silu_mul_kernel, gate2, up2, grad2, out, grad_up)


def silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, grad_gate: torch.Tensor, grad_up: torch.Tensor
) -> None:
    """:func:`silu_mul`'s backward into preallocated ``grad_gate`` / ``grad_up`` (``[M, I]``, any
    strides): the kernel :func:`silu_mul`'s backward runs."""
    _launch(gate, up, grad_out, grad_gate, grad_up)


class GatedMulFunction(torch.autograd.Function):
    """Autograd for ``act(gate) * up`` on ``[M, I]`` views (any strides); ``launch`` is the
    activation's launcher (:func:`launch_gated` on its kernel), forward and backward."""

    @staticmethod
    def forward(ctx, launch, gate2, up2):  # type: ignore[override]
        out = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        launch(gate2, up2, None, out, None)
        ctx.launch = launch
        ctx.save_for_backward(gate2, up2)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        gate2, up2 = ctx.saved_tensors
        dgate = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        dup = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        ctx.launch(gate2, up2, grad_out.reshape(gate2.shape), dgate, dup)
        return None, dgate, dup


def _check(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise ValueError(f"{name} must be a tensor with at least one dimension")
    dtype_name(tensor.dtype, f"{name}.dtype")
    device_kind(tensor.device)


#: ``torch.compile``: the launchers of :func:`gated_mul` by name (``samepath::gated_mul``'s ``kind``),
#: each a factory of the activation's constants: ``"silu"`` here, the others added by their modules.
GATED_LAUNCHERS: dict[str, Callable[..., Callable[..., None]]] = {"silu": lambda: _launch}


@torch.library.custom_op(register("gated_mul"), mutates_args=())
def _gated_mul_op(kind: str, gate2: torch.Tensor, up2: torch.Tensor, constants: list[float]) -> torch.Tensor:
    out = gate2.new_empty(gate2.shape)
    GATED_LAUNCHERS[kind](*constants)(gate2, up2, None, out, None)
    return out


@_gated_mul_op.register_fake
def _(kind, gate2, up2, constants):
    return gate2.new_empty(gate2.shape)


@torch.library.custom_op(register("gated_mul_backward"), mutates_args=())
def _gated_mul_backward_op(
    kind: str, gate2: torch.Tensor, up2: torch.Tensor, grad: torch.Tensor, constants: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = gate2.new_empty(gate2.shape), gate2.new_empty(gate2.shape)
    GATED_LAUNCHERS[kind](*constants)(gate2, up2, grad.reshape(gate2.shape), dgate, dup)
    return dgate, dup


@_gated_mul_backward_op.register_fake
def _(kind, gate2, up2, grad, constants):
    return gate2.new_empty(gate2.shape), gate2.new_empty(gate2.shape)


def _gated_mul_setup(ctx, inputs, output):
    ctx.kind, gate2, up2, ctx.constants = inputs
    ctx.save_for_backward(gate2, up2)


def _gated_mul_grad(ctx, grad):
    gate2, up2 = ctx.saved_tensors
    return None, *torch.ops.samepath.gated_mul_backward(ctx.kind, gate2, up2, grad, ctx.constants), None


_gated_mul_op.register_autograd(_gated_mul_grad, setup_context=_gated_mul_setup)


def gated_mul(
    launch: Callable[..., None], gate: torch.Tensor, up: torch.Tensor, kind: str = "", constants: tuple = ()
) -> torch.Tensor:
    """``act(gate) * up`` through ``launch`` after checking ``gate`` / ``up`` (same shape, dtype and
    device; ``ValueError`` naming the argument), differentiable in both. While Dynamo traces, the
    custom op ``samepath::gated_mul`` with ``GATED_LAUNCHERS[kind](*constants)`` (the same launcher)."""
    _check("gate", gate)
    if not isinstance(up, torch.Tensor):
        raise ValueError("up must be a tensor shaped like gate")
    if up.shape != gate.shape:
        raise ValueError(f"up shape {tuple(up.shape)} differs from gate's {tuple(gate.shape)}")
    check_operands(gate=gate, up=up)
    width = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, width), up.reshape(-1, width)
    if torch.compiler.is_compiling():
        if kind not in GATED_LAUNCHERS:
            refuse_compiled(f"gated_mul without a kind of {sorted(GATED_LAUNCHERS)} (got {kind!r}) under torch.compile")
        return torch.ops.samepath.gated_mul(kind, gate2, up2, [float(c) for c in constants]).reshape(gate.shape)
    return GatedMulFunction.apply(launch, gate2, up2).reshape(gate.shape)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused layout ``[..., 2 * I]`` (gate first, then up) as its two halves, checked."""
    _check("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up.shape[-1] = {gate_up.shape[-1]} must be even (gate and up halves)")
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` rounded as HF's ``act_fn(gate_proj(x)) * up_proj(x)``.

    Args:
        gate, up: ``[..., I]``, same shape, dtype (float32 / bfloat16 / float16) and device.

    Returns:
        ``[..., I]`` in the input dtype; differentiable in both inputs.
    """
    return gated_mul(_launch, gate, up, "silu")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` on vLLM's fused layout: ``gate_up[..., :I]`` is the gate, ``[..., I:]`` up.

    Args:
        gate_up: ``[..., 2 * I]``.

    Returns:
        ``[..., I]``, the same bits as ``silu_mul(gate_up[..., :I], gate_up[..., I:])``.
    """
    return silu_mul(*split_gate_up(gate_up))
