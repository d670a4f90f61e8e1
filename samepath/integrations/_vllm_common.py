"""What the vLLM and vllm-ascend integrations share; each imports this module, neither the other.

* :class:`Patcher` and :func:`apply_patch_groups`: reversible class-attribute patches under
  :func:`samepath.batch_invariant`.
* :func:`claim` / :func:`release`: at most one vLLM integration installed per process.
* :func:`compute_logprobs`: the sampler's log-probs.
* :class:`StepCache`: values derived from one step's attention metadata, built by the first
  layer that sees that metadata object and reused by the others.
* :func:`cached_cos_sin`: rotary cos/sin of one step's positions, computed once per step.
* :func:`validate_metadata`: whether the first layer of a step checks the metadata's values.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from samepath.kernels.logprobs import log_softmax
from samepath.kernels.matmul import batch_invariant
from samepath.kernels.rotary import rotary_cos_sin

#: Set to ``1`` to let the entry point install samepath in every vLLM process.
ENV_VAR = "SAMEPATH_VLLM"
#: Optional: the trainer's ``samepath.fingerprint()``; a different one in vLLM is refused.
FINGERPRINT_ENV_VAR = "SAMEPATH_EXPECT_FINGERPRINT"
#: ``step`` (default): the first attention layer of each step checks the metadata's values (one
#: device-to-host copy per step, skipped while a CUDA graph is captured); ``off``: never.
VALIDATE_ENV_VAR = "SAMEPATH_VLLM_VALIDATE"


def enabled_by_env() -> bool:
    """Whether ``SAMEPATH_VLLM`` asks for samepath in this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class Patcher:
    """Records every class attribute it replaces so that :meth:`restore` puts the originals back."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Replace ``owner.name`` with ``value``; returns the attribute it replaced."""
        present = name in vars(owner)
        original = getattr(owner, name)
        self._originals.append((owner, name, present, vars(owner).get(name)))
        setattr(owner, name, value)
        return original

    def restore(self) -> None:
        while self._originals:
            owner, name, present, original = self._originals.pop()
            if present:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def apply_patch_groups(groups: Sequence[tuple[str, Callable[[Patcher], bool]]], installed: list[str]) -> ExitStack:
    """Enter :func:`samepath.batch_invariant` and apply each ``(name, patch)`` group with one
    :class:`Patcher`, appending the names of the groups that applied to ``installed``. Closing the
    returned stack restores every original and empties ``installed``; on an error, whatever was
    applied is undone before it propagates."""
    stack = ExitStack()
    try:
        patcher = Patcher()
        stack.callback(patcher.restore)
        stack.callback(installed.clear)
        stack.enter_context(batch_invariant())
        for name, patch in groups:
            if patch(patcher):
                installed.append(name)
    except BaseException:
        stack.close()
        raise
    return stack


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


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's ``Sampler.compute_logprobs`` (``raw_logprobs``): fp32 log-softmax of the raw logits,
    temperature 1, on samepath's fixed-chunk schedule."""
    return log_softmax(logits)


def has_dense_weight(layer: torch.nn.Module) -> bool:
    """Whether ``layer.weight`` is a plain 2-D float weight :func:`samepath.linear` can read."""
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.numel() > 0
        and not weight.is_meta
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def capturing_graph() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def validate_metadata() -> bool:
    """Whether the first attention layer of a step should check the metadata's values
    (:data:`VALIDATE_ENV_VAR`); never while a graph is captured or compiled."""
    if os.environ.get(VALIDATE_ENV_VAR, "step").strip().lower() in ("0", "off", "false", "no"):
        return False
    return not capturing_graph() and not torch.compiler.is_compiling()


class StepCache:
    """Values derived from one step's attention metadata object, by identity.

    Every attention layer of a step receives the same metadata object (one per KV-cache group),
    so :meth:`get` builds a value on the first layer and returns it to the others. The last
    ``size`` objects are held (strongly, so their ids cannot be reused); vLLM builds a new
    metadata object every step. A value built outside a CUDA graph capture is not reused inside
    one, and nothing is cached while torch.compile traces.
    """

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: list[tuple[Any, Any, bool]] = []
        self._lock = threading.Lock()

    def get(self, owner: Any, build: Callable[[], Any]) -> tuple[Any, bool]:
        """``(value, built)``: the value cached for ``owner`` (``built`` False), or ``build()``'s."""
        if torch.compiler.is_compiling():
            return build(), True
        capturing = capturing_graph()
        with self._lock:
            for entry_owner, value, captured in self._entries:
                if entry_owner is owner and captured == capturing:
                    return value, False
        value = build()
        with self._lock:
            self._entries.append((owner, value, capturing))
            del self._entries[: -self._size]
        return value, True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_rotary_cache = StepCache()


def cached_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.rotary_cos_sin` of ``positions``, computed once per positions tensor (vLLM
    passes every layer the same one in a step) and unmodified version, and reused by every layer
    with the same ``rotary_dim``, ``base``, ``dtype`` and keyword arguments."""
    key = (positions._version, rotary_dim, base, dtype, repr(sorted(kwargs.items())))
    table, _ = _rotary_cache.get(positions, dict)
    if key not in table:
        table[key] = rotary_cos_sin(positions, rotary_dim, base, dtype, **kwargs)
    return table[key]
