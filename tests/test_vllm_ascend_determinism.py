"""The Ascend determinism environment (HCCL / LCCL / NZ) at vllm-ascend install, on the CPU.

Whether HCCL honours the settings needs an NPU (bench/npu_check.sh); here: set where samepath owns
the process, refused by name where it does not or where they are set otherwise.
"""

from __future__ import annotations

import sys
import types

import pytest

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm_ascend import determinism, plugin
from samepath.integrations.vllm_ascend.determinism import DETERMINISM_ENV, DeterminismEnvError

REQUIRED = {name: value for name, (value, _) in DETERMINISM_ENV.items()}


def test_recipe_values() -> None:
    """verl's Ascend recipe and vllm-ascend's override_envs_for_invariance (0.18.0, 0.23.0)."""
    assert REQUIRED == {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1", "VLLM_ASCEND_ENABLE_NZ": "0"}


def test_unset_is_set_before_communicators_and_restored() -> None:
    env = {"PATH": "/bin", "LCCL_DETERMINISTIC": "1"}
    previous = determinism.ensure_environment(env, initialized=lambda: False)
    assert env == {"PATH": "/bin", **REQUIRED}
    assert previous == {"HCCL_DETERMINISTIC": None, "VLLM_ASCEND_ENABLE_NZ": None}
    determinism.restore_environment(previous, env)
    assert env == {"PATH": "/bin", "LCCL_DETERMINISTIC": "1"}
    # already right: nothing set, nothing to restore, even with HCCL up
    env = dict(REQUIRED)
    assert determinism.ensure_environment(env, initialized=lambda: True) == {} and env == REQUIRED


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HCCL_DETERMINISTIC", "true"),
        ("HCCL_DETERMINISTIC", "false"),
        ("LCCL_DETERMINISTIC", "0"),
        ("VLLM_ASCEND_ENABLE_NZ", "1"),
    ],
)
def test_other_values_are_refused_with_the_fix(name: str, value: str) -> None:
    env = {**REQUIRED, name: value}
    with pytest.raises(DeterminismEnvError, match=rf"{name}='{value}'.*HCCL_DETERMINISTIC=strict LCCL_DETERMINISTIC=1"):
        determinism.ensure_environment(env, initialized=lambda: False)
    assert env == {**REQUIRED, name: value}, "a refused check must not touch the environment"


def test_unset_after_hccl_started_is_refused() -> None:
    env = {"HCCL_DETERMINISTIC": "strict"}
    with pytest.raises(
        DeterminismEnvError, match=r"after torch.distributed / HCCL.*LCCL_DETERMINISTIC, VLLM_ASCEND_ENABLE_NZ"
    ):
        determinism.ensure_environment(env, initialized=lambda: True)
    assert env == {"HCCL_DETERMINISTIC": "strict"}


def test_communicator_initialized_in_a_plain_process() -> None:
    assert determinism.communicator_initialized() is False


def test_install_sets_and_uninstall_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring in install(): set before any patch, undone by uninstall; a refusal patches nothing."""
    for name in REQUIRED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(plugin, "check_compatibility", lambda version: None)
    monkeypatch.setattr(plugin, "PATCH_GROUPS", [])
    plugin.install()
    try:
        assert plugin.installed()
        assert {name: plugin.os.environ.get(name) for name in REQUIRED} == REQUIRED
    finally:
        plugin.uninstall()
    assert not any(name in plugin.os.environ for name in REQUIRED)
    monkeypatch.setenv("HCCL_DETERMINISTIC", "false")
    with pytest.raises(DeterminismEnvError, match="HCCL_DETERMINISTIC='false'"):
        plugin.install()
    assert not plugin.installed()
    assert "LCCL_DETERMINISTIC" not in plugin.os.environ


@pytest.mark.parametrize("mode", [0, 1, 2, None])
def test_weight_nz_mode_checked_where_the_config_is_built(monkeypatch: pytest.MonkeyPatch, mode: int | None) -> None:
    """vllm-ascend 0.23's AscendConfig.weight_nz_mode (additional_config wins over the env): 1 / 2
    refused; 0.18's config has no such attribute (None here: not set) and passes."""

    class AscendConfig:
        def __init__(self, vllm_config):
            if mode is not None:
                self.weight_nz_mode = mode

    module = types.ModuleType("vllm_ascend.ascend_config")
    module.AscendConfig = AscendConfig
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", module)
    patcher = Patcher()
    assert determinism.patch_nz_config(patcher)
    try:
        if mode in (1, 2):
            with pytest.raises(DeterminismEnvError, match=r"weight_nz_mode is \d.*'weight_nz_mode': 0"):
                AscendConfig(None)
        else:
            AscendConfig(None)
    finally:
        patcher.restore()
    AscendConfig(None)  # restored: the original __init__ again


def test_nz_config_patch_absent_without_vllm_ascend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", None)
    assert determinism.patch_nz_config(Patcher()) is False
