"""verl integration: verl's ``logprobs_from_logits`` (in every module that imported it by name) and
its FSDP engine's temperature scaling on samepath's schedule; run against the installed verl.

Skipped, with the reason, where verl (and what its modules import: ray, tensordict, omegaconf, ...)
is not installed. To run it here: a separate venv with a ``.pth`` onto the project venv's
site-packages and ``pip install --no-deps verl==0.9.1`` plus what its modules import (ray,
tensordict, pyvers, omegaconf, antlr4-python3-runtime, codetiming, msgpack, protobuf, requests,
urllib3, certifi, charset-normalizer, idna, jsonschema, jsonschema-specifications, referencing,
rpds-py, attrs, cloudpickle, peft, accelerate, datasets, multiprocess, dill, xxhash, pandas,
pyarrow, orjson), then ``PYTHONPATH=. <venv>/bin/python -m pytest tests/test_integration_verl.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from samepath.kernels.logprobs import token_logprobs

ROOT = Path(__file__).resolve().parent.parent


def _import_or_skip(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # any import failure means "not available here"
        reason = f"{name} does not import on this machine ({type(exc).__name__}: {exc})"
        if os.environ.get("SAMEPATH_REQUIRE_VERL") == "1":  # nox -s verl: a skip would hide a broken install
            pytest.fail(reason)
        pytest.skip(reason)


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


# ----------------------------------------------------------------------------------------------
# verl's own mismatch metrics: rollout (samepath) vs verl's FSDP trainer path
# ----------------------------------------------------------------------------------------------

TEMPERATURE = 0.7


def _verl_actor_log_probs(
    engine, model, prompts: list[list[int]], responses: torch.Tensor, fused_backend: str | None = None
) -> torch.Tensor:
    """``old_log_probs`` ``[B, R]`` as verl's FSDP actor computes them: the left/right-padded batch
    made jagged by ``left_right_2_no_padding``, ``FSDPEngineWithLMHead.prepare_model_inputs`` (packed,
    remove-padding), the model under bf16 autocast, ``prepare_model_outputs`` (temperature scaling,
    ``logprobs_from_logits``) and ``no_padding_2_padding`` — run with a stand-in for the engine
    object (no FSDP wrapping, no Ulysses, no static padding), since ``forward_step`` needs a GPU.

    ``fused_backend`` (``"torch"`` / ``"triton"``): verl's ``use_fused_kernels=True`` path instead —
    the model's forward replaced by verl's ``patch_forward_with_backends`` (undone afterwards), which
    hands the hidden states and ``lm_head.weight`` to ``FusedLinearForPPO`` / ``linear_cross_entropy``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch, width = responses.shape[0], max(map(len, prompts))
    prompt_ids = torch.zeros((batch, width), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, prompt in enumerate(prompts):
        prompt_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, width - len(prompt) :] = 1
    attention_mask = torch.cat([prompt_mask, torch.ones_like(responses)], dim=1)
    data = TensorDict(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": torch.ones_like(responses),
        },
        batch_size=[batch],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor_data(data, "temperature", TEMPERATURE)
    if fused_backend is not None:
        tu.assign_non_tensor_data(data, "use_fused_kernels", True)

    class Engine:
        pad_to_length = False
        use_ulysses_sp = False
        module = model

        def _get_packed_pad_size(self, packed_length: int) -> int:
            return 0

        def _gather_and_unpad_packed(self, tensor: torch.Tensor, pad_size: int) -> torch.Tensor:
            return engine.FSDPEngine._gather_and_unpad_packed(self, tensor, pad_size)

    stand_in = Engine()
    inputs, output_args = engine.FSDPEngineWithLMHead.prepare_model_inputs(stand_in, data)
    cls = type(model)
    forward = vars(cls)["forward"]
    try:
        if fused_backend is not None:
            from verl.models.transformers.monkey_patch import patch_forward_with_backends

            patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=fused_backend)
            assert cls.forward is not forward
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            raw = model(**inputs, use_cache=False)
            outputs = engine.FSDPEngineWithLMHead.prepare_model_outputs(stand_in, raw, output_args, data, None)
    finally:
        cls.forward = forward
    if fused_backend is not None:
        assert getattr(raw, "logits", None) is None  # the fused path computed no logits
    data["attention_mask"] = attention_mask
    return no_padding_2_padding(outputs["log_probs"], data)


