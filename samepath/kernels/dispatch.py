"""One kernel source, three executors: compiled Triton for device tensors; on the CPU, a replay of
the kernel's schedule over whole tensors, or Triton's interpreter running the source itself.

``@jit`` replaces ``@triton.jit`` throughout samepath. The decorated function is a real
``JITFunction`` (so CUDA and Triton-Ascend compile it, and other ``@jit`` functions can call it from
kernel code). When a launch receives CPU tensors:

* ``"replay"`` (the default): the kernel's registered CPU replay (:mod:`samepath.kernels.replay`)
  runs instead — the same tiles, the same K / KV order, the same fp32 accumulation points and casts,
  computed with the same numpy operations the interpreter applies, for all programs at once. It is
  bit-identical to the interpreter (``tests/test_cpu_replay.py``) and one to three orders of
  magnitude faster. A kernel without a replay runs under the interpreter.
* ``"interpreter"``: Triton's interpreter runs the kernel source, one program at a time — the
  reference the replays are proven against, and what the kernel tests run.
* ``"verify"``: both; the interpreter on copies of the arguments, the replay on the arguments,
  then every tensor argument compared bit for bit (:class:`ReplayMismatch` on a difference).

``SAMEPATH_CPU_EXECUTOR`` sets the process default (child processes, e.g. vLLM's workers, inherit it);
:func:`cpu_executor` sets it for a block. Nothing has to be set by the user: the executor follows the
tensors' device.
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder
from triton.runtime.jit import JITFunction

#: torch device types the kernels run on, and how.
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "npu")
#: Compiled launches never contract a*b+c into an FMA unless a kernel asks: the bits must not
#: depend on a compiler default (which Triton 3.10 changes). The interpreter never fuses.
FP_FUSION = False


_interpreted_versions: dict[Any, InterpretedFunction] = {}
_interpreting_lock = threading.RLock()


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    interpreted = _interpreted_versions.get(self.fn)
    if interpreted is None:
        interpreted = _interpreted_versions[self.fn] = InterpretedFunction(self.fn)
    return interpreted(*args, **kwargs)


#: The namespaces Triton's interpreter patches while it runs (Triton-Ascend 3.2's never undoes it).
_LANGUAGE_NAMESPACES = (tl, tl.core, tl.math, tl.core.tensor)


def _snapshot_language() -> list[tuple[Any, dict[str, Any]]]:
    return [(namespace, dict(vars(namespace))) for namespace in _LANGUAGE_NAMESPACES]


def _restore_language(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
    """Undo whatever the interpreter patched, so compiled kernels later in the process still build."""
    for namespace, saved in snapshot:
        current = dict(vars(namespace))
        for name in current.keys() - saved.keys():
            delattr(namespace, name)
        for name, value in saved.items():
            if current.get(name) is not value:
                setattr(namespace, name, value)


def bf16_bits_to_fp32(bits: np.ndarray, order: str = "K") -> np.ndarray:
    """bf16 bit patterns widened exactly to fp32 (shifted into the high half), in numpy ``order``."""
    wide = bits.astype(np.uint32, order=order)
    wide <<= 16
    return wide.view(np.float32)


def fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as CUDA, Ascend and ``torch.Tensor.to(torch.bfloat16)`` do (NaN: ``0x7FC0``).

    ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` in uint32, computed in place."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


_original_create_dot = InterpreterBuilder.create_dot
_original_cast_impl = InterpreterBuilder.cast_impl


def _create_dot(
    self: InterpreterBuilder, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
) -> Any:
    # The interpreter keeps bfloat16 as raw uint16 bits and would multiply the bit patterns.
    # bf16 x bf16 products are exact in fp32, so widening first is what a tensor core computes.
    if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
        a_data = bf16_bits_to_fp32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data
        b_data = bf16_bits_to_fp32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data
        return type(d)(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)
    return _original_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def _cast_impl(self: InterpreterBuilder, src: Any, dst_type: Any) -> Any:
    # The interpreter truncates fp32 -> bf16; devices and torch round to nearest even.
    src_type, dst_scalar = src.dtype.scalar, dst_type.scalar
    if src_type == tl.float32 and dst_scalar == tl.bfloat16:
        return type(src)(fp32_to_bf16_bits(src.data), dst_scalar)
    if src_type == tl.bfloat16 and dst_scalar == tl.float32:
        return type(src)(bf16_bits_to_fp32(src.data), dst_scalar)
    return _original_cast_impl(self, src, dst_type)


@contextmanager
def _interpreting() -> Iterator[None]:
    """Make Triton's interpreter run samepath kernels as the devices do.

    * Interpreted kernels may call ``@triton.jit`` device functions, ours and
      ``triton.language``'s. The interpreter expects them to have been decorated while
      ``TRITON_INTERPRET=1``; here they are compiled-mode ``JITFunction`` objects, whose
      ``__call__`` (never used by compiled kernels, which inline callees) refuses to run. During an
      interpreted launch it runs the function's source under the interpreter instead.
    * Whatever the interpreter patches in ``triton.language`` is undone afterwards, so compiled
      kernels can still be built later in the same process.
    * bfloat16 ``tl.dot`` operands are widened to fp32 (exact) instead of multiplied as bits, and
      fp32 -> bfloat16 casts round to nearest even instead of truncating.
    * numpy's floating-point warnings are silenced: the interpreter computes masked-off lanes too
      (``-inf - -inf`` and the like), which a device computes silently and never stores.

    Kernels must still never do arithmetic directly on bf16 values (the interpreter computes on
    the bits): widen with ``.to(tl.float32)`` first, as samepath's kernels do.
    """
    with _interpreting_lock:
        patches = [
            (JITFunction, "__call__", _call_interpreted),
            (InterpreterBuilder, "create_dot", _create_dot),
            (InterpreterBuilder, "cast_impl", _cast_impl),
        ]
        originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        language = _snapshot_language()
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        try:
            with np.errstate(all="ignore"):
                yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
            _restore_language(language)


#: CPU executors, see the module docstring.
CPU_EXECUTORS = ("replay", "interpreter", "verify")
_CPU_EXECUTOR_ENV = "SAMEPATH_CPU_EXECUTOR"
_executor_override = threading.local()


def _checked_executor(name: str, source: str) -> str:
    if name not in CPU_EXECUTORS:
        raise ValueError(f"{source} must be one of {', '.join(CPU_EXECUTORS)}, got {name!r}")
    return name


def current_cpu_executor() -> str:
    """The executor CPU launches use now: the innermost :func:`cpu_executor`, else
    ``SAMEPATH_CPU_EXECUTOR``, else ``"replay"``."""
    stack = getattr(_executor_override, "stack", None)
    if stack:
        return stack[-1]
    return _checked_executor(os.environ.get(_CPU_EXECUTOR_ENV, "replay") or "replay", _CPU_EXECUTOR_ENV)


@contextmanager
def cpu_executor(name: str) -> Iterator[None]:
    """Run the CPU launches of this block (this thread) with executor ``name`` (see :data:`CPU_EXECUTORS`)."""
    _checked_executor(name, "cpu_executor's name")
    stack = getattr(_executor_override, "stack", None)
    if stack is None:
        stack = _executor_override.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


#: A replay takes the launch grid (a 3-tuple) and the kernel's arguments by parameter name
#: (tensors, scalars and constexprs, defaults applied), and performs the kernel's stores in place.
Replay = Callable[..., None]
_replays: dict[str, Replay] = {}
_replays_loaded = False


def kernel_key(fn: Any) -> str:
    """``"module.function"`` of a kernel's Python function: the name a replay registers under."""
    fn = getattr(fn, "fn", fn)
    return f"{fn.__module__}.{fn.__name__}"


