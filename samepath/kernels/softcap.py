"""Soft-capping, ``cap * tanh(x / cap)`` (Gemma 2): one ``tanh`` for the attention scores and the logits.

Gemma 2 caps its attention scores (``attn_logit_softcapping``) and its final logits
(``final_logit_softcapping``). samepath computes both with the one fp32 ``tanh`` here,
:func:`tanh_fp32`, in its sigmoid form (one ``exp``: Triton-Ascend and the interpreter have no
``tanh`` primitive)::

    tanh(u) = 2 / (1 + exp(-2 u)) - 1          # fp32; saturates to +-1, exp overflow gives -1 exactly

* The attention kernels (``attention/forward.py``, ``attention/backward.py``, ``SOFTCAP``) apply it to
  the fp32 ``dot(Q, K^T)`` before the mask: ``t = tanh(dot * fp32(scale / cap))``, the exp2-domain
  score ``t * fp32(cap * log2(e))``; the backward's score gradient is ``dS * (1 - t * t)`` before its
  cast (``dQ``, ``dK`` then scaled by ``scale`` as without capping) — every caller (training, prefill,
  decode, the merge of segments) sees the same scores.
* :func:`softcap_logits` caps a logits tensor elementwise: ``(cap * tanh(x.float() / cap)).to(dtype)``
  (``/`` an IEEE division, one rounding), what Hugging Face's ``Gemma2ForCausalLM`` and vLLM's
  ``LogitsProcessor(soft_cap=...)`` run under samepath, and what the fused lm_head
  (:func:`samepath.kernels.logprobs.linear_token_logprobs` with ``softcap``) applies to each chunk.
  Backward: ``dx = (dy.float() * (1 - t * t)).to(dtype)``.

Mathematically torch's ``tanh`` (close to the fp64 reference), not its bits: the same on the rollout
and the trainer because both call these kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import dtype_name
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.opaque import register

#: Elements of one program's block in :func:`softcap_logits`.
BLOCK = 1024

SOFTCAP_FORMULA = {
    "tanh": "fp32 2 / (1 + exp(-2 u)) - 1",
    "attention": "t = tanh(fp32 dot(Q, K^T) * fp32(scale / cap)); exp2-domain score t * fp32(cap * log2(e)), "
    "then the mask; backward dS * (1 - t * t) before the cast",
    "logits": "(fp32(cap) * tanh(IEEE x.float() / fp32(cap))).to(dtype); backward (dy.float() * (1 - t * t)).to(dtype)",
}


def check_softcap(softcap: float | None, name: str = "softcap") -> float | None:
    """``None`` or a positive finite float (``ValueError`` naming ``name`` otherwise)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"{name} must be None or a positive finite float, got {softcap!r}")
    return float(softcap)


@jit
def tanh_fp32(u):
    """``tanh(u)`` in fp32 as ``2 / (1 + exp(-2 u)) - 1`` (see the module docstring)."""
    return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0


@jit
def _softcap_kernel(X, dY, Y, n, cap, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Forward: ``Y = cap * tanh(X / cap)``; backward: ``Y = dY * (1 - tanh(X / cap) ** 2)``; contiguous
    1-D operands of ``n`` elements, one ``BLOCK`` per work item."""
    for work in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = tl.cast(work, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(X + offs, mask=valid, other=0.0).to(tl.float32)
        t = tanh_fp32(tl.math.div_rn(x, cap))
        if BACKWARD:
            dy = tl.load(dY + offs, mask=valid, other=0.0).to(tl.float32)
            tl.store(Y + offs, (dy * (1.0 - t * t)).to(Y.dtype.element_ty), mask=valid)
        else:
            tl.store(Y + offs, (cap * t).to(Y.dtype.element_ty), mask=valid)


def _launch(x: torch.Tensor, grad: torch.Tensor | None, out: torch.Tensor, cap: float) -> None:
    n = x.numel()
    if n == 0:
        return
    _softcap_kernel[(grid.num_programs(triton.cdiv(n, BLOCK), x.device),)](
        x, grad if grad is not None else x, out, n, cap, BLOCK=BLOCK, BACKWARD=grad is not None
    )


class SoftcapFunction(torch.autograd.Function):
    """Autograd of :func:`softcap_logits` (the backward recomputes ``t`` from the saved input)."""

    @staticmethod
    def forward(ctx, x, cap):  # type: ignore[override]
        out = torch.empty_like(x)
        _launch(x, None, out, cap)
        ctx.save_for_backward(x)
        ctx.cap = cap
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return softcap_backward(x, grad, ctx.cap), None


def softcap_backward(x: torch.Tensor, grad: torch.Tensor, cap: float) -> torch.Tensor:
    """``d softcap_logits(x, cap)`` for the output gradient ``grad`` (``x``'s shape, dtype and device)."""
    out = torch.empty_like(x)
    _launch(x, grad.contiguous().to(x.dtype), out, cap)
    return out


@torch.library.custom_op(register("softcap"), mutates_args=())
def _softcap_op(x: torch.Tensor, cap: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _launch(x, None, out, cap)
    return out


@_softcap_op.register_fake
def _(x, cap):
    return torch.empty_like(x)


@torch.library.custom_op(register("softcap_backward"), mutates_args=())
def _softcap_backward_op(x: torch.Tensor, grad: torch.Tensor, cap: float) -> torch.Tensor:
    return softcap_backward(x, grad, cap)


@_softcap_backward_op.register_fake
def _(x, grad, cap):
    return torch.empty_like(x)


def _softcap_setup(ctx, inputs, output):
    x, ctx.cap = inputs
    ctx.save_for_backward(x)


def _softcap_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.samepath.softcap_backward(x, grad, ctx.cap), None


_softcap_op.register_autograd(_softcap_grad, setup_context=_softcap_setup)


def softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` elementwise, in fp32 with one rounding to ``logits.dtype`` (the
    module docstring's formula); differentiable.

    Args:
        logits: any shape, float32 / bfloat16 / float16, on a device samepath runs on.
        cap: the cap, a positive finite float (Gemma 2's ``final_logit_softcapping``).
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    dtype_name(logits.dtype, "logits.dtype")
    device_kind(logits.device)
    cap = check_softcap(cap, "cap")
    if cap is None:
        raise ValueError("cap must be a positive finite float, got None")
    if torch.compiler.is_compiling():
        return torch.ops.samepath.softcap(logits.contiguous(), cap)
    return SoftcapFunction.apply(logits.contiguous(), cap)


__all__ = ["SOFTCAP_FORMULA", "SoftcapFunction", "check_softcap", "softcap_backward", "softcap_logits", "tanh_fp32"]
