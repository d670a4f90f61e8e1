"""The determinism environment the Ascend rollout needs, checked (and set where samepath may) at install.

verl's Ascend true on-policy recipe, and vllm-ascend's own batch-invariant mode
(``vllm_ascend.batch_invariant.override_envs_for_invariance``), run with:

- ``HCCL_DETERMINISTIC=strict``: HCCL's collectives (all-reduce, reduce-scatter, ...) reduce in a
  fixed order whatever the message size; HCCL reads it when a communicator is created.
- ``LCCL_DETERMINISTIC=1``: the same for LCCL (the intra-node collectives vllm-ascend also uses).
- ``VLLM_ASCEND_ENABLE_NZ=0``: no weight cast to the FRACTAL_NZ layout (a different matmul schedule);
  vllm-ascend 0.23 also takes it as ``additional_config={"weight_nz_mode": ...}``, which wins over
  the environment, so that is checked where the config is built (:func:`patch_nz_config`).

The fourth setting, ``npu_add_rms_norm`` replaced by an add and a norm, is samepath's ``rms_norm``
patch group itself (``AscendRMSNorm.forward_oot`` with a residual runs :func:`samepath.rms_norm`'s
add + norm); :func:`ensure_environment` only sets the variables.

Where samepath owns the process before any communicator exists (the entry point's ``register``
runs in every vLLM process before its workers initialise HCCL), an unset variable is set.
A variable set to anything else, or unset after HCCL / torch.distributed is already initialised
(too late: HCCL has read its environment), is refused with the export that fixes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import optional_module

logger = logging.getLogger("samepath.integrations.vllm_ascend")

#: ``variable -> (the value required, why)``.
DETERMINISM_ENV: dict[str, tuple[str, str]] = {
    "HCCL_DETERMINISTIC": ("strict", "HCCL collectives in a fixed reduction order"),
    "LCCL_DETERMINISTIC": ("1", "LCCL collectives in a fixed reduction order"),
    "VLLM_ASCEND_ENABLE_NZ": ("0", "no FRACTAL_NZ weight cast"),
}


class DeterminismEnvError(RuntimeError):
    """The Ascend determinism environment is wrong, or unset where samepath can no longer set it."""


def communicator_initialized() -> bool:
    """Whether this process already has a torch.distributed process group (HCCL has then read its
    environment, and setting ``HCCL_DETERMINISTIC`` / ``LCCL_DETERMINISTIC`` would change nothing)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _fix() -> str:
    return " ".join(f"{name}={value}" for name, (value, _) in DETERMINISM_ENV.items())


def ensure_environment(
    environ: MutableMapping[str, str] | None = None,
    initialized: Callable[[], bool] = communicator_initialized,
) -> dict[str, str | None]:
    """Check :data:`DETERMINISM_ENV` and set the unset variables while no communicator exists.

    Args:
        environ: the environment (default ``os.environ``; tests pass a dict).
        initialized: whether a communicator already exists (:func:`communicator_initialized`).

    Returns:
        ``{variable: its previous value (None: was unset)}`` for each variable set, so the caller
        can restore them.

    Raises:
        DeterminismEnvError: a variable holds another value (each named, with the export that
            fixes it), or one is unset and a communicator already exists.
    """
    env = os.environ if environ is None else environ
    wrong = [
        f"{name}={env[name]!r} (needs {value!r}: {why})"
        for name, (value, why) in DETERMINISM_ENV.items()
        if name in env and env[name].strip() != value
    ]
    if wrong:
        raise DeterminismEnvError(
            f"samepath's vllm-ascend rollout needs the Ascend determinism environment; found {', '.join(wrong)}. "
            f"Start vLLM with {_fix()} (or unset them: samepath sets them before HCCL starts), or unset SAMEPATH_VLLM."
        )
    unset = [name for name in DETERMINISM_ENV if name not in env]
    if unset and initialized():
        raise DeterminismEnvError(
            f"samepath's vllm-ascend integration is being installed after torch.distributed / HCCL was initialised, "
            f"with {', '.join(unset)} unset: HCCL has already read its environment. Export {_fix()} before the "
            "process starts (or install samepath before the workers initialise their communicators)."
        )
    previous: dict[str, str | None] = {}
    for name in unset:
        previous[name] = None
        env[name] = DETERMINISM_ENV[name][0]
    if unset:
        logger.info("samepath set the Ascend determinism environment: %s", ", ".join(f"{n}={env[n]}" for n in unset))
    return previous


def restore_environment(previous: dict[str, str | None], environ: MutableMapping[str, str] | None = None) -> None:
    """Undo :func:`ensure_environment`'s settings (the variables it set become unset again)."""
    env = os.environ if environ is None else environ
    for name, value in previous.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value


def check_nz_mode(ascend_config: Any) -> None:
    """Refuse an ``AscendConfig`` whose ``weight_nz_mode`` (vllm-ascend 0.23+, from
    ``additional_config`` before the environment) is not 0; a config without it (0.18, which reads
    ``VLLM_ASCEND_ENABLE_NZ`` directly) passes."""
    mode = getattr(ascend_config, "weight_nz_mode", 0)
    if mode not in (0, "0", None, False):
        raise DeterminismEnvError(
            f"vllm-ascend's weight_nz_mode is {mode!r}: weights would be cast to FRACTAL_NZ (another matmul "
            "schedule than the trainer's). Start vLLM with additional_config={'weight_nz_mode': 0} and "
            "VLLM_ASCEND_ENABLE_NZ=0, or unset SAMEPATH_VLLM."
        )


def check_after_ascend_config_init(patcher: Patcher, check: Callable[[Any], None]) -> bool:
    """``AscendConfig.__init__`` followed by ``check(config)`` (the class is patched, not the
    ``init_ascend_config`` function, which the worker and platform modules import by name); False
    where the installed tree has no ``AscendConfig``."""
    owner = getattr(optional_module("vllm_ascend.ascend_config"), "AscendConfig", None)
    if owner is None:
        return False
    original_init = owner.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        check(self)

    patcher.set(owner, "__init__", __init__)
    return True


def patch_nz_config(patcher: Patcher) -> bool:
    """``AscendConfig.__init__`` followed by :func:`check_nz_mode`."""
    return check_after_ascend_config_init(patcher, check_nz_mode)


__all__ = [
    "DETERMINISM_ENV",
    "DeterminismEnvError",
    "check_after_ascend_config_init",
    "check_nz_mode",
    "communicator_initialized",
    "ensure_environment",
    "patch_nz_config",
    "restore_environment",
]
