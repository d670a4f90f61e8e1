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

Recipe (verl + vLLM / vllm-ascend + FSDP):

* trainer workers: ``samepath.integrations.patch_all()`` (matmuls, log-softmax, Hugging Face
  attention / norms / rotary / SiLU·mul) and :func:`install`, in every worker process (e.g. from
  a ``sitecustomize`` or the worker's init hook), with ``actor_rollout_ref.actor.strategy=fsdp``
  (or ``fsdp2``), ``actor_rollout_ref.model.use_fused_kernels=False`` (verl's fused
  linear-cross-entropy computes the logprobs itself) and ``VERL_DISABLE_FLASH_ATTN_CE=1`` (also
  set by verl's engine utils; with :func:`install` flash-attn's cross entropy is bypassed anyway);
* rollout: ``SAMEPATH_VLLM=1`` with samepath's ``vllm.general_plugins`` entry point
  (:mod:`samepath.integrations.vllm`) and ``actor_rollout_ref.rollout.calculate_log_probs=True``;
  TP degree of the rollout = the ``k_slices`` / vocab shards the trainer runs
  (:mod:`samepath.distributed`), or ``tensor_model_parallel_size=1``;
* logprobs mode: samepath's vLLM sampler patch covers ``raw_logprobs`` (temperature 1) only, and
  verl defaults to ``actor_rollout_ref.rollout.logprobs_mode=processed_logprobs``: set
  ``logprobs_mode=raw_logprobs`` with ``rollout.temperature=1.0`` until the vLLM integration
  covers ``processed_logprobs`` (``token_logprobs(raw_logits, labels, T)``, which
  :func:`scale_logits_by_temperature` already matches on the trainer side);
* verl then logs ``training/rollout_probs_diff_max`` / ``_mean`` (and samepath's
  ``python -m samepath check``) at 0.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from samepath.integrations.hf import Patcher
from samepath.kernels.logprobs import token_logprobs

#: (module, attribute) of the originals this integration replaces, by the name verl defines them.
TARGETS = (
    ("verl.utils.torch_functional", "logprobs_from_logits"),
    ("verl.workers.engine.fsdp.transformer_impl", "_scale_logits_by_temperature"),
)

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


_REPLACEMENTS = {
    "logprobs_from_logits": logprobs_from_logits,
    "_scale_logits_by_temperature": scale_logits_by_temperature,
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
        patcher = Patcher()
        counts: dict[str, int] = {}
        try:
            for attr, original in found.items():
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


__all__ = [
    "TARGETS",
    "install",
    "installed",
    "installed_for",
    "logprobs_from_logits",
    "originals",
    "scale_logits_by_temperature",
    "uninstall",
]
