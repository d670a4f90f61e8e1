"""Timing: warm-up, device synchronization, medians, and input sets cycled between calls."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Bytes of input the rotation should cover so that no set stays resident in a cache between its
#: calls (several times an H200's 60 MB L2).
ROTATION_BYTES = 256 * 2**20


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


def rotation_count(set_bytes: int, device: torch.device, minimum: int = 2, maximum: int = 8) -> int:
    """How many input sets to cycle: enough to exceed :data:`ROTATION_BYTES` on a device."""
    if device.type == "cpu":
        return minimum
    return max(minimum, min(maximum, math.ceil(ROTATION_BYTES / max(set_bytes, 1))))


def median_ms(
    fn: Callable[[Any], object],
    input_sets: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> float:
    """Median wall time of ``fn(inputs)`` in milliseconds, cycling through ``input_sets``.

    Each timed call is bracketed by synchronization (CUDA events on CUDA), so the time is the
    call's own, launch overhead included, as an eager-mode caller sees it.
    """
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
    return statistics.median(times)
