"""The ``vllm.general_plugins`` entry point: samepath in every vLLM process.

Declared in the package metadata::

    [project.entry-points."vllm.general_plugins"]
    samepath = "samepath.integrations.vllm_plugin:register"

vLLM calls :func:`register` in every process it starts (the front end, the engine core, each
worker) before any model is built. It does nothing unless ``SAMEPATH_VLLM=1``; then it installs
:mod:`samepath.integrations.vllm_ascend` on vllm-ascend's platform and
:mod:`samepath.integrations.vllm` everywhere else. vllm_ascend reuses the vLLM package's shared
pieces (:mod:`samepath.integrations.vllm.env`, ``common``, ``sampler``, the rotary and load-audit
functions); the vLLM package imports nothing of vllm_ascend. Neither imports vLLM at module level.
"""

from __future__ import annotations

import importlib.util

from samepath.integrations.vllm.env import ENV_VAR, FINGERPRINT_ENV_VAR, enabled_by_env


def vllm_ascend_platform() -> bool:
    """Whether vLLM runs on vllm-ascend's platform plugin."""
    if importlib.util.find_spec("vllm_ascend") is None:
        return False
    from vllm.platforms import current_platform

    return type(current_platform).__module__.startswith("vllm_ascend")


def register() -> None:
    """When ``SAMEPATH_VLLM=1``: :func:`samepath.integrations.vllm.install` — or, on vllm-ascend's
    platform, :func:`samepath.integrations.vllm_ascend.install`."""
    if not enabled_by_env():
        return
    if vllm_ascend_platform():
        from samepath.integrations import vllm_ascend

        vllm_ascend.install()
    else:
        from samepath.integrations import vllm

        vllm.install()


__all__ = ["ENV_VAR", "FINGERPRINT_ENV_VAR", "register", "vllm_ascend_platform"]
