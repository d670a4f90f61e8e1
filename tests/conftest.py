"""Suite-wide: the CPU executor each test runs on, and a guard that no test leaves samepath's global
patches behind for the next one.

Tests marked ``interpreter`` (the kernel tests) run the Triton source itself under Triton's
interpreter; every other test runs on the default CPU executor, the replays proven bit-identical to
it (tests/test_replay_*.py, ``samepath.kernels.dispatch``).
"""

from __future__ import annotations

import importlib.util

import pytest

from samepath import integrations


def _stock_state() -> dict[str, object]:
    state: dict[str, object] = {"patch_all": integrations.enabled()}
    if importlib.util.find_spec("transformers") is not None:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        state["attention"] = dict(AttentionInterface._global_mapping)
        state["masks"] = dict(AttentionMaskInterface._global_mapping)
    return state


@pytest.fixture(autouse=True)
def _no_leaked_patches():
    before = _stock_state()
    yield
    assert _stock_state() == before, "a test left samepath's integration patches (or interface entries) behind"


@pytest.fixture(autouse=True)
def _cpu_executor(request, monkeypatch):
    """The environment variable, not the context manager: threads and child processes follow it too."""
    if request.node.get_closest_marker("interpreter") is not None:
        monkeypatch.setenv("SAMEPATH_CPU_EXECUTOR", "interpreter")
