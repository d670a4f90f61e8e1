"""The elementwise gates of the hybrid linear-attention families (Qwen3-Next, Qwen3.5): one definition
each, with Hugging Face's rounding points, shared by the trainer, ``generate`` and vLLM.

* :func:`sigmoid` — ``1 / (1 + exp(-x))`` in fp32. torch's CPU ``sigmoid`` rounds an element differently
  in its vectorised loop body and its scalar tail, so its bits depend on the tensor's length; ``exp``
  and IEEE division do not (see :mod:`samepath.kernels.moe_routing`).
* :func:`sigmoid_gate` — ``x * sigmoid(gate)`` as Hugging Face writes ``attn_output * torch.sigmoid(gate)``
  (the gated attention's output gate, the MoE shared expert's gate): the fp32 sigmoid of the widened
  gate rounded to the dtype, then a dtype multiply.
* :func:`gated_delta_gates` — ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32; softplus is ``x`` above
  20, else ``log1p(exp(x))``, torch's threshold) and ``beta = sigmoid(b)`` rounded to b's dtype (Hugging
  Face's ``b.sigmoid()``).
* :func:`gated_rms_norm` — ``Qwen3NextRMSNormGated``: :func:`samepath.rms_norm` (the normalised row rounded
  to the dtype, times the weight in the dtype), then times ``silu(gate)`` in fp32 (``g / (1 + exp(-g))``
  of the widened gate), one rounding.

Every element depends only on its own inputs (the norm only on its row), so a token's bits are the same
in any batch. Differentiable (torch autograd through the same ops; the norm through samepath's kernel).

Under ``torch.compile`` each is a ``torch.library`` custom op (``samepath::sigmoid_gate``,
``samepath::gated_delta_gates``, ``samepath::gated_rms_norm``, each with a ``*_backward`` op): the
implementation is the eager function and the backward op reruns it under torch's autograd
(:func:`samepath.kernels.opaque.eager_vjp`), so Inductor never re-fuses the ``exp`` / ``log1p`` chain
(its own ``exp`` would change bits) and forward and gradients are the eager bits.
"""

from __future__ import annotations

import torch

from samepath.kernels.config import register_formula
from samepath.kernels.opaque import eager_vjp, register
from samepath.kernels.rms_norm import rms_norm

#: torch's ``F.softplus`` threshold (beta 1): above it softplus is the identity.
SOFTPLUS_THRESHOLD = 20.0

GATED_OPS_FORMULA = {
    "sigmoid": "fp32 1 / (1 + exp(-x)) of the widened input",
    "sigmoid_gate": "x * sigmoid(gate).to(dtype), a dtype multiply (Hugging Face's x * torch.sigmoid(gate))",
    "gated_delta_gates": "g = -exp(A_log.float()) * softplus(a.float() + dt_bias.float()), softplus = x if x > 20 "
    "else log1p(exp(x)); beta = sigmoid(b).to(b.dtype)",
    "gated_rms_norm": "y = rms_norm(x, weight) (cast_then_weight); out = (y.float() * (g / (1 + exp(-g)))).to(dtype), "
    "g = gate.float()",
}
register_formula("gated_ops", GATED_OPS_FORMULA)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / (1 + exp(-x))`` of ``x`` widened to fp32."""
    x = x.float()
    return 1.0 / (1.0 + torch.exp(-x))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` rounded as Hugging Face's ``x * torch.sigmoid(gate)`` (gate broadcast to x). An
    expanded gate (``gate.expand_as(x)``, Hugging Face's shared expert) and a broadcast one give the same output
    but other gate gradients (the sum over the broadcast dimension comes after the sigmoid's backward, in the
    dtype, or before it); under ``torch.compile`` the expand's sum is the compiled graph's (Inductor's own
    reduction for fp32)."""
    if not isinstance(x, torch.Tensor) or not isinstance(gate, torch.Tensor):
        raise ValueError("x and gate must be tensors")
    if gate.dtype != x.dtype:
        raise ValueError(f"gate must have x's dtype {x.dtype}, got {gate.dtype}")
    if torch.broadcast_shapes(x.shape, gate.shape) != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must broadcast to x's shape {tuple(x.shape)}")
    if torch.compiler.is_compiling():
        return torch.ops.samepath.sigmoid_gate(x, gate)
    return _sigmoid_gate(x, gate)


def _sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(gate).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """fp32 softplus with torch's threshold: ``x`` where ``x > 20``, else ``log1p(exp(x))``."""
    x = x.float()
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD))))


