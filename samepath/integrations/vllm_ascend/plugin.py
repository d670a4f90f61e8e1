"""Install / uninstall the vllm-ascend integration: the version and API check, then every patch group."""

from __future__ import annotations

import logging
import os
import threading

from samepath.integrations.vllm.common import apply_patch_groups
from samepath.integrations.vllm.env import (
    FINGERPRINT_ENV_VAR,
    claim,
    pin_v1_model_runner,
    release,
)
from samepath.integrations.vllm_ascend import attention, determinism, layers, loader, sampler, state
from samepath.integrations.vllm_ascend.compat import check_compatibility, installed_version
from samepath.integrations.vllm_ascend.state import INSTALLED, ORIGINALS, installed
from samepath.kernels.config import assert_same_numerics, fingerprint, record_uncovered

logger = logging.getLogger("samepath.integrations.vllm_ascend")

_lock = threading.RLock()


def install() -> None:
    """Put vllm-ascend's model ops, attention and sampler log-probs on samepath (idempotent).

    Sets the Ascend determinism environment where it is unset and no communicator exists yet
    (:func:`samepath.integrations.vllm_ascend.determinism.ensure_environment`; restored by
    :func:`uninstall`).

    Raises:
        UnsupportedVllmAscendError: see :func:`check_compatibility`; nothing is patched then.
        DeterminismEnvError: ``HCCL_DETERMINISTIC`` / ``LCCL_DETERMINISTIC`` / ``VLLM_ASCEND_ENABLE_NZ``
            set otherwise, or unset after HCCL was initialised; nothing is patched then.
        RuntimeError: :mod:`samepath.integrations.vllm` is installed in this process (call one).
        samepath.NumericsMismatchError: ``SAMEPATH_EXPECT_FINGERPRINT`` differs from this process's.
    """
    with _lock:
        if installed():
            return
        check_compatibility(installed_version())
        expected = os.environ.get(FINGERPRINT_ENV_VAR)
        if expected:
            assert_same_numerics(expected)
        previous_env = determinism.ensure_environment()
        try:
            claim(
                "vllm_ascend",
                "on vllm-ascend install samepath.integrations.vllm_ascend instead (uninstall the other first)",
            )
        except BaseException:
            determinism.restore_environment(previous_env)
            raise
        try:
            stack = apply_patch_groups(PATCH_GROUPS, INSTALLED)
        except BaseException:
            ORIGINALS.clear()
            release("vllm_ascend")
            determinism.restore_environment(previous_env)
            raise
        stack.callback(determinism.restore_environment, previous_env)
        stack.callback(ORIGINALS.clear)
        stack.callback(release, "vllm_ascend")
        stack.callback(attention.step_inputs.clear)
        stack.callback(pin_v1_model_runner())
        stack.callback(record_uncovered, "vllm-ascend", ())
        state.set_installed(stack)
        logger.info(
            "samepath installed in vllm-ascend (pid %d): %s; fingerprint %s", os.getpid(), INSTALLED, fingerprint()
        )


def uninstall() -> None:
    """Restore every vllm-ascend / vLLM original and torch's own kernels (idempotent). Models
    built while installed keep what their construction captured (ND weights, bound forwards)."""
    with _lock:
        stack = state.set_installed(None)
        if stack is not None:
            stack.close()


PATCH_GROUPS = [
    ("attention", attention.patch_attention),
    ("rms_norm", layers.patch_rms_norm),
    ("rotary", layers.patch_rotary),
    ("silu_mul", layers.patch_silu_mul),
    ("linear", layers.patch_linear),
    ("moe", layers.patch_moe),
    ("sampler_logprobs", sampler.patch_sampler),
    (sampler.EDITS_GROUP, sampler.patch_sampling_edits),
    ("sampling_refusals", sampler.patch_sampling_refusals),
    ("reduce_sample_refusal", sampler.patch_reduce_sample_refusal),
    ("model_audit", loader.patch_ascend_model_loader),
    ("nz_config", determinism.patch_nz_config),
]

__all__ = [
    "INSTALLED",
    "PATCH_GROUPS",
    "install",
    "installed",
    "uninstall",
]
