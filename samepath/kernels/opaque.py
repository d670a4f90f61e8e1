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
    "compile_opaque",
    "compiled_by",
    "register",
]
