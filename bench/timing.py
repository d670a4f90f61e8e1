"""Timing: warm-up, device synchronization, min / median / max of several timed calls, and input
sets rotated through more bytes than the last-level cache holds."""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: On a device, the rotation covers at least twice the L2 and at least this many bytes ...
DEVICE_ROTATION_MIN_BYTES = 64 * 2**20
#: ... and at most this many (an H200's L2 is 60 MB: the target there is 2 x 60 MB).
DEVICE_ROTATION_MAX_BYTES = 256 * 2**20
#: Most input sets cycled on a device (tiny cases then cover less than the target; the row says so).
DEVICE_MAX_SETS = 64
#: Most input sets cycled on the CPU (the interpreter is slow: building sets must stay cheap).
CPU_MAX_SETS = 4
#: L2 assumed when the device does not report one.
FALLBACK_L2_BYTES = 2 * 2**20


@dataclass(frozen=True)
class Timing:
    """Wall times of ``n`` timed calls of one implementation, in milliseconds."""

    min_ms: float
    median_ms: float
    max_ms: float
    n: int

    @classmethod
    def failed(cls) -> Timing:
        nan = float("nan")
        return cls(nan, nan, nan, 0)


@dataclass(frozen=True)
class Rotation:
    """How many input sets a case cycles through, and the bytes they cover against the target."""

    sets: int
    set_bytes: int
    target_bytes: int
    l2_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.sets * self.set_bytes

    @property
    def covered(self) -> bool:
        return self.total_bytes >= self.target_bytes

    def label(self) -> str:
        mib = 2**20
        text = f"{self.sets} sets x {self.set_bytes / mib:.3g} MiB = {self.total_bytes / mib:.3g} MiB"
        return text + ("" if self.covered else f" (< target {self.target_bytes / mib:.3g} MiB)")


def device_for(name: str) -> torch.device:
    """``torch.device(name)``, importing torch_npu first for an Ascend device (``npu`` exists as a
    device type only once torch_npu is imported)."""
    if name.split(":")[0] == "npu":
        import torch_npu  # noqa: F401  # pragma: no cover - needs an Ascend machine
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize(device)


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors in ``obj`` (a tensor, or a dict / list / tuple of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _cpu_l2_bytes() -> int:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            return int(digits) * scale
    return FALLBACK_L2_BYTES


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (CUDA reports it; the CPU's comes from sysfs)."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or FALLBACK_L2_BYTES
    if device.type == "cpu":
        return _cpu_l2_bytes()
    return FALLBACK_L2_BYTES


def rotation_target_bytes(device: torch.device, l2: int | None = None) -> int:
    """Bytes the rotation should cover: twice the L2, clamped to 64-256 MiB on a device."""
    l2 = l2_bytes(device) if l2 is None else l2
    if device.type == "cpu":
        return 2 * l2
    return min(DEVICE_ROTATION_MAX_BYTES, max(DEVICE_ROTATION_MIN_BYTES, 2 * l2))


def rotation_for(set_bytes: int, device: torch.device, l2: int | None = None) -> Rotation:
    """How many sets of ``set_bytes`` to cycle so that each timed call finds its inputs evicted.

    Each set is used once every ``sets`` calls; with ``sets * set_bytes`` over twice the L2 no set
    is still cached when it comes round again. At least 2 sets, at most :data:`DEVICE_MAX_SETS`
    (:data:`CPU_MAX_SETS` on the CPU).
    """
    l2 = l2_bytes(device) if l2 is None else l2
    target = rotation_target_bytes(device, l2)
    cap = CPU_MAX_SETS if device.type == "cpu" else DEVICE_MAX_SETS
    sets = max(2, min(cap, math.ceil(target / max(set_bytes, 1))))
    return Rotation(sets=sets, set_bytes=set_bytes, target_bytes=target, l2_bytes=l2)


def rotation_count(set_bytes: int, device: torch.device) -> int:
    """Number of input sets to cycle (see :func:`rotation_for`)."""
    return rotation_for(set_bytes, device).sets


def measure(
    fn: Callable[[Any], object],
    input_sets: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> Timing:
    """Min / median / max wall time of ``repeats`` calls of ``fn(inputs)`` after ``warmup`` calls,
    cycling through ``input_sets`` (the warm-up calls cycle too, so compilation and first-touch
    costs are paid before timing).

    Each timed call is bracketed by synchronization (CUDA events on CUDA), so a time is the call's
    own, launch and host overhead included, as an eager-mode caller sees it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    n = len(input_sets)
    for i in range(warmup):
        fn(input_sets[i % n])
    synchronize(device)
    times = []
    for i in range(repeats):
        inputs = input_sets[(warmup + i) % n]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            synchronize(device)
            t0 = time.perf_counter()
            fn(inputs)
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(min(times), statistics.median(times), max(times), len(times))


def median_ms(
    fn: Callable[[Any], object],
    input_sets: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> float:
    """The median of :func:`measure`."""
    return measure(fn, input_sets, device, warmup, repeats).median_ms


class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of the tensors that ops allocate while it is active, and their peak.

    Every op output that is not a view owns its storage (a view keeps its base alive through
    ``_base``), so the bytes are added when such a tensor appears and removed when it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for tensor in torch.utils._pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor._base is not None:
                continue
            key = id(tensor)
            if key in self._seen or key in inputs:  # in-place and out= ops return an input
                continue
            size = tensor.untyped_storage().nbytes()
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, key, size)
        return out


def peak_allocated_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors allocated during ``fn()`` above what was allocated before it (the
    result's tensors included while they are alive): ``torch.cuda.max_memory_allocated`` on CUDA,
    dispatch-level accounting of the tensors ops create elsewhere (the CPU: torch's allocations
    only, not the interpreter's numpy scratch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        del result
        return torch.cuda.max_memory_allocated(device) - base
    with _LiveTensors() as mode:
        result = fn()
        del result
    return mode.peak


def measure_peak_memory(
    fn: Callable[[Any], object],
    input_sets: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> Timing:
    """Min / median / max over ``repeats`` calls of :func:`peak_allocated_bytes`, in MiB (carried
    in :class:`Timing`'s fields: rows measured this way say so in their ``measures`` column).
    The warm-up calls run on a device only (first-call workspaces, e.g. cuBLAS's, are not the
    op's); the CPU has none to pay."""
    n = len(input_sets)
    if device.type == "cpu":
        warmup = 0
    for i in range(warmup):
        fn(input_sets[i % n])
    peaks = sorted(
        peak_allocated_bytes(lambda inputs=input_sets[(warmup + i) % n]: fn(inputs), device) / 2**20
        for i in range(max(repeats, 1))
    )
    return Timing(peaks[0], statistics.median(peaks), peaks[-1], len(peaks))
