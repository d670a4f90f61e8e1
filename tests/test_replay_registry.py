"""Every Triton kernel of samepath has a CPU replay, and every replay names a kernel that exists.

A kernel moved to another module (or renamed) without its replay's key would silently run under
the interpreter on the CPU again; a replay whose kernel is gone would never run."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import samepath
from samepath.kernels import dispatch
from samepath.kernels.dispatch import DualJITFunction, kernel_key, replay_for

#: Kernels that run under the interpreter on the CPU, with the reason (none today).
WITHOUT_REPLAY: dict[str, str] = {}


def _kernels() -> set[str]:
    keys = set()
    for info in pkgutil.walk_packages(samepath.__path__, "samepath."):
        if ".ascendc" in info.name or info.name.endswith("compile_check"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if isinstance(obj, DualJITFunction) and obj.fn.__module__ == module.__name__:
                if obj.fn.__name__.endswith("_kernel"):
                    keys.add(kernel_key(obj))
    return keys


def test_every_kernel_has_a_replay_and_every_replay_a_kernel():
    replay_for("samepath.kernels.matmul._matmul_kernel")  # loads the replay package
    registered = set(dispatch.registered_replays())
    kernels = _kernels()
    assert kernels, "no kernels found"
    assert sorted(kernels - registered - set(WITHOUT_REPLAY)) == []
    assert sorted(registered - kernels) == []


def test_the_default_executor_runs_the_replay(monkeypatch):
    """With the interpreter made to fail, a CPU launch still succeeds: the replay ran."""
    monkeypatch.delenv("SAMEPATH_CPU_EXECUTOR", raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the interpreter ran")

    monkeypatch.setattr(DualJITFunction, "_interpret", refuse)
    x = torch.randn(5, 24)
    samepath.rms_norm(x, torch.randn(24), 1e-6)
    with pytest.raises(AssertionError, match="the interpreter ran"), dispatch.cpu_executor("interpreter"):
        samepath.rms_norm(x, torch.randn(24), 1e-6)
