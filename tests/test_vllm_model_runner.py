"""vLLM's model runner choice: samepath covers the V1 runner's sampler, so the plugin pins
``VLLM_USE_V2_MODEL_RUNNER=0`` where vLLM would default to V2 (every CUDA GPU), refuses V2 when it
is asked for, and its load gate refuses a config that runs V2 anyway. These are the helpers both
vLLM integrations call; tests/test_integration_vllm.py runs them inside a real vLLM install."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from samepath.integrations.vllm.env import (
    MODEL_RUNNER_ENV_VAR,
    ModelRunnerError,
    check_v1_model_runner,
    check_v1_model_runner_env,
    pin_v1_model_runner,
)


def test_unset_is_pinned_to_v1_and_the_undo_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_RUNNER_ENV_VAR, raising=False)
    check_v1_model_runner_env("vLLM")
    undo = pin_v1_model_runner()
    assert os.environ[MODEL_RUNNER_ENV_VAR] == "0"
    undo()
    assert MODEL_RUNNER_ENV_VAR not in os.environ


def test_an_explicit_zero_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_RUNNER_ENV_VAR, "0")
    check_v1_model_runner_env("vLLM")
    undo = pin_v1_model_runner()
    undo()
    assert os.environ[MODEL_RUNNER_ENV_VAR] == "0"


def test_the_undo_leaves_a_value_set_since(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_RUNNER_ENV_VAR, raising=False)
    undo = pin_v1_model_runner()
    os.environ[MODEL_RUNNER_ENV_VAR] = "1"
    undo()
    assert os.environ[MODEL_RUNNER_ENV_VAR] == "1"


@pytest.mark.parametrize("value", ["1", " 1", "2", "true"])
def test_the_v2_runner_asked_for_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(MODEL_RUNNER_ENV_VAR, value)
    with pytest.raises(ModelRunnerError, match=rf"{MODEL_RUNNER_ENV_VAR}=.*V2 model runner.*set it to 0"):
        check_v1_model_runner_env("vLLM")


def test_the_load_gate_refuses_a_config_running_v2() -> None:
    with pytest.raises(ModelRunnerError, match=r"V2 model runner.*watermarking"):
        check_v1_model_runner(SimpleNamespace(use_v2_model_runner=True), "vLLM")
    check_v1_model_runner(SimpleNamespace(use_v2_model_runner=False), "vLLM")
    check_v1_model_runner(SimpleNamespace(), "vLLM")
    check_v1_model_runner(None, "vLLM")