def gated_delta_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token gates from the projections ``a``, ``b`` ``[..., HV]`` and the per-head
    ``A_log``, ``dt_bias`` ``[HV]``: ``(g fp32, beta in b's dtype)`` (the module docstring's formulas)."""
    for name, t in (("a", a), ("b", b), ("A_log", a_log), ("dt_bias", dt_bias)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor")
    heads = a.shape[-1]
    if b.shape != a.shape or tuple(a_log.shape) != (heads,) or tuple(dt_bias.shape) != (heads,):
        raise ValueError(
            f"a, b must be [..., HV] alike and A_log, dt_bias [HV]; got a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"A_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)}"
        )
    if torch.compiler.is_compiling():
        return tuple(torch.ops.samepath.gated_delta_gates(a, b, a_log, dt_bias))
    return _gated_delta_gates(a, b, a_log, dt_bias)


def _gated_delta_gates(a, b, a_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    g = -torch.exp(a_log.float()) * softplus(a.float() + dt_bias.float())
    return g, sigmoid(b).to(b.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3NextRMSNormGated``'s ``norm(x) * silu(gate)`` over the last dimension (see the module docstring)."""
    if not isinstance(gate, torch.Tensor) or not isinstance(x, torch.Tensor) or gate.shape != x.shape:
        raise ValueError(f"gate must be shaped like x {tuple(getattr(x, 'shape', ()))}")
    if torch.compiler.is_compiling():
        return torch.ops.samepath.gated_rms_norm(x, gate, weight, float(eps))
    return _gated_rms_norm(x, gate, weight, eps)


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = rms_norm(x, weight, eps)
    g = gate.float()
    return (y.float() * (g / (1.0 + torch.exp(-g)))).to(x.dtype)


# ``torch.compile``: the custom ops (implementation = the eager function; backward = eager autograd through it).
@torch.library.custom_op(register("sigmoid_gate"), mutates_args=())
def _sigmoid_gate_op(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _sigmoid_gate(x, gate).contiguous()


@_sigmoid_gate_op.register_fake
def _(x, gate):
    return x.new_empty(x.shape)


@torch.library.custom_op(register("sigmoid_gate_backward"), mutates_args=())
def _sigmoid_gate_backward_op(
    x: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dgate = eager_vjp(_sigmoid_gate, [x, gate], [grad])
    return dx.contiguous(), dgate.contiguous()


@_sigmoid_gate_backward_op.register_fake
def _(x, gate, grad):
    return x.new_empty(x.shape), gate.new_empty(gate.shape)


def _sigmoid_gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _sigmoid_gate_grad(ctx, grad):
    return tuple(torch.ops.samepath.sigmoid_gate_backward(*ctx.saved_tensors, grad))


_sigmoid_gate_op.register_autograd(_sigmoid_gate_grad, setup_context=_sigmoid_gate_setup)


@torch.library.custom_op(register("gated_delta_gates"), mutates_args=())
def _gates_op(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g, beta = _gated_delta_gates(a, b, a_log, dt_bias)
    return g.contiguous(), beta.contiguous()


@_gates_op.register_fake
def _(a, b, a_log, dt_bias):
    return a.new_empty(a.shape, dtype=torch.float32), b.new_empty(b.shape)


@torch.library.custom_op(register("gated_delta_gates_backward"), mutates_args=())
def _gates_backward_op(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, dg: torch.Tensor, dbeta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = eager_vjp(_gated_delta_gates, [a, b, a_log, dt_bias], [dg, dbeta])
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@_gates_backward_op.register_fake
def _(a, b, a_log, dt_bias, dg, dbeta):
    return tuple(t.new_empty(t.shape) for t in (a, b, a_log, dt_bias))


def _gates_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gates_grad(ctx, dg, dbeta):
    return tuple(torch.ops.samepath.gated_delta_gates_backward(*ctx.saved_tensors, dg, dbeta))


_gates_op.register_autograd(_gates_grad, setup_context=_gates_setup)


@torch.library.custom_op(register("gated_rms_norm"), mutates_args=())
def _gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _gated_rms_norm(x, gate, weight, eps).contiguous()


@_gated_rms_norm_op.register_fake
def _(x, gate, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(register("gated_rms_norm_backward"), mutates_args=())
def _gated_rms_norm_backward_op(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dgate, dweight = eager_vjp(lambda a, z, w: _gated_rms_norm(a, z, w, eps), [x, gate, weight], [grad])
    return dx.contiguous(), dgate.contiguous(), dweight.contiguous()


@_gated_rms_norm_backward_op.register_fake
def _(x, gate, weight, eps, grad):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _gated_rms_norm_setup(ctx, inputs, output):
    x, gate, weight, ctx.eps = inputs
    ctx.save_for_backward(x, gate, weight)


def _gated_rms_norm_grad(ctx, grad):
    return *torch.ops.samepath.gated_rms_norm_backward(*ctx.saved_tensors, ctx.eps, grad), None


_gated_rms_norm_op.register_autograd(_gated_rms_norm_grad, setup_context=_gated_rms_norm_setup)


__all__ = ["GATED_OPS_FORMULA", "gated_delta_gates", "gated_rms_norm", "sigmoid", "sigmoid_gate", "softplus"]