def test_verl_rollout_probs_diff_metrics_are_zero_with_samepath_on_both_sides(verl_tf):
    engine = _import_or_skip("verl.workers.engine.fsdp.transformer_impl")
    debug_metrics = _import_or_skip("verl.utils.debug.metrics")
    _import_or_skip("transformers")
    from verl import DataProto

    from samepath import integrations
    from samepath.check import harness
    from samepath.integrations import verl as sp_verl

    model = harness.load_default_model(torch.bfloat16, seed=3).model
    prompts = harness.random_prompts(3, model.config.vocab_size, seed=4, min_len=3, max_len=7)
    was_enabled = integrations.enabled()
    integrations.patch_all()
    try:
        # The rollout: samepath's generate (KV cache, left padding) and its log-probs of the drawn
        # tokens at the sampling temperature, carried as Python floats into verl's fp32
        # rollout_log_probs as verl's agent loop does with vLLM's logprobs.
        responses, rollout = harness.rollout_hf(model, prompts, 4, TEMPERATURE, seed=5)
        rollout_log_probs = torch.tensor(rollout.tolist(), dtype=torch.float32)

        def metrics() -> dict:
            batch = DataProto.from_dict(
                tensors={
                    "rollout_log_probs": rollout_log_probs,
                    "old_log_probs": _verl_actor_log_probs(engine, model, prompts, responses),
                    "responses": responses,
                    "response_mask": torch.ones_like(responses),
                }
            )
            return debug_metrics.calculate_debug_metrics(batch)

        with sp_verl.installed_for():
            patched = metrics()
        unpatched = metrics()  # negative control: verl's own temperature scaling and log-softmax
    finally:
        if not was_enabled:
            integrations.unpatch_all()
    assert patched["training/rollout_probs_diff_valid"] == 1
    for stat in ("max", "mean", "std"):
        assert patched[f"training/rollout_probs_diff_{stat}"] == 0.0, patched
    assert unpatched["training/rollout_probs_diff_max"] > 0, unpatched


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verl_fused_kernels_path_equals_the_rollout_with_samepath(verl_tf, backend):
    """verl's ``use_fused_kernels=True`` trainer path (its model forward hands the hidden states to
    ``FusedLinearForPPO`` for the torch backend, ``linear_cross_entropy`` for triton): with
    :func:`install` it runs samepath's fused lm_head + logprobs, so verl's debug metrics report
    ``rollout_probs_diff`` = 0 against samepath's rollout, without [tokens, vocab] logits. Negative
    control: verl's own fused torch path (bf16 log-probs) differs. Skipped without verl."""
    engine = _import_or_skip("verl.workers.engine.fsdp.transformer_impl")
    debug_metrics = _import_or_skip("verl.utils.debug.metrics")
    _import_or_skip("transformers")
    from verl import DataProto

    from samepath import integrations
    from samepath.check import harness
    from samepath.integrations import verl as sp_verl

    model = harness.load_default_model(torch.bfloat16, seed=3).model
    prompts = harness.random_prompts(3, model.config.vocab_size, seed=4, min_len=3, max_len=7)
    was_enabled = integrations.enabled()
    integrations.patch_all()
    try:
        responses, rollout = harness.rollout_hf(model, prompts, 4, TEMPERATURE, seed=5)
        rollout_log_probs = torch.tensor(rollout.tolist(), dtype=torch.float32)

        def metrics(chosen: str) -> dict:
            old = _verl_actor_log_probs(engine, model, prompts, responses, fused_backend=chosen)
            batch = DataProto.from_dict(
                tensors={
                    "rollout_log_probs": rollout_log_probs,
                    "old_log_probs": old.float(),
                    "responses": responses,
                    "response_mask": torch.ones_like(responses),
                }
            )
            return debug_metrics.calculate_debug_metrics(batch)

        with sp_verl.installed_for():
            fused = importlib.import_module("verl.utils.experimental.torch_functional").FusedLinearForPPO
            assert fused.forward is sp_verl.fused_linear_for_ppo_forward
            kernel = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
            assert kernel.linear_cross_entropy is sp_verl.linear_cross_entropy
            patched = metrics(backend)
        assert fused.forward is sp_verl.originals()["FusedLinearForPPO.forward"]
        assert kernel.linear_cross_entropy is sp_verl.originals()["linear_cross_entropy"]
        unpatched = metrics("torch")  # verl's own chunked torch path; its triton kernel needs CUDA
    finally:
        if not was_enabled:
            integrations.unpatch_all()
    assert patched["training/rollout_probs_diff_valid"] == 1
    for stat in ("max", "mean", "std"):
        assert patched[f"training/rollout_probs_diff_{stat}"] == 0.0, patched
    assert unpatched["training/rollout_probs_diff_max"] > 0, unpatched


