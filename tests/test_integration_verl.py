"""verl integration: verl's ``logprobs_from_logits`` (in every module that imported it by name) and
its FSDP engine's temperature scaling on samepath's schedule; run against the installed verl.

Skipped, with the reason, where verl (and what its modules import: ray, tensordict, omegaconf, ...)
is not installed. To run it here: a separate venv, e.g. ``/work/venv-verl`` with a ``.pth`` onto
``/work/venv``'s site-packages and ``pip install --no-deps verl`` plus its light dependencies.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from samepath.kernels.logprobs import token_logprobs


def _import_or_skip(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # any import failure means "not available here"
        pytest.skip(f"{name} does not import on this machine ({type(exc).__name__}: {exc})")


@pytest.fixture
def verl_tf():
    tf = _import_or_skip("verl.utils.torch_functional")
    from samepath.integrations import verl as sp_verl

    yield tf
    sp_verl.uninstall()
    assert not sp_verl.installed()


def _data(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, 300, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 300, (3, 7), generator=gen)
    return logits, labels


def test_install_replaces_every_binding_and_uninstall_restores(verl_tf):
    from samepath.integrations import verl as sp_verl

    naive = _import_or_skip("verl.workers.rollout.naive.naive_rollout")
    original = verl_tf.logprobs_from_logits
    assert naive.logprobs_from_logits is original  # verl imports it by name
    # A module holding it under another name is found by identity, too.
    alias_module = type(sys)("samepath_test_alias_module")
    alias_module.lp = original
    sys.modules[alias_module.__name__] = alias_module
    try:
        counts = sp_verl.install()
        assert counts["logprobs_from_logits"] >= 3
        for holder in (verl_tf, naive):
            assert holder.logprobs_from_logits is sp_verl.logprobs_from_logits
        assert alias_module.lp is sp_verl.logprobs_from_logits
        assert sp_verl.install() == {}  # idempotent
        assert sp_verl.originals()["logprobs_from_logits"] is original
        sp_verl.uninstall()
        for holder in (verl_tf, naive):
            assert holder.logprobs_from_logits is original
        assert alias_module.lp is original
    finally:
        del sys.modules[alias_module.__name__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_logprobs_equal_samepath(verl_tf, dtype):
    from samepath.integrations import verl as sp_verl

    logits, labels = _data(dtype)
    stock = verl_tf.logprobs_from_logits(logits, labels)
    with sp_verl.installed_for():
        got = verl_tf.logprobs_from_logits(logits, labels)
        got_flat = verl_tf.logprobs_from_logits(logits.reshape(-1, 300), labels.reshape(-1))
    expected = token_logprobs(logits, labels)
    assert torch.equal(got, expected)
    assert torch.equal(got_flat, expected.reshape(-1))
    ref = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    assert (got.double() - ref).abs().max() < 1e-4
    assert (stock.double() - ref).abs().max() < 0.1  # verl's own path computes the same quantity


def test_fsdp_temperature_is_divided_in_fp32_as_the_rollout_does(verl_tf):
    from samepath.integrations import verl as sp_verl

    engine = _import_or_skip("verl.workers.engine.fsdp.transformer_impl")
    original_scale = engine._scale_logits_by_temperature
    logits, labels = _data(torch.bfloat16, seed=1)
    temperature = torch.full((3, 1, 1), 0.7)
    rollout = token_logprobs(logits, labels, 0.7)  # samepath's rollout-side formula
    stock = verl_tf.logprobs_from_logits(original_scale(logits, temperature, is_unit_temperature=False), labels)
    with sp_verl.installed_for():
        assert engine._scale_logits_by_temperature is sp_verl.scale_logits_by_temperature
        assert engine.logprobs_from_logits is sp_verl.logprobs_from_logits
        scaled = engine._scale_logits_by_temperature(logits, temperature, is_unit_temperature=False)
        got = engine.logprobs_from_logits(logits=scaled, labels=labels)
        unit = engine.logprobs_from_logits(
            engine._scale_logits_by_temperature(logits, 1.0, is_unit_temperature=True), labels
        )
    assert engine._scale_logits_by_temperature is original_scale
    assert scaled.dtype == torch.float32
    assert torch.equal(got, rollout)
    assert torch.equal(unit, token_logprobs(logits, labels, 1.0))
    # Negative control: verl's bf16 division (and its log-softmax) differs from the rollout.
    assert not torch.equal(stock, rollout)