def register_replay(kernel: str) -> Callable[[Replay], Replay]:
    """Decorator: register the CPU replay of ``kernel`` (``"samepath.kernels.matmul._matmul_kernel"``)."""

    def register(replay: Replay) -> Replay:
        if kernel in _replays:
            raise ValueError(f"a replay of {kernel} is registered twice")
        _replays[kernel] = replay
        return replay

    return register


def registered_replays() -> tuple[str, ...]:
    """The kernel keys that have a replay (the replay package loaded)."""
    replay_for("")
    return tuple(_replays)


def replay_for(kernel: Any) -> Replay | None:
    """The registered replay of a kernel (a ``JITFunction`` or its key), or ``None``."""
    global _replays_loaded
    if not _replays_loaded:
        importlib.import_module("samepath.kernels.replay")
        _replays_loaded = True
    return _replays.get(kernel if isinstance(kernel, str) else kernel_key(kernel))


_replay_state = threading.local()


@contextmanager
def _replaying() -> Iterator[None]:
    depth = getattr(_replay_state, "depth", 0)
    _replay_state.depth = depth + 1
    try:
        yield
    finally:
        _replay_state.depth = depth


def in_replay() -> bool:
    """Whether this thread is inside a CPU replay: the torch ops it runs there stand for one opaque
    kernel launch (a device launches the kernel without them), which op-counting tools skip."""
    return getattr(_replay_state, "depth", 0) > 0