def test_verl_linear_cross_entropy_refuses_what_it_does_not_compute():
    """Runs without verl: the replacements themselves."""
    from samepath.integrations import verl as sp_verl
    from samepath.kernels.matmul import linear

    hidden, weight = torch.randn(3, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (3,))
    with pytest.raises(ValueError, match="reduction must be 'none'"):
        sp_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "mean")
    with pytest.raises(ValueError, match="dist_process_group must be None"):
        sp_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none", object())
    with pytest.raises(ValueError, match="one temperature for the batch"):
        sp_verl.fused_linear_for_ppo_forward(None, hidden, weight, labels, torch.full((3,), 0.7))
    lp, entropy = sp_verl.linear_cross_entropy(hidden, weight, labels, 0.7)
    expected = token_logprobs(linear(hidden, weight), labels, 0.7, return_entropy=True)
    assert torch.equal(lp, expected[0]) and torch.equal(entropy, expected[1])


def test_verl_fused_forward_refuses_gemma2s_final_logit_cap(verl_tf):
    """verl's fused-kernel model forward feeds the hidden states to the fused lm_head without Gemma 2's
    final logit soft-capping: under samepath its decoder pass (``dense_common.forward_base_model``)
    refuses such a model by name; a model without a cap goes on to verl's own function."""
    import types

    dense_common = _import_or_skip("verl.models.transformers.dense_common")
    from samepath.integrations import verl as sp_verl

    original = dense_common.forward_base_model
    sp_verl.install()
    assert dense_common.forward_base_model is sp_verl.forward_base_model
    gemma2 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma2", final_logit_softcapping=30.0))
    with pytest.raises(NotImplementedError, match="use_fused_kernels=False"):
        dense_common.forward_base_model(gemma2, input_ids=None)
    calls = []
    sp_verl._ORIGINAL_BASE_MODEL[:] = [lambda self, *a, **k: calls.append(self)]
    qwen3 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3"))
    dense_common.forward_base_model(qwen3, input_ids=None)
    assert calls == [qwen3]
    sp_verl.uninstall()
    assert dense_common.forward_base_model is original


def test_importing_with_samepath_verl_set_patches_every_process_that_imports_verl():
    _import_or_skip("verl.utils.torch_functional")
    code = (
        "import verl.utils.torch_functional as tf\n"
        "from verl.workers.rollout.naive import naive_rollout\n"
        "from samepath import integrations\n"
        "from samepath.integrations import verl as sp\n"
        "assert integrations.enabled() and sp.installed()\n"
        "assert tf.logprobs_from_logits is sp.logprobs_from_logits\n"
        "assert naive_rollout.logprobs_from_logits is sp.logprobs_from_logits\n"
        "print('patched')\n"
    )
    env = dict(os.environ, SAMEPATH_VERL="1", VERL_USE_EXTERNAL_MODULES="samepath.integrations.verl")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "patched" in done.stdout, done.stderr[-3000:]
    # Without the variable importing the module changes nothing.
    env.pop("SAMEPATH_VERL")
    check = code.replace("assert integrations.enabled() and sp.installed()", "assert not sp.installed()")
    check = check.split("assert tf.")[0] + "print('untouched')\n"
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "untouched" in done.stdout, done.stderr[-3000:]


