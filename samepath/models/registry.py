"""The registry of model families: ``config.model_type`` -> its :class:`~samepath.models.descriptor.ModelFamily`.

Every module of the :mod:`samepath.models` package that defines ``FAMILY`` (a ``ModelFamily``) is
a family, found on first use (Liger-style: one place per family, dispatched by
``config.model_type``); :mod:`samepath.models.refused` holds the families samepath refuses, with
the reason. :func:`register` adds one from elsewhere (a test, an experiment), :func:`unregister`
removes it again.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping, Set
from pathlib import Path
from types import MappingProxyType
from typing import Any

from samepath.models.descriptor import ModelFamily, UnsupportedModelError

#: The package whose modules are the families (this module's own).
_PACKAGE = __name__.rpartition(".")[0]

#: Modules of the package that are not families.
_NOT_FAMILIES = frozenset({"descriptor", "formulas", "registry"})

_FAMILIES: dict[str, ModelFamily] = {}
_REFUSALS: dict[str, str] = {}
_loaded = False
_lock = threading.RLock()


def _load() -> None:
    """Import every family module of the package once (under a lock: the first use may race)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
            if info.name in _NOT_FAMILIES or info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{_PACKAGE}.{info.name}")
            descriptor = getattr(module, "FAMILY", None)
            if descriptor is not None:
                _add(descriptor, replace=False)
            for model_type, reason in getattr(module, "REFUSALS", {}).items():
                if model_type in _FAMILIES or model_type in _REFUSALS:
                    raise ValueError(f"model_type {model_type!r} is both refused and registered (or refused twice)")
                _REFUSALS[model_type] = reason
        _loaded = True


def _add(descriptor: ModelFamily, replace: bool) -> None:
    if not isinstance(descriptor, ModelFamily):
        raise TypeError(f"expected a ModelFamily, got {type(descriptor).__name__}")
    for model_type in descriptor.model_types:
        if not replace and (model_type in _FAMILIES or model_type in _REFUSALS):
            raise ValueError(f"model_type {model_type!r} is already registered")
    for model_type in descriptor.model_types:
        _FAMILIES[model_type] = descriptor


def register(descriptor: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Add a family (every one of its ``model_types``); ``ValueError`` if one is taken, unless
    ``replace``. Returns ``descriptor``."""
    _load()
    with _lock:
        _add(descriptor, replace)
    return descriptor


def unregister(descriptor: ModelFamily) -> None:
    """Remove a family :func:`register` added (its model types become unsupported)."""
    _load()
    with _lock:
        for model_type in descriptor.model_types:
            if _FAMILIES.get(model_type) is descriptor:
                del _FAMILIES[model_type]


def families() -> MappingProxyType:
    """model_type -> :class:`ModelFamily` of every supported model type (a read-only snapshot)."""
    _load()
    return MappingProxyType(dict(sorted(_FAMILIES.items())))


def find(model_type: object) -> ModelFamily | None:
    """The family of ``model_type``, ``None`` for a type samepath does not support."""
    _load()
    return _FAMILIES.get(model_type) if isinstance(model_type, str) else None


def family(model_type: object) -> ModelFamily:
    """The family of ``model_type``; :class:`~samepath.models.descriptor.UnsupportedModelError` with
    :func:`refusal_reason` for a type samepath does not support."""
    found = find(model_type)
    if found is None:
        raise UnsupportedModelError(refusal_reason(model_type))
    return found


def refusals() -> MappingProxyType:
    """model_type -> why samepath refuses it, for the families refused by name (a read-only snapshot)."""
    _load()
    return MappingProxyType(dict(_REFUSALS))


def refusal_reason(model_type: object) -> str:
    """Why samepath refuses ``model_type`` (one message for the API, the vLLM plugin and the CLI)."""
    _load()
    supported = ", ".join(sorted(_FAMILIES))
    if model_type in _REFUSALS:
        return f"model_type {model_type!r} is not supported: {_REFUSALS[model_type]} (supported: {supported})"
    return (
        f"model_type {model_type!r} is not covered by samepath on both the trainer and the rollout side "
        f"(supported: {supported})"
    )


class FamilyView(Mapping):
    """model_type -> ``value(family)`` for every registered family, read from the registry at each
    use (a family registered later shows up): an integration's per-family table."""

    def __init__(self, value: Callable[[ModelFamily], Any]) -> None:
        self._value = value

    def __getitem__(self, model_type: str) -> Any:
        found = find(model_type)
        if found is None:
            raise KeyError(model_type)
        return self._value(found)

    def __iter__(self) -> Iterator[str]:
        return iter(families())

    def __len__(self) -> int:
        return len(families())


class ModelTypesWhere(Set):
    """The registered model types whose family satisfies ``test``, read from the registry at each use."""

    def __init__(self, test: Callable[[ModelFamily], bool]) -> None:
        self._test = test

    def __contains__(self, model_type: object) -> bool:
        found = find(model_type)
        return found is not None and self._test(found)

    def __iter__(self) -> Iterator[str]:
        return iter([model_type for model_type, found in families().items() if self._test(found)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def family_view(value: Callable[[ModelFamily], Any]) -> FamilyView:
    """A live mapping model_type -> ``value(family)`` (see :class:`FamilyView`)."""
    return FamilyView(value)


def model_types_where(test: Callable[[ModelFamily], bool]) -> ModelTypesWhere:
    """A live set of the model types whose family satisfies ``test`` (see :class:`ModelTypesWhere`)."""
    return ModelTypesWhere(test)


__all__ = [
    "FamilyView",
    "ModelTypesWhere",
    "families",
    "family",
    "family_view",
    "find",
    "model_types_where",
    "refusal_reason",
    "refusals",
    "register",
    "unregister",
]
