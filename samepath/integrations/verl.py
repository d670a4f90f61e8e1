"""verl: the trainer's token log-probs on samepath's schedule, with the rollout's temperature rounding.

    from samepath.integrations import verl as samepath_verl
    samepath_verl.install()          # in every trainer worker, after or before importing verl
    ...
    samepath_verl.uninstall()        # verl's own functions back, exactly

What :func:`install` replaces (every original recorded; :func:`uninstall` restores them):

* **logprobs_from_logits** — ``verl.utils.torch_functional.logprobs_from_logits`` and every
  module attribute that *is* that function (verl's engines import it by name:
  ``from verl.utils.torch_functional import logprobs_from_logits`` in the FSDP, automodel and
  torchtitan engines, the naive rollout and the prefix grouper), found by scanning
  ``sys.modules`` for the identical object, whatever name it is bound to. Modules imported
  later bind the replacement from ``verl.utils.torch_functional``. The replacement is
  :func:`logprobs_from_logits`: :func:`samepath.token_logprobs` at temperature 1 of the logits it
  receives (verl divides by the temperature before calling it), no ignore_index (verl's labels are
  token ids), no host-side label check.
* **Temperature** — ``_scale_logits_by_temperature`` of verl's FSDP engine
  (``verl.workers.engine.fsdp.transformer_impl``), found the same way. verl divides the logits by
  ``temperature.to(logits.dtype)`` — a bf16 division for bf16 logits — while the rollout divides
  fp32 logits by an fp32 temperature. The replacement, :func:`scale_logits_by_temperature`,
  returns ``logits.float() / temperature.float().clamp(min=1e-8)`` (IEEE fp32 division; the logits
  unchanged for temperature 1), so ``token_logprobs(scaled, labels, 1.0)`` is bitwise
  ``token_logprobs(logits, labels, T)``, samepath's rollout-side formula. The scaled logits are an
  fp32 copy ``[tokens, vocab]`` (verl's bf16 division already copies; this one is twice as large).
  The automodel, torchtitan and Megatron engines divide inline (``logits / temperature`` or
  ``logits.div_``) and are not covered: use the FSDP engine or temperature 1.
* **The fused lm_head** (``actor_rollout_ref.model.use_fused_kernels=True``) — verl's model
  forward then hands the last hidden states and ``lm_head.weight`` to
  ``FusedLinearForPPO.forward`` (``verl.utils.experimental.torch_functional``; impl_backend
  ``torch`` or ``liger``) or to ``linear_cross_entropy`` (``verl.utils.kernel.linear_cross_entropy``;
  impl_backend ``triton``), never computing ``[tokens, vocab]`` logits. Both are replaced by
  samepath's fused lm_head + token log-probs and entropy
  (:func:`fused_linear_for_ppo_forward`, :func:`linear_cross_entropy`, both
  :func:`samepath.integrations.hf.fused_lm_head_logprobs`): fp32 log-probs with the bits of
  ``samepath.logprobs(lm_head logits, labels, T)`` — what the vLLM rollout reports with
  ``logprobs_mode=processed_logprobs`` — and memory for only a fixed chunk of logits rows.
  The temperature is the Python float verl passes (a per-sample temperature is refused by verl
  itself on this path).

The rollout's ``calculate_log_probs`` path needs no patch in verl: with
``actor_rollout_ref.rollout.calculate_log_probs=True`` verl asks vLLM for the sampled token's
log-prob (``SamplingParams.logprobs=0``) and carries it as a Python float into the fp32
``rollout_log_probs`` tensor (``AgentLoopOutput.as_dict`` / the agent loop's padding), which is
exact. Its numerics are the rollout engine's: samepath's vLLM / vllm-ascend sampler patch.
``tests/test_integration_verl.py`` runs verl's own trainer path (``FSDPEngineWithLMHead``'s
``prepare_model_inputs`` / ``prepare_model_outputs`` under bf16 autocast, ``no_padding_2_padding``)
and verl's ``calculate_debug_metrics``: ``training/rollout_probs_diff_max`` / ``_mean`` / ``_std``
are exactly 0 against samepath's rollout log-probs, and not 0 without :func:`install` — with
``use_fused_kernels`` off, and on (verl's own ``patch_forward_with_backends``, backends ``torch``
and ``triton``).

Worker processes: with ``SAMEPATH_VERL=1`` in the environment, importing this module calls
:func:`register` (``samepath.integrations.patch_all()`` and :func:`install`), so naming it in
verl's ``VERL_USE_EXTERNAL_MODULES`` (imported by ``import verl`` in every Ray worker) puts every
trainer process on samepath.

Recipe (verl + vLLM / vllm-ascend + FSDP): see docs/integrations.md. In short, through Ray's
runtime environment (``+ray_kwargs.ray_init.runtime_env.env_vars.NAME=value``):
``SAMEPATH_VERL='1'``, ``VERL_USE_EXTERNAL_MODULES=samepath.integrations.verl``, ``SAMEPATH_VLLM='1'``
(quoted: Ray takes only strings there) and ``SAMEPATH_EXPECT_FINGERPRINT`` = the trainer's
``samepath.fingerprint()``; and
``actor_rollout_ref.actor.strategy=fsdp2``, ``actor_rollout_ref.model.use_fused_kernels=True`` (the
fused lm_head above; ``False`` computes full logits, equally bit-identical),
``actor_rollout_ref.model.use_liger=False``, ``actor_rollout_ref.rollout.calculate_log_probs=True``,
``actor_rollout_ref.rollout.logprobs_mode=processed_logprobs`` (vLLM then reports the log-probs
at the sampling temperature, which the trainer computes) and
``actor_rollout_ref.rollout.tensor_model_parallel_size=1`` (vLLM's row-parallel all-reduce is not
yet on :mod:`samepath.distributed`). verl then logs ``training/rollout_probs_diff_*`` at 0.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from samepath.integrations.hf import fused_lm_head_logprobs
from samepath.integrations.patcher import Patcher
from samepath.kernels.logprobs import token_logprobs
from samepath.models.formulas import final_logit_softcap

#: (module, attribute) of the originals this integration replaces, by the name verl defines them.
TARGETS = (
    ("verl.utils.torch_functional", "logprobs_from_logits"),
    ("verl.workers.engine.fsdp.transformer_impl", "_scale_logits_by_temperature"),
    ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy"),
    ("verl.models.transformers.dense_common", "forward_base_model"),
)

#: (module, class, method) of the methods this integration replaces on the class itself.
METHOD_TARGETS = (("verl.utils.experimental.torch_functional", "FusedLinearForPPO", "forward"),)

#: Set to ``1`` to make importing this module call :func:`register` (worker processes).
ENV_VAR = "SAMEPATH_VERL"

_lock = threading.RLock()
_patcher: Patcher | None = None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``logprobs_from_logits(logits, labels, inplace_backward)`` on samepath's schedule:
    fp32 ``log softmax(logits)[label]`` (``inplace_backward`` is accepted and ignored)."""
    del inplace_backward
    return token_logprobs(logits, labels, 1.0, ignore_index=None, validate=False)