class ReplayMismatch(AssertionError):
    """Raised by the ``"verify"`` executor when a replay's bits differ from the interpreter's."""


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


class DualJITFunction(JITFunction):
    """A ``JITFunction`` that, launched with CPU tensors, runs its replay or the interpreter."""

    def __init__(self, fn: Any, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self._interpreted = InterpretedFunction(fn, **kwargs)
        self._kernel_signature = inspect.signature(fn)

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if _first_tensor_device_type(args, kwargs) == "cpu":
            executor = current_cpu_executor()
            replay = None if executor == "interpreter" else replay_for(self)
            if replay is None:
                return self._interpret(args, grid, warmup, kwargs)
            if warmup:
                return None
            params = self._bind(args, kwargs)
            launch_grid = grid(params) if callable(grid) else grid
            launch_grid = tuple(launch_grid) + (1,) * (3 - len(launch_grid))
            if executor == "replay":
                with _replaying():
                    replay(launch_grid, **params)
                return None
            return self._verify(replay, launch_grid, params, args, grid, kwargs)
        kwargs.setdefault("enable_fp_fusion", FP_FUSION)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)

    def _interpret(self, args: tuple, grid: Any, warmup: bool, kwargs: dict) -> Any:
        with _interpreting():
            return self._interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self._kernel_signature.parameters
        bound = self._kernel_signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        return dict(bound.arguments)

    def _verify(self, replay: Replay, launch_grid: tuple, params: dict, args: tuple, grid: Any, kwargs: dict) -> None:
        """Interpreter on copies, replay on the arguments, every tensor argument compared bitwise.

        Tensors that share a storage (views of one buffer) share it in the copies too."""
        storages: dict[int, torch.UntypedStorage] = {}
        copies: dict[int, torch.Tensor] = {}

        def copy(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in copies:
                storage = value.untyped_storage()
                key = storage.data_ptr()
                if key not in storages:
                    storages[key] = storage.clone()
                twin = value.new_empty(0)
                twin.set_(storages[key], value.storage_offset(), value.size(), value.stride())
                copies[id(value)] = twin
            return copies[id(value)]

        self._interpret(tuple(copy(a) for a in args), grid, False, {k: copy(v) for k, v in kwargs.items()})
        with _replaying():
            replay(launch_grid, **params)
        for name, value in params.items():
            if isinstance(value, torch.Tensor) and not torch.equal(_as_bits(value), _as_bits(copies[id(value)])):
                raise ReplayMismatch(
                    f"the CPU replay of {kernel_key(self)} differs from the interpreter in argument {name!r}"
                )


def _first_tensor_device_type(args: tuple, kwargs: dict) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def jit(fn: Any) -> DualJITFunction:
    """Decorate a Triton kernel or device function (drop-in for ``triton.jit``)."""
    return DualJITFunction(fn)


def device_kind(device: torch.device | str) -> str:
    """The config-table key for a device: ``"cpu"`` (interpreter), ``"cuda"`` or ``"npu"``.

    Takes a ``torch.device`` or a device type string (``"npu"`` exists as a ``torch.device`` only
    once torch_npu is imported).
    """
    device_type = device if isinstance(device, str) else device.type
    if device_type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"samepath kernels run on {', '.join(SUPPORTED_DEVICE_TYPES)} tensors, got device {device}")
    return device_type
