"""The Ascend C FlashAttention backend's public names at their first import path.

The backend lives in :mod:`samepath.kernels.attention.ascendc`; this package keeps
``python -m samepath.ascendc_fallback build`` (README, ``bench/npu_check.sh``) and these names working.
"""

from samepath.kernels.attention.ascendc.build import (
    BUILD_COMMAND,
    BuildKey,
    build,
    check_backward_schedule,
    check_schedule,
    current_build_key,
    ensure_library,
    load,
    missing_requirements,
)
from samepath.kernels.attention.ascendc.build import fingerprint as ascendc_fingerprint
from samepath.kernels.attention.ascendc.launch import attention_backward, flash_attention_fwd, launch_forward
from samepath.kernels.attention.backend import (
    BACKEND_ENV,
    attention_backend,
    backend_fingerprint,
    registered_backends,
)

#: The attention backends ``SAMEPATH_ATTENTION_BACKEND`` may name.
BACKENDS = registered_backends()

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "BUILD_COMMAND",
    "BuildKey",
    "ascendc_fingerprint",
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