def scale_logits_by_temperature(
    logits: torch.Tensor, temperature: Any, *, is_unit_temperature: bool = False
) -> torch.Tensor:
    """verl's ``_scale_logits_by_temperature`` with the rollout's rounding: fp32 logits divided by
    the fp32 temperature (IEEE), or the logits unchanged for temperature 1."""
    if is_unit_temperature:
        return logits
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor(float(temperature), dtype=torch.float32, device=logits.device)
    return logits.to(torch.float32) / temperature.to(torch.float32).clamp(min=1e-8)


def _python_temperature(temperature: Any) -> float:
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(
                "samepath's fused lm_head takes one temperature for the batch (verl's fused path does too), "
                f"got a tensor of shape {tuple(temperature.shape)}"
            )
        return float(temperature.item())
    return temperature


def fused_linear_for_ppo_forward(
    self: Any,
    hidden_states: torch.Tensor,
    vocab_weights: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``FusedLinearForPPO.forward`` on samepath: ``(log_probs, entropy)``, fp32, of
    ``input_ids`` under ``softmax(hidden_states @ vocab_weights.T / temperature)``, computed over
    fixed token and vocabulary chunks without ``[tokens, vocab]`` logits (forward and backward).
    Bit-identical to ``samepath.logprobs(samepath.linear(hidden_states, vocab_weights), input_ids,
    temperature)`` — the rollout's log-probs. ``self``'s chunk size and backend are not used:
    samepath's token chunk is fixed (and neutral)."""
    del self
    return fused_lm_head_logprobs(
        hidden_states,
        vocab_weights,
        input_ids.to(torch.int64),
        _python_temperature(temperature),
        return_entropy=True,
        ignore_index=None,
        validate=False,
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` (the ``triton`` fused-kernel backend) on samepath: as
    :func:`fused_linear_for_ppo_forward`. Only ``reduction="none"`` without a process group (the
    unsharded vocabulary), which is how verl's model forward calls it; ``ValueError`` otherwise."""
    if reduction != "none":
        raise ValueError(
            f"samepath's linear_cross_entropy returns per-token values: reduction must be 'none', got {reduction!r}"
        )
    if dist_process_group is not None:
        raise ValueError(
            "samepath's linear_cross_entropy does not shard the vocabulary: dist_process_group must be None "
            "(vocabulary-parallel log-probs: samepath.distributed)"
        )
    return fused_linear_for_ppo_forward(None, hidden, weight, labels, temperature)


#: verl's own ``dense_common.forward_base_model`` (set by :func:`install`).
_ORIGINAL_BASE_MODEL: list[Any] = []


def forward_base_model(self: Any, *args: Any, **kwargs: Any) -> Any:
    """verl's ``dense_common.forward_base_model`` (the decoder pass of its fused-kernel model forward),
    refusing a model whose logits are soft-capped (Gemma 2's ``final_logit_softcapping``): verl's fused
    forward hands the hidden states to the fused lm_head without the cap, so its log-probs would not be
    the rollout's. ``NotImplementedError`` naming the fix (``use_fused_kernels=False``: the model's own
    forward caps with samepath's kernel); verl's function otherwise."""
    cap = final_logit_softcap(getattr(self, "config", None))
    if cap is not None:
        raise NotImplementedError(
            f"verl's fused-kernel forward (use_fused_kernels=True) skips {type(self).__name__}'s final logit "
            f"soft-capping (final_logit_softcapping={cap}), which the rollout applies; samepath refuses it. Set "
            "actor_rollout_ref.model.use_fused_kernels=False: the model's forward then caps the logits with "
            "samepath's kernel, as the rollout does"
        )
    return _ORIGINAL_BASE_MODEL[0](self, *args, **kwargs)


_REPLACEMENTS = {
    "logprobs_from_logits": logprobs_from_logits,
    "_scale_logits_by_temperature": scale_logits_by_temperature,
    "linear_cross_entropy": linear_cross_entropy,
    "FusedLinearForPPO.forward": fused_linear_for_ppo_forward,
    "forward_base_model": forward_base_model,
}


def originals() -> dict[str, Any]:
    """verl's original functions by name (those whose module imports here), whether or not installed."""
    found: dict[str, Any] = {}
    for module_name, attr in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # an engine that does not import on this machine is not patched
            continue
        value = getattr(module, attr, None)
        if _patcher is not None:
            for owner, name, _present, original in _patcher._originals:
                if owner is module and name == attr:
                    value = original
        if value is not None:
            found[attr] = value
    for module_name, cls_name, method in METHOD_TARGETS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except Exception:
            continue
        value = vars(cls).get(method)
        if _patcher is not None:
            for owner, name, _present, original in _patcher._originals:
                if owner is cls and name == method:
                    value = original
        if value is not None:
            found[f"{cls_name}.{method}"] = value
    return found


def _bound_everywhere(patcher: Patcher, original: Any, replacement: Any) -> int:
    """Replace every module-level binding of ``original`` (any name) in ``sys.modules``."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                patcher.set(module, name, replacement)
                count += 1
    return count


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _patcher is not None


def install() -> dict[str, int]:
    """Patch verl (idempotent). Returns how many module bindings were replaced per function.

    Raises ``ImportError`` when ``verl.utils.torch_functional`` does not import.
    """
    global _patcher
    with _lock:
        importlib.import_module("verl.utils.torch_functional")
        if _patcher is not None:
            return {}
        found = originals()
        _ORIGINAL_BASE_MODEL[:] = [found.get("forward_base_model")]
        patcher = Patcher()
        counts: dict[str, int] = {}
        try:
            methods = {f"{cls}.{method}": (module, cls, method) for module, cls, method in METHOD_TARGETS}
            for attr, original in found.items():
                if attr in methods:
                    module_name, cls_name, method = methods[attr]
                    cls = getattr(importlib.import_module(module_name), cls_name)
                    patcher.set(cls, method, _REPLACEMENTS[attr])
                    counts[attr] = 1
                else:
                    counts[attr] = _bound_everywhere(patcher, original, _REPLACEMENTS[attr])
        except BaseException:
            patcher.restore()
            raise
        _patcher = patcher
        return counts


def uninstall() -> None:
    """Put every original back (idempotent)."""
    global _patcher
    with _lock:
        if _patcher is not None:
            patcher, _patcher = _patcher, None
            patcher.restore()


@contextmanager
def installed_for() -> Iterator[None]:
    """:func:`install` for the duration of a block (restores the previous state on exit)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def enabled_by_env() -> bool:
    """Whether ``SAMEPATH_VERL`` asks for samepath in this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """When ``SAMEPATH_VERL=1``: ``samepath.integrations.patch_all()`` (Hugging Face models, torch's
    matmuls and log-softmax) and :func:`install` (verl). Runs on import of this module, so verl's
    ``VERL_USE_EXTERNAL_MODULES=samepath.integrations.verl`` applies it in every worker; does
    nothing without the variable."""
    if not enabled_by_env():
        return
    from samepath import integrations

    integrations.patch_all()
    install()


__all__ = [
    "ENV_VAR",
    "METHOD_TARGETS",
    "TARGETS",
    "enabled_by_env",
    "fused_linear_for_ppo_forward",
    "install",
    "installed",
    "installed_for",
    "linear_cross_entropy",
    "logprobs_from_logits",
    "originals",
    "register",
    "scale_logits_by_temperature",
    "uninstall",
]

register()
