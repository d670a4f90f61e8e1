"""What the vllm-ascend integration has installed in this process, and the originals it replaced.

:mod:`samepath.integrations.vllm_ascend.plugin` sets it; each patch records the attribute it
replaced with :func:`set_original`, and a patched method falls back to :func:`original` for what
samepath does not run.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from samepath.integrations.patcher import Patcher

_stack: ExitStack | None = None
#: Names of the patch groups :func:`samepath.integrations.vllm_ascend.install` applied (for logs and tests).
INSTALLED: list[str] = []

#: ``(owner, name) -> the attribute samepath replaced`` while installed.
ORIGINALS: dict[tuple[type, str], Any] = {}


def installed() -> bool:
    return _stack is not None


def set_installed(stack: ExitStack | None) -> ExitStack | None:
    """Record ``stack`` (``None``: uninstalled); returns the stack recorded before."""
    global _stack
    previous, _stack = _stack, stack
    return previous


def set_original(patcher: Patcher, owner: type, name: str, value: Any) -> None:
    ORIGINALS[(owner, name)] = patcher.set(owner, name, value)


def original(owner: type, name: str) -> Any:
    return ORIGINALS[(owner, name)]


__all__ = [
    "INSTALLED",
    "ORIGINALS",
    "installed",
    "original",
    "set_installed",
    "set_original",
]
