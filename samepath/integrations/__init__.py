"""Patch the rollout engine and the trainer onto samepath's kernels: ``patch_all()``.

    from samepath import integrations
    integrations.patch_all()          # before or after building the model
    ...
    integrations.unpatch_all()        # stock behaviour, exactly

``patch_all`` is idempotent and records every original it replaces. It routes torch's matmuls and
log-softmax through :func:`samepath.batch_invariant` (process-wide until ``unpatch_all``) and,
when transformers is installed, patches Hugging Face models (see
:mod:`samepath.integrations.hf`).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from samepath.integrations.patcher import Patcher
from samepath.kernels.config import record_uncovered
from samepath.kernels.matmul import batch_invariant

_lock = threading.RLock()
_stack: ExitStack | None = None
_patched_model_types: list[str] = []


def enabled() -> bool:
    """Whether :func:`patch_all` is in effect."""
    return _stack is not None


def patch_all(
    model: torch.nn.Module | None = None,
    *,
    model_types: list[str] | None = None,
    allow_uncovered: str | Sequence[str] | None = None,
) -> None:
    """Put every supported framework on samepath's kernels.

    Args:
        model: optionally, an already-built Hugging Face model whose config is switched to
            ``attn_implementation="samepath"`` (its model type is patched even if not listed), then
            audited (:func:`samepath.integrations.hf_audit.audit_hf_model`): a module samepath does not
            cover raises :class:`samepath.audit.UncoveredOpsError` naming it.
        model_types: the Hugging Face architectures to patch (``config.model_type``); default all
            of :data:`samepath.integrations.hf.MODEL_TYPES`.
        allow_uncovered: the explicit opt-out of that refusal: ``"all"`` or module class names,
            qualified module names or ops (default: ``SAMEPATH_ALLOW_UNCOVERED``). The run goes on
            with a warning, and :func:`samepath.fingerprint` records the opted-out parts.
    """
    global _stack
    if model is not None and not isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
        raise ValueError(f"model must be a Hugging Face model (with config.model_type), got {type(model).__name__}")
    if allow_uncovered is not None:  # a wrong type is named before anything is patched
        from samepath.audit import allowed_names

        allowed_names(allow_uncovered)
    with _lock:
        was_enabled = _stack is not None
        if _stack is None:
            stack = ExitStack()
            try:
                stack.enter_context(batch_invariant())
                if importlib.util.find_spec("transformers") is not None:
                    from samepath.integrations import hf

                    patcher = Patcher()
                    stack.callback(patcher.restore)
                    hf.register_interfaces(patcher, replace_defaults=True)
                    for model_type in model_types or sorted(hf.MODEL_TYPES):
                        hf.apply_to_model_type(model_type, patcher)
                        _patched_model_types.append(model_type)
                    stack.callback(_patched_model_types.clear)
                    stack.callback(record_uncovered, "hf", ())
            except BaseException:
                stack.close()
                raise
            _stack = stack
        if model is not None:
            try:
                _patch_model(model, allow_uncovered)
            except BaseException:
                if not was_enabled:
                    unpatch_all()
                raise


def _patch_model(model: torch.nn.Module, allow_uncovered: str | Sequence[str] | None) -> None:
    """Switch ``model`` onto samepath and audit it; a refusal undoes this call's changes."""
    from samepath.audit import enforce
    from samepath.integrations import hf
    from samepath.integrations.hf_audit import audit_hf_model

    patcher = _current_patcher()
    added = None
    try:
        model_type = model.config.model_type
        if model_type not in _patched_model_types and model_type in hf.MODEL_TYPES:
            hf.apply_to_model_type(model_type, patcher)
            _patched_model_types.append(model_type)
            added = model_type
        hf.use_samepath(model, patcher)
        enforce(audit_hf_model(model), allow_uncovered)
    except BaseException:
        patcher.restore()
        if added is not None:  # its patches are undone: a later patch_all(model) applies them again
            _patched_model_types.remove(added)
        raise


def _current_patcher() -> Patcher:
    patcher = Patcher()
    assert _stack is not None
    _stack.callback(patcher.restore)
    return patcher


def unpatch_all() -> None:
    """Undo :func:`patch_all`: every original back, torch's own kernels back, and each model that
    ``patch_all(model)`` switched back on the attention (and experts) implementation it had.
    Idempotent."""
    global _stack
    with _lock:
        if _stack is not None:
            stack, _stack = _stack, None
            stack.close()


@contextmanager
def patched(
    model: torch.nn.Module | None = None, *, allow_uncovered: str | Sequence[str] | None = None
) -> Iterator[None]:
    """``patch_all()`` for the duration of a block (restores the previous state on exit)."""
    was_enabled = enabled()
    patch_all(model, allow_uncovered=allow_uncovered)
    try:
        yield
    finally:
        if not was_enabled:
            unpatch_all()


__all__ = ["enabled", "patch_all", "patched", "unpatch_all"]
