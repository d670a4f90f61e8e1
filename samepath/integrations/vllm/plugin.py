"""Install / uninstall the vLLM plugin: every patch group, applied once per process and reversible.

See :mod:`samepath.integrations.vllm` for what each group replaces; the entry point
(:func:`samepath.integrations.vllm_plugin.register`) calls :func:`install` when ``SAMEPATH_VLLM=1``.
"""

from __future__ import annotations

import logging
import os
import threading

from samepath.integrations.vllm import attention, gdn, layers, loader, mla, sampler, state
from samepath.integrations.vllm.common import apply_patch_groups
from samepath.integrations.vllm.env import (
    FINGERPRINT_ENV_VAR,
    check_engine_batch_invariant_mode,
    check_v1_model_runner_env,
    claim,
    pin_v1_model_runner,
    release,
)
from samepath.integrations.vllm.state import INSTALLED, MAX_TENSOR_PARALLEL_SIZE, installed
from samepath.kernels.config import assert_same_numerics, fingerprint, record_uncovered, tensor_parallel_size_of
from samepath.models.registry import families

logger = logging.getLogger("samepath.integrations.vllm")

_lock = threading.RLock()


def install() -> None:
    """Put vLLM's model ops, attention backends and sampler log-probs on samepath (idempotent).

    Must run before the model is built (vLLM binds CustomOp forwards and repacks linear weights
    at construction / load time); the entry point guarantees that in every process.

    Raises:
        EngineBatchInvariantModeError: ``VLLM_BATCH_INVARIANT`` is on (see
            :func:`~samepath.integrations.vllm.env.check_engine_batch_invariant_mode`); nothing
            is patched then.
        ModelRunnerError: ``VLLM_USE_V2_MODEL_RUNNER`` asks for the V2 model runner, whose sampler
            samepath does not patch; nothing is patched then. Unset, it is set to ``0`` for this
            process and the engine's children (:func:`~samepath.integrations.vllm.env.pin_v1_model_runner`),
            and removed again by :func:`uninstall`.
        samepath.NumericsMismatchError: ``SAMEPATH_EXPECT_FINGERPRINT`` is another samepath's.
    """
    with _lock:
        if installed():
            return
        check_engine_batch_invariant_mode("vLLM")
        check_v1_model_runner_env("vLLM")
        expected = os.environ.get(FINGERPRINT_ENV_VAR) or None
        if expected and tensor_parallel_size_of(expected, MAX_TENSOR_PARALLEL_SIZE) is None:
            assert_same_numerics(expected)  # another samepath version or table: refused now
        claim("vllm", "install one vLLM integration only")
        try:
            stack = apply_patch_groups(patch_groups(), INSTALLED)
        except BaseException:
            release("vllm")
            raise
        stack.callback(release, "vllm")
        stack.callback(attention.step_plans.clear)
        stack.callback(pin_v1_model_runner())
        state.set_installed(stack, expected)
        logger.info("samepath installed in vLLM (pid %d): %s; fingerprint %s", os.getpid(), INSTALLED, fingerprint())


def uninstall() -> None:
    """Restore every vLLM original and torch's own kernels. Models built while installed keep
    the state their construction captured (e.g. unpacked linear weights)."""
    with _lock:
        stack = state.set_installed(None)
        if stack is not None:
            stack.close()
            record_uncovered("vllm", ())


#: The patch groups every model needs, in order; the family groups go after the attention's.
CORE_GROUPS = [
    ("cpu_attention", attention.patch_cpu_attention),
    ("triton_attention", attention.patch_triton_attention),
    ("flash_attention", attention.patch_flash_attention),
    ("mla", mla.patch_mla),
    ("rotary", layers.patch_rotary),
    ("linear", layers.patch_linear),
    ("row_parallel", layers.patch_row_parallel),
    ("moe", layers.patch_moe),
    ("gated_delta_net", gdn.patch_gated_delta_net),
    ("sampler_logprobs", sampler.patch_sampler),
    ("logits_softcap", sampler.patch_logits_processor),
    ("sampling_edits", sampler.patch_sampling_edits),
    ("model_audit", loader.patch_model_loader),
]
#: The groups a family's descriptor asks for (:meth:`~samepath.models.descriptor.ModelFamily.vllm_patches`:
#: its norm and activation), by name.
FAMILY_GROUPS = {
    "rms_norm": layers.patch_rms_norm,
    "gemma_rms_norm": layers.patch_gemma_rms_norm,
    "silu_mul": layers.patch_silu_mul,
    "gelu_tanh_mul": layers.patch_gelu_tanh_mul,
}


def patch_groups() -> list:
    """The groups :func:`install` applies: :data:`CORE_GROUPS` with, after the attention backends,
    every family group a registered family of :mod:`samepath.models` needs (read now: a family
    registered later is included at the next install). A group a descriptor names that the plugin
    does not have is an error."""
    wanted = {name for family in set(families().values()) for name in family.vllm_patches()}
    unknown = wanted - set(FAMILY_GROUPS)
    if unknown:
        raise ValueError(f"model families ask for vLLM patch groups the plugin does not have: {sorted(unknown)}")
    family = [(name, patch) for name, patch in FAMILY_GROUPS.items() if name in wanted]
    return [*CORE_GROUPS[:4], *family, *CORE_GROUPS[4:]]


#: Today's groups (:func:`patch_groups` at import).
PATCH_GROUPS = patch_groups()

__all__ = [
    "CORE_GROUPS",
    "FAMILY_GROUPS",
    "INSTALLED",
    "PATCH_GROUPS",
    "install",
    "installed",
    "patch_groups",
    "uninstall",
]