def test_verl_metrics_are_zero_at_every_rl_step_of_samepath_rl():
    """samepath.rl's GRPO loop (HF generate rollout synced by state-dict copy, fp32-master trainer):
    verl's own ``calculate_debug_metrics`` on each step's rollout and trainer log-probs reports
    ``rollout_probs_diff_max/mean/std`` = 0 at every synced step, and its rollout-correction
    metrics ``rollout_corr/k3_kl`` and ``rollout_corr/kl`` = 0; at the step after the pushes stop
    (the negative control) they are nonzero."""
    debug_metrics = _import_or_skip("verl.utils.debug.metrics")
    rollout_corr = _import_or_skip("verl.trainer.ppo.rollout_corr_helper")
    transformers = _import_or_skip("transformers")
    from verl import DataProto

    from samepath.check.harness import DEFAULT_MODEL_CONFIG
    from samepath.rl import CopyTask, HFRollout, Trainer, numerics, run_grpo

    pairs = []

    class RecordingTrainer(Trainer):
        def step(self, prompts, completions, rollout_logprobs, advantages, mask=None):
            trainer_logprobs, loss = super().step(prompts, completions, rollout_logprobs, advantages, mask)
            pairs.append((completions, rollout_logprobs, trainer_logprobs))
            return trainer_logprobs, loss

    config = {**DEFAULT_MODEL_CONFIG, "num_hidden_layers": 1, "vocab_size": 128, "hidden_size": 32}
    config |= {"intermediate_size": 48, "head_dim": 16, "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    task = CopyTask(config["vocab_size"], num_prompts=2, min_len=2, max_len=4, seed=1)
    with numerics("samepath"):
        trainer = RecordingTrainer(model, "fp32_master")
        run_grpo(trainer, HFRollout.for_trainer(trainer), task, steps=4, group_size=2, new_tokens=3, sync_steps=2)
    reports = []
    for completions, rollout_logprobs, trainer_logprobs in pairs:
        batch = DataProto.from_dict(
            tensors={
                # verl's agent loop carries vLLM's log-probs as Python floats into fp32.
                "rollout_log_probs": torch.tensor(rollout_logprobs.tolist(), dtype=torch.float32),
                "old_log_probs": trainer_logprobs,
                "responses": completions,
                "response_mask": torch.ones_like(completions),
            }
        )
        report = debug_metrics.calculate_debug_metrics(batch)
        # verl's rollout-correction metrics (the recipe's default rollout_correction block, no reweighting).
        _, corr = rollout_corr.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": None})
        report |= corr
        reports.append(report)
    for step, report in enumerate(reports[:3]):
        assert report["training/rollout_probs_diff_valid"] == 1
        for stat in ("max", "mean", "std"):
            assert report[f"training/rollout_probs_diff_{stat}"] == 0.0, (step, report)
        assert report["rollout_corr/k3_kl"] == 0.0 and report["rollout_corr/kl"] == 0.0, (step, report)
    assert reports[3]["training/rollout_probs_diff_max"] > 0, reports[3]
    assert reports[3]["rollout_corr/k3_kl"] > 0, reports[3]


def test_verl_grpo_samepath_recipe_keys_are_verls():
    """recipes/verl_grpo_samepath: every override names a key of the installed verl's trainer config
    (a key without ``+`` must exist there) and resolves to the value the recipe relies on; with Hydra
    installed, verl's own ``validate_config`` and typed configs accept it. Negative control: a key
    verl does not have is refused."""
    _import_or_skip("verl.utils.config")
    sys.path.insert(0, str(ROOT / "recipes" / "verl_grpo_samepath"))
    try:
        import check_config
    finally:
        sys.path.pop(0)
    import samepath

    overrides = check_config.read_overrides(samepath.fingerprint())
    assert not any("${" in line for line in overrides)
    config = check_config.compose(overrides)
    from omegaconf import OmegaConf

    for key, value in check_config.EXPECTED.items():
        assert OmegaConf.select(config, key) == value, key
    assert OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars.SAMEPATH_EXPECT_FINGERPRINT") == (
        samepath.fingerprint()
    )
    with pytest.raises(KeyError, match="use_remove_paddings"):
        check_config.compose([*overrides, "actor_rollout_ref.model.use_remove_paddings=True"])
    if importlib.util.find_spec("hydra") is None:
        pytest.skip("Hydra is not installed: verl's validate_config and typed configs not run")
    assert check_config.main([]) == 0
