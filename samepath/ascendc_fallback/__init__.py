"""The Ascend C FlashAttention forward: same schedule as samepath's Triton attention kernel.

Selected with ``SAMEPATH_ATTENTION_BACKEND=ascendc`` (default ``triton``); see :mod:`.loader`.
Sources and build: ``csrc/`` (CMake, needs CANN); tiling: :mod:`.tiling` and ``csrc/flash_attention_tiling.h``.
"""

from samepath.ascendc_fallback.loader import (
    BACKEND_ENV,
    BACKENDS,
    attention_backend,
    backend_fingerprint,
    flash_attention_fwd,
    launch_forward,
    load,
    missing_requirements,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "attention_backend",
    "backend_fingerprint",
    "flash_attention_fwd",
    "launch_forward",
    "load",
    "missing_requirements",
]
