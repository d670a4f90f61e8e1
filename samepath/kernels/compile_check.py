"""Compile the kernels that real launches used, for a device this machine does not have.

A CPU machine runs samepath's kernels under Triton's interpreter, which accepts some programs the
compilers reject. :func:`record_launches` captures the (kernel, arguments) of interpreted
launches; :func:`compile_launch` compiles the same specialization ahead of time for a target such
as Hopper (``GPUTarget("cuda", 90, 32)``, with the ``ptxas`` bundled in the Triton wheel), so
compiled-mode errors show up in CI without a GPU. :func:`lower_for_ascend` does the same with
Triton-Ascend up to its linalg MLIR (the last step needs CANN).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from samepath.kernels.dispatch import FP_FUSION, DualJITFunction

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}
_COMPILE_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

HOPPER = GPUTarget("cuda", 90, 32)
#: An Atlas A2 training chip, for Triton-Ascend (which replaces the ``triton`` package).
ASCEND_910B = GPUTarget("npu", "Ascend910B3", 0)
#: What Triton-Ascend says once the kernel is lowered to its linalg MLIR and only the CANN
#: toolchain (absent here) is left to turn it into a binary.
_NEEDS_CANN = "ASCEND_HOME_PATH is not set"


@dataclass
class Launch:
    kernel: DualJITFunction
    args: tuple
    kwargs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Record every launch of a samepath kernel in the block (the launches still run)."""
    launches: list[Launch] = []
    original = DualJITFunction.run

    def recording_run(self: DualJITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        launches.append(Launch(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    DualJITFunction.run = recording_run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        DualJITFunction.run = original  # type: ignore[method-assign]


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


def compile_launch(launch: Launch, target: GPUTarget = HOPPER) -> Any:
    """Compile ``launch``'s specialization for ``target``; raises on any compiler error."""
    kernel = launch.kernel
    bound = dict(zip(kernel.arg_names, launch.args, strict=False))
    bound.update({k: v for k, v in launch.kwargs.items() if k in kernel.arg_names})
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
        else:
            signature[param.name] = _scalar_type(value)
    options = {k: v for k, v in launch.kwargs.items() if k in _COMPILE_OPTIONS}
    options.setdefault("enable_fp_fusion", FP_FUSION)
    return triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)


def lower_for_ascend(launch: Launch, target: GPUTarget = ASCEND_910B) -> str:
    """Lower ``launch``'s specialization with Triton-Ascend as far as this machine allows.

    Returns ``"binary"`` when CANN is installed and the kernel compiled, ``"mlir"`` when it was
    lowered through TTIR to Triton-Ascend's linalg MLIR and stopped only for want of CANN
    (``ASCEND_HOME_PATH``). Any other failure — a real lowering error — is raised.
    """
    try:
        compile_launch(launch, target)
    except Exception as error:  # Triton-Ascend raises its own MLIRCompilationError
        if _NEEDS_CANN in str(error):
            return "mlir"
        raise
    return "binary"
