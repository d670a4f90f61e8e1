"""samepath's kernels under ``torch.compile``: ``torch.library`` custom ops, and what is refused.

Every op a patched model calls is a ``torch.library`` custom op in the ``samepath`` namespace, with a
fake (meta) implementation and, where it is differentiable, an autograd registration whose backward
is a custom op too (``torch.ops.samepath.*``; :data:`CUSTOM_OPS` lists them). While Dynamo traces,
the public function (``samepath.silu_mul``, ``samepath.varlen_attention``, ...) checks its
arguments and calls its op: Dynamo records one node, never traces a launcher or the CPU replay, and
Inductor calls the op as an extern kernel. The op's implementation is the eager function's (the
same launches, the same bits, forward and backward).

:func:`compile_opaque` wraps a function that has no custom op. While Dynamo traces, a function whose
work is host-side planning (``planning=True``: the attention batch layout, which reads the mask on
the host) runs as an opaque eager call through :func:`torch.compiler.disable` (a graph break, same
bits); any other is refused with :class:`CompiledOpError` naming it. In eager code the wrapper costs
one flag check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: The ``torch.library`` custom ops samepath registers (``samepath::<name>``); each module adds its own.
CUSTOM_OPS: list[str] = []


class CompiledOpError(NotImplementedError):
    """A samepath function without a ``torch.library`` custom op was reached while Dynamo traced:
    it is refused by name rather than traced (its launcher cannot run on fake tensors) or run with
    other bits."""


@torch.library.custom_op("samepath::refused", mutates_args=())
def _refused(anchor: torch.Tensor, message: str) -> torch.Tensor:
    raise CompiledOpError(message)


@_refused.register_fake
def _(anchor, message):
    raise CompiledOpError(message)


def refuse_compiled(message: str) -> NoReturn:
    """Refuses what is being traced by Dynamo with :class:`CompiledOpError` (``message``). Raised
    from the fake implementation of ``samepath::refused``, it stops the compile (a Python raise in
    traced code would only break the graph, and Dynamo would then run the call eagerly, tracing the
    frames under it)."""
    torch.ops.samepath.refused(torch.empty(0), message)
    raise CompiledOpError(message)  # not reached while Dynamo traces


def _skip_as_frame(code) -> None:
    """Dynamo compiles no frame of this wrapper, nor any frame under it, when it is entered from
    code running eagerly under ``torch.compile`` (the call right after a graph break)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # older torch: Dynamo compiles the wrapper's frame (an empty graph), same bits
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def compile_opaque(fn: F, *, planning: bool = False) -> F:
    """``fn`` unchanged in eager code. While Dynamo traces: with ``planning=True`` an opaque
    (graph-breaking) eager call, so Dynamo never traces its host reads; otherwise
    :class:`CompiledOpError` naming ``fn`` (it has no custom op)."""
    if not callable(fn):
        raise ValueError(f"compile_opaque takes a callable, got {type(fn).__name__}")
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not planning:
                refuse_compiled(
                    f"{name} is not a torch.library custom op, so samepath refuses it under torch.compile "
                    f"(its launcher cannot be traced); samepath's custom ops: {', '.join(sorted(CUSTOM_OPS))}"
                )
            if not disabled:  # Dynamo is imported whenever it traces
                disabled.append(torch.compiler.disable(fn, recursive=True))
                _skip_as_frame(call.__code__)
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    call.samepath_opaque = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


#: Public functions' routes under ``torch.compile`` registered by a module other than their own
#: (:func:`compiled_by`): name -> a function with the public one's signature that calls the op.
COMPILED_ROUTES: dict[str, Callable] = {}


def compiled_by(name: str) -> Callable[[F], F]:
    """Decorates a public function whose custom op lives in another module (which registers
    ``COMPILED_ROUTES[name]`` when imported; ``samepath.kernels`` imports it): while Dynamo
    traces, the call goes to that route, or is refused by name if none is registered."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                route = COMPILED_ROUTES.get(name)
                if route is None:
                    refuse_compiled(f"{name} has no torch.library custom op registered: refused under torch.compile")
                return route(*args, **kwargs)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


class ReplayContext:
    """Stands in for an autograd ``ctx`` when a custom op's implementation runs an
    ``autograd.Function``'s ``forward`` and then its ``backward`` (the backward op recomputes the
    forward's saved state with the same launches, so the same bits)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass


def autograd_inside():
    """A context in which torch's autograd records again inside a custom op's implementation (the
    dispatcher excludes the autograd keys below an op's autograd registration): a backward op that
    reruns the eager function's torch ops and ``torch.autograd.grad`` gets eager autograd's bits."""
    from torch._C import DispatchKey

    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor, DispatchKey.AutogradFunctionality):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def eager_vjp(fn: Callable, inputs: list, grads: list) -> list[torch.Tensor]:
    """The gradients of ``fn(*inputs)`` (a tensor or a tuple of tensors) for ``grads`` (``None`` for an
    output not differentiated) by eager autograd through ``fn``'s own ops, one per input (zeros for an
    input the outputs do not depend on; ``new_empty(0)`` for a ``None`` or non-float input). For a
    custom op's backward: the bits of the eager function's autograd."""
    with autograd_inside(), torch.enable_grad():
        leaves = [
            t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs
        ]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        found = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
    device = next(t.device for t in leaves if isinstance(t, torch.Tensor))
    result = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            grad = next(found)
            result.append(torch.zeros_like(t) if grad is None else grad.detach())
        else:
            result.append(torch.empty(0, device=device))
    return result


def register(name: str) -> str:
    """Records ``samepath::<name>`` in :data:`CUSTOM_OPS`; returns the qualified name."""
    qualified = f"samepath::{name}"
    if qualified not in CUSTOM_OPS:
        CUSTOM_OPS.append(qualified)
    return qualified


__all__ = [
    "COMPILED_ROUTES",
    "CUSTOM_OPS",
    "CompiledOpError",
    "ReplayContext",
    "autograd_inside",
    "compile_opaque",
    "compiled_by",
    "eager_vjp",
    "register",
]
