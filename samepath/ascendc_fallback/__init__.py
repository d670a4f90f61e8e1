"""The Ascend C FlashAttention forward and backward: the schedules of samepath's Triton attention kernels.

Selected with ``SAMEPATH_ATTENTION_BACKEND=ascendc`` (default ``triton``); see :mod:`.loader`. Sources:
``csrc/`` (CMake, needs CANN), built once per machine with ``python -m samepath.ascendc_fallback build``;
tiling: :mod:`.tiling` and ``csrc/flash_attention_tiling.h``; the kernel's steps replayed in numpy:
:mod:`.simulate`.
"""

from samepath.ascendc_fallback.loader import (
    BACKEND_ENV,
    BACKENDS,
    BUILD_COMMAND,
    BuildKey,
    attention_backend,
    attention_backward,
    backend_fingerprint,
    build,
    check_backward_schedule,
    check_schedule,
    current_build_key,
    ensure_library,
    flash_attention_fwd,
    launch_forward,
    load,
    missing_requirements,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "BUILD_COMMAND",
    "BuildKey",
    "attention_backend",
    "attention_backward",
    "backend_fingerprint",
    "build",
    "check_backward_schedule",
    "check_schedule",
    "current_build_key",
    "ensure_library",
    "flash_attention_fwd",
    "launch_forward",
    "load",
    "missing_requirements",
]
