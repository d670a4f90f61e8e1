"""How many programs a samepath kernel is launched with: the one adapter between work and hardware.

Every samepath kernel is *persistent*: it numbers its work items (a query block of one head, a row,
an output tile, ...) ``0 .. num_work - 1`` and program ``p`` of a grid of ``P`` programs computes
items ``p, p + P, p + 2P, ...``, each one whole and in the same order of operations as any other
program would. The bits of a result therefore do not depend on ``P``, and the launcher may pick
any ``1 <= P <= num_work``:

* CPU (Triton's interpreter) and CUDA: ``P = num_work``, one item per program; a launcher that
  asks for a ``persistent`` grid gets ``P = min(num_work, SMs)`` on CUDA (the matmul).
* Ascend NPU (Triton-Ascend): ``P = min(num_work, cores, 65535)``. Triton-Ascend refuses grids of
  more than 65535 programs and schedules extra programs in waves, so the grid is bound to the
  physical cores: ``num_aicore`` for kernels that use ``tl.dot`` (cube units), ``num_vectorcore``
  for the others, as Triton-Ascend's driver reports them
  (``triton.runtime.driver.active.utils.get_device_properties(index)``), cached per device.

Kernels use the loop ``for work in range(tl.program_id(0), num_work, tl.num_programs(0))`` over
one flattened axis; with ``P = num_work`` its trip count is 1. The attention backward, whose items
wait on earlier items, takes item numbers from an atomic ticket counter instead (in ascending
order, so any ``P`` finishes); its bits do not depend on ``P`` either.
"""

from __future__ import annotations

import functools

import torch
import triton

from samepath.kernels.dispatch import device_kind

#: The most programs Triton-Ascend launches in one grid (``grid[0] * grid[1] * grid[2]``).
MAX_PROGRAMS = 65535


def _check_work_items(work_items: int) -> None:
    if isinstance(work_items, bool) or not isinstance(work_items, int) or work_items < 0:
        raise ValueError(f"work_items must be a non-negative int, got {work_items!r}")


def cap_programs(work_items: int, cores: int) -> int:
    """``min(work_items, cores, MAX_PROGRAMS)``: the grid of a persistent kernel on ``cores`` cores.

    Raises ``ValueError`` for a negative ``work_items`` or a ``cores`` below 1.
    """
    _check_work_items(work_items)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    return min(work_items, cores, MAX_PROGRAMS)


@functools.cache
def _npu_core_counts(index: int | None) -> tuple[int, int]:
    """``(num_aicore, num_vectorcore)`` of NPU ``index`` (``None``: the current one), from Triton-Ascend."""
    driver = triton.runtime.driver.active
    if index is None:
        index = driver.get_current_device()
    properties = driver.utils.get_device_properties(index)
    return int(properties["num_aicore"]), int(properties["num_vectorcore"])


def core_count(device: torch.device | str, *, uses_dot: bool) -> int:
    """Physical cores of an NPU a kernel is spread over: AI (cube) cores for kernels with
    ``tl.dot``, vector cores otherwise. Only meaningful for ``npu`` devices."""
    if isinstance(device, str):  # "npu" is a torch.device type only once torch_npu is imported
        _, _, index = device.partition(":")
        aicore, vectorcore = _npu_core_counts(int(index) if index else None)
    else:
        aicore, vectorcore = _npu_core_counts(device.index)
    return aicore if uses_dot else vectorcore


#: Streaming multiprocessors assumed for CUDA devices that cannot be queried (no GPU in this
#: process, e.g. an ahead-of-time compile report): an H100 / H200 SXM.
DEFAULT_CUDA_SMS = 132
#: Programs the CPU interpreter is taken to run at once: it runs them one after the other, so
#: this only decides which of two bit-identical forms a launcher picks (see matmul.uses_partials).
CPU_CONCURRENT_PROGRAMS = 16


@functools.cache
def cuda_sm_count(index: int | None) -> int:
    if not torch.cuda.is_available():
        return DEFAULT_CUDA_SMS
    properties = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return properties.multi_processor_count


#: The compute capability assumed for CUDA devices that cannot be queried (an H100 / H200).
DEFAULT_CUDA_CAPABILITY = (9, 0)


@functools.cache
def cuda_capability(index: int | None) -> tuple[int, int]:
    if not torch.cuda.is_available():
        return DEFAULT_CUDA_CAPABILITY
    return torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)


def supports_tma(device: torch.device | str) -> bool:
    """Whether ``device`` has a tensor memory accelerator (CUDA, compute capability 9 or more)."""
    if isinstance(device, str):
        device_type, _, index_text = device.partition(":")
        index = int(index_text) if index_text else None
    else:
        device_type, index = device.type, device.index
    return device_kind(device_type) == "cuda" and cuda_capability(index) >= (9, 0)


def concurrent_programs(device: torch.device | str, *, uses_dot: bool = False) -> int:
    """How many programs ``device`` runs at once: SMs on CUDA, the AI or vector cores on an NPU,
    :data:`CPU_CONCURRENT_PROGRAMS` on the CPU. Launchers use it to pick between numerics-neutral
    forms of a kernel, never to change a result."""
    if isinstance(device, str):
        device_type, _, index_text = device.partition(":")
        index = int(index_text) if index_text else None
    else:
        device_type, index = device.type, device.index
    kind = device_kind(device_type)
    if kind == "cuda":
        return cuda_sm_count(index)
    if kind == "npu":
        return core_count(device, uses_dot=uses_dot)
    return CPU_CONCURRENT_PROGRAMS


def num_programs(
    work_items: int, device: torch.device | str, *, uses_dot: bool = False, persistent: bool = False
) -> int:
    """Programs to launch for ``work_items`` items of a persistent samepath kernel on ``device``.

    ``work_items`` on CPU and CUDA, except ``min(work_items, SMs)`` on CUDA when ``persistent``;
    ``min(work_items, core_count(device), 65535)`` on an NPU (``uses_dot`` picks the AI-core count,
    else the vector-core count). Results never depend on the answer: every item is computed by
    exactly one program, the same way.
    """
    kind = device_kind(device.partition(":")[0] if isinstance(device, str) else device)
    if kind == "cuda" and persistent:
        _check_work_items(work_items)
        return min(work_items, concurrent_programs(device, uses_dot=uses_dot))
    if kind != "npu":
        _check_work_items(work_items)
        return work_items
    return cap_programs(work_items, core_count(device, uses_dot=uses_dot))
