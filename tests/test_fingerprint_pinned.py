"""The numerics fingerprint is pinned: a change of executor, layout or refactoring that changes it
changed the numerics. A deliberate numerics change updates these strings together with
``NUMERICS_VERSION`` or the frozen table, and says so in docs/numerics.md."""

from __future__ import annotations

import pytest

import samepath
from samepath.check.harness import DEFAULT_MODEL_CONFIG

PINNED = {
    1: "sp5-79304010862bf1f2",
    2: "sp5-774030566ac9b08c",
}


@pytest.mark.parametrize("tensor_parallel_size", sorted(PINNED))
def test_numerics_fingerprint_is_pinned(tensor_parallel_size):
    assert samepath.fingerprint(tensor_parallel_size) == PINNED[tensor_parallel_size]


def test_model_fingerprints_are_pinned():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    qwen3 = transformers.Qwen3Config(**DEFAULT_MODEL_CONFIG)
    gemma3 = transformers.Gemma3TextConfig(**DEFAULT_MODEL_CONFIG)
    assert samepath.fingerprint(model_config=qwen3) == PINNED[1] + "-m1e4aca74d8e3"
    assert samepath.fingerprint(model_config=gemma3) == PINNED[1] + "-m4d226bd95981"


def test_the_cpu_executor_is_not_part_of_the_numerics(monkeypatch):
    """The CPU replays are bit-identical to the interpreter, so choosing one changes no fingerprint."""
    for executor in ("replay", "interpreter", "verify"):
        monkeypatch.setenv("SAMEPATH_CPU_EXECUTOR", executor)
        assert samepath.fingerprint() == PINNED[1]
