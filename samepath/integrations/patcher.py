"""One :class:`Patcher` for every integration: scoped, reversible patches with the originals recorded.

The Hugging Face integration (``patch_all``), verl's and the vLLM / vllm-ascend plugins all replace
attributes through it, and :meth:`Patcher.restore` puts back exactly what was there: a class
attribute as it sat in the class's ``__dict__`` (a ``staticmethod`` stays one), an attribute the
owner did not have is deleted again, a mapping key removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Patcher:
    """Records every attribute it replaces so that :meth:`restore` puts the originals back (in
    reverse order)."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Replace ``owner.name`` with ``value``; returns the attribute it replaced (``None`` when
        ``owner`` had none). For a class, what is recorded (and restored) is the class's own entry,
        not one inherited."""
        original = getattr(owner, name, None)
        if isinstance(owner, type):
            present = name in vars(owner)
            recorded = vars(owner).get(name)
        else:
            present = hasattr(owner, name)
            recorded = original
        self._originals.append((owner, name, present, recorded))
        setattr(owner, name, value)
        return original

    def set_item(self, mapping: dict, key: str, value: Any) -> None:
        self._originals.append((mapping, key, key in mapping, mapping.get(key)))
        mapping[key] = value

    def on_restore(self, undo: Callable[[], object]) -> None:
        """Have :meth:`restore` call ``undo`` (in reverse order with the recorded replacements)."""
        self._originals.append((None, "", True, undo))

    def restore(self) -> None:
        while self._originals:
            owner, name, present, original = self._originals.pop()
            if owner is None:
                original()
            elif isinstance(owner, dict):
                if present:
                    owner[name] = original
                else:
                    owner.pop(name, None)
            elif present:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


__all__ = ["Patcher"]
