"""samepath's kernels under ``torch.compile``: opaque calls Dynamo does not trace.

A kernel's launcher (Triton's ``JITFunction.run``, or on the CPU the numpy replay reading the
tensor's memory) cannot run on Dynamo's fake tensors. :func:`compile_opaque` wraps a public op so
that, while Dynamo traces, the call is made through :func:`torch.compiler.disable`: Dynamo ends
the graph before it, runs the op eagerly (the same autograd Function, the same kernel, the same
bits as an eager forward and backward) and resumes tracing after it. Everything between samepath's
ops (residual adds, the embedding, casts, reshapes) is compiled. In eager code the wrapper costs
one flag check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def _skip_as_frame(code) -> None:
    """Dynamo compiles no frame of this wrapper, nor any frame under it, when it is entered from
    code running eagerly under ``torch.compile`` (the call right after a graph break)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # older torch: Dynamo compiles the wrapper's frame (an empty graph), same bits
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def compile_opaque(fn: F) -> F:
    """``fn`` unchanged in eager code; under ``torch.compile`` called as an opaque (graph-breaking)
    eager call, so Dynamo never traces samepath's launchers."""
    if not callable(fn):
        raise ValueError(f"compile_opaque takes a callable, got {type(fn).__name__}")
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not disabled:  # Dynamo is imported whenever it traces
                disabled.append(torch.compiler.disable(fn, recursive=True))
                _skip_as_frame(call.__code__)
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    call.samepath_opaque = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


__all__ = ["compile_opaque"]
