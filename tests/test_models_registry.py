"""The model-family registry (samepath.models): every supported model type has one descriptor, the
refusals keep their words, and a new family is one descriptor that the formulas, the Hugging Face
patches and the fingerprint pick up without other edits."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import samepath
from samepath import models
from samepath.integrations import hf
from samepath.models import formulas, registry
from samepath.models.descriptor import (
    GELU_TANH_MUL,
    GEMMA_NORM,
    INTERLEAVED_MULTIMODAL_ROPE,
    PER_LAYER_TYPE_ROPE,
    SILU_MUL,
    ModelFamily,
    UnsupportedModelError,
)

#: What samepath supports today, by model type (a change here is a change of what samepath covers).
SUPPORTED = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "phi3",
    "mixtral",
    "gemma3_text",
    "glm4_moe",
    "qwen3_vl_text",
    "gemma2",
    "gpt_oss",
    "deepseek_v3",
}
REFUSED = {"olmo2", "granite", "gemma3", "deepseek_v2", "gpt2"}


def test_every_supported_model_type_has_one_descriptor_in_its_own_file():
    found = models.families()
    assert set(found) == SUPPORTED
    for model_type, descriptor in found.items():
        assert isinstance(descriptor, ModelFamily) and descriptor.name == model_type
        module = sys.modules[f"samepath.models.{model_type}"]  # one file per family, named after it
        assert module.FAMILY is descriptor
        assert registry.family(model_type) is descriptor
    assert set(hf.MODEL_TYPES) == SUPPORTED
    assert hf.MODEL_TYPES["gemma3_text"] == ("transformers.models.gemma3.modeling_gemma3", "Gemma3")
    assert set(hf.GELU_TANH_MLP) == {"gemma3_text", "gemma2"} and "llama" not in hf.GELU_TANH_MLP


def test_the_descriptors_say_what_each_family_computes():
    """The per-family choices that were tables and ``"gemma3_text"`` branches before the registry."""
    fam = models.families()
    assert {t for t, f in fam.items() if f.norm_weight_mode == GEMMA_NORM} == {"gemma3_text", "gemma2"}
    assert {t for t, f in fam.items() if f.activation == GELU_TANH_MUL} == {"gemma3_text", "gemma2"}
    assert {t for t, f in fam.items() if f.rope == PER_LAYER_TYPE_ROPE} == {"gemma3_text"}
    assert {t for t, f in fam.items() if f.qk_norm} == {"qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl_text"}
    assert {t for t, f in fam.items() if f.rope == INTERLEAVED_MULTIMODAL_ROPE} == {"qwen3_vl_text"}
    assert {t for t, f in fam.items() if f.fused_gate_up} == {"phi3"}
    assert {t: f.moe for t, f in fam.items() if f.moe} == {
        "qwen3_moe": "softmax_topk",
        "mixtral": "softmax_topk_fp32",
        "glm4_moe": "sigmoid_grouped_topk",
        "gpt_oss": "topk_softmax_biased",
        "deepseek_v3": "sigmoid_grouped_topk",
    }
    assert {t for t, f in fam.items() if f.partial_rotary} == {"glm4_moe"}
    assert {t for t, f in fam.items() if f.shared_experts} == {"glm4_moe", "deepseek_v3"}
    assert {t for t, f in fam.items() if f.mla} == {"deepseek_v3"}
    assert {t: f.hf_router for t, f in fam.items() if f.hf_router} == {
        "glm4_moe": "TopkRouter",
        "deepseek_v3": "TopkRouter",
        "gpt_oss": "TopKRouter",
    }
    assert {t for t, f in fam.items() if f.sliding_window_by_default} == {
        "mistral",
        "phi3",
        "mixtral",
        "gemma3_text",
        "gemma2",
        "gpt_oss",
    }
    assert {t for t, f in fam.items() if f.query_pre_attn_scalar or f.embedding_scale} == {"gemma3_text", "gemma2"}
    assert {t for t, f in fam.items() if f.softcap or f.layer_types} == {"gemma2"}
    assert {t for t, f in fam.items() if not f.dense_mlp} == {"mixtral", "gpt_oss"}
    assert {t for t, f in fam.items() if f.attention_sinks or f.norm_weight_mode == "fp32_weight"} == {"gpt_oss"}


def test_the_descriptors_name_the_vllm_classes_the_load_audit_uses():
    """The load audit's per-family vLLM tables are read from the descriptors."""
    from samepath import audit

    for model_type, descriptor in models.families().items():
        assert audit.VLLM_STRUCTURE[model_type] == (descriptor.vllm_module, descriptor.vllm_structure)
        attention_mlp = (descriptor.vllm_module, descriptor.vllm_attention, descriptor.vllm_mlp)
        assert audit.VLLM_ATTENTION_MLP[model_type] == attention_mlp


#: Today's refusal of each refused family, word for word (samepath.integrations.formulas.REFUSED
#: before the registry).
REFUSAL_STARTS = {
    "olmo2": "vLLM 0.32 runs Olmo2ForCausalLM through its Transformers backend",
    "granite": "Granite's embedding_multiplier, residual_multiplier and logits_scaling",
    "gemma3": "Gemma3ForConditionalGeneration is multimodal",
    "deepseek_v2": "DeepSeek-V2 uses multi-head latent attention",
    "gpt2": "GPT-2 is not Llama-shaped",
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refusals_keep_their_messages(model_type):
    reason = models.refusals()[model_type]
    assert reason.startswith(REFUSAL_STARTS[model_type])
    supported = ", ".join(sorted(SUPPORTED))
    message = f"model_type {model_type!r} is not supported: {reason} (supported: {supported})"
    assert models.refusal_reason(model_type) == message == formulas.unsupported_reason(model_type)
    assert formulas.REFUSED[model_type] == reason
    with pytest.raises(UnsupportedModelError) as refused:
        models.family(model_type)
    assert str(refused.value) == message
    with pytest.raises(UnsupportedModelError) as refused:
        formulas.model_formulas(types.SimpleNamespace(model_type=model_type))
    assert str(refused.value) == message


def test_an_unknown_model_type_gets_the_generic_refusal():
    supported = ", ".join(sorted(SUPPORTED))
    assert models.refusal_reason("bert") == (
        "model_type 'bert' is not covered by samepath on both the trainer and the rollout side "
        f"(supported: {supported})"
    )
    assert models.find("bert") is None and models.find(None) is None
    assert set(models.refusals()) == REFUSED and not set(models.refusals()) & SUPPORTED


def test_a_model_type_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        models.register(dataclasses.replace(models.family("llama")))
    with pytest.raises(ValueError, match="already registered"):
        models.register(dataclasses.replace(models.family("llama"), model_types=("gemma3",)))
    with pytest.raises(ValueError, match="norm_weight_mode"):
        dataclasses.replace(models.family("llama"), norm_weight_mode="fp32_weight_after_cast")


# ----------------------------------------------------------------------------------------------
# A new family is one descriptor
# ----------------------------------------------------------------------------------------------


def _toy_modeling() -> types.ModuleType:
    """A stand-in transformers modeling module of a family samepath has never heard of."""
    modeling = types.ModuleType("samepath_test_toy_modeling")

    class ToyRMSNorm(torch.nn.Module):
        def __init__(self, size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(size) * 0.1)
            self.eps = eps

        def forward(self, x):  # stock: never run while patched
            raise AssertionError("stock forward")

    class ToyMLP(torch.nn.Module):
        forward = ToyRMSNorm.forward

    class ToyRotaryEmbedding(torch.nn.Module):
        forward = ToyRMSNorm.forward

    modeling.ToyRMSNorm, modeling.ToyMLP, modeling.ToyRotaryEmbedding = ToyRMSNorm, ToyMLP, ToyRotaryEmbedding
    modeling.apply_rotary_pos_emb = lambda *args, **kwargs: None
    return modeling


TOY = ModelFamily(
    model_types=("samepath_toy",),
    hf_module="samepath_test_toy_modeling",
    hf_prefix="Toy",
    norm_weight_mode=GEMMA_NORM,
    activation=GELU_TANH_MUL,
    query_pre_attn_scalar=True,
    config_problems=lambda config: ["final_logit_softcapping"] if getattr(config, "final_logit_softcapping", 0) else [],
    vllm_module="vllm.model_executor.models.toy",
    vllm_structure=("ToyForCausalLM",),
    vllm_attention="ToyAttention",
    vllm_mlp=("ToyMLP",),
)


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(sys.modules, "samepath_test_toy_modeling", _toy_modeling())
    models.register(TOY)
    try:
        yield TOY
    finally:
        models.unregister(TOY)
    assert "samepath_toy" not in hf.MODEL_TYPES


def _toy_config(**extra):
    config = dict(
        model_type="samepath_toy",
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=64,
    )
    return types.SimpleNamespace(**{**config, **extra})


def test_a_new_family_is_one_descriptor_for_the_formulas_and_the_fingerprint(toy_family):
    assert "samepath_toy" in models.families() and models.family("samepath_toy") is toy_family
    assert "samepath_toy" in models.refusal_reason("bert")  # listed as supported
    resolved = formulas.model_formulas(_toy_config())
    assert resolved["model_type"] == "samepath_toy"
    assert resolved["norm"]["weight_mode"] == "fp32_one_plus_weight"
    assert resolved["activation"] == "gelu_pytorch_tanh·mul"
    assert resolved["attention"]["scale"] == 64**-0.5 and resolved["attention"]["sliding_window"] is None
    assert resolved["rope"]["rope_type"] == "default" and resolved["rope"]["rotary_dim"] == 16
    with pytest.raises(UnsupportedModelError, match="samepath_toy with final_logit_softcapping is not supported"):
        formulas.model_formulas(_toy_config(final_logit_softcapping=30.0))
    with pytest.raises(UnsupportedModelError, match="hidden_activation='gelu' is not supported for samepath_toy"):
        formulas.model_formulas(_toy_config(hidden_activation="gelu"))
    one = samepath.fingerprint(model_config=_toy_config())
    assert one == samepath.fingerprint() + "-" + formulas.model_fingerprint(_toy_config())
    assert one != samepath.fingerprint(model_config=_toy_config(rms_norm_eps=1e-5))


def test_a_new_family_is_one_descriptor_for_the_hugging_face_patches(toy_family):
    modeling = sys.modules["samepath_test_toy_modeling"]
    assert hf.MODEL_TYPES["samepath_toy"] == ("samepath_test_toy_modeling", "Toy")
    assert "samepath_toy" in hf.GELU_TANH_MLP
    stock = modeling.ToyRMSNorm.forward, modeling.ToyMLP.forward, modeling.ToyRotaryEmbedding.forward
    patcher = hf.Patcher()
    hf.apply_to_model_type("samepath_toy", patcher)
    try:
        assert modeling.ToyRMSNorm.forward is hf.RMS_NORM_FORWARDS["fp32_one_plus_weight"]
        assert hf.MLP_OPS[modeling.ToyMLP.forward] == "gelu_tanh_mul"
        assert modeling.apply_rotary_pos_emb is hf.samepath_apply_rotary_pos_emb
        norm = modeling.ToyRMSNorm(64)
        x = torch.randn(3, 64)
        want = samepath.rms_norm(x, norm.weight, norm.eps, weight_mode="fp32_one_plus_weight")
        assert torch.equal(norm(x), want)
    finally:
        patcher.restore()
    assert (modeling.ToyRMSNorm.forward, modeling.ToyMLP.forward, modeling.ToyRotaryEmbedding.forward) == stock


def test_patch_all_patches_a_registered_family(toy_family):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    from samepath import integrations

    modeling = sys.modules["samepath_test_toy_modeling"]
    stock = modeling.ToyRMSNorm.forward
    integrations.patch_all()
    try:
        assert modeling.ToyRMSNorm.forward is hf.RMS_NORM_FORWARDS["fp32_one_plus_weight"]
    finally:
        integrations.unpatch_all()
    assert modeling.ToyRMSNorm.forward is stock


def test_a_family_the_patches_cannot_serve_is_named():
    """A descriptor combination without a Hugging Face MLP patch is refused by name, not mispatched."""
    odd = dataclasses.replace(models.family("phi3"), model_types=("samepath_odd",), activation=GELU_TANH_MUL)
    with pytest.raises(ValueError, match="no Hugging Face MLP patch for gelu_tanh_mul with a fused gate_up_proj"):
        hf.mlp_forward_of(odd)
    assert SILU_MUL.accepted == ("silu", "swish")


def test_the_vllm_plugins_family_bits_come_from_the_descriptors():
    """The vLLM plugin's norm and activation patch groups are the ones the registered families ask for
    (a family without Gemma's norm and GELU leaves their groups out; a group the plugin lacks is an
    error naming it), and Phi-3's long-rope class is patched and audited because its descriptor names it."""
    from samepath.integrations.vllm import plugin

    fam = models.families()
    assert fam["gemma3_text"].vllm_patches() == ("gemma_rms_norm", "gelu_tanh_mul")
    assert fam["glm4_moe"].vllm_patches() == ("rms_norm", "silu_mul")
    assert fam["gpt_oss"].vllm_patches() == ("rms_norm",)  # norms marked at load; experts in the MoE patch
    assert {t for t, f in fam.items() if f.vllm_rotary_classes} == {"phi3"}
    names = [name for name, _ in plugin.patch_groups()]
    assert {"rms_norm", "gemma_rms_norm", "silu_mul", "gelu_tanh_mul"} <= set(names)
    gemmas = [models.family("gemma3_text"), models.family("gemma2")]
    for gemma in gemmas:
        models.unregister(gemma)
    try:
        names = [name for name, _ in plugin.patch_groups()]
        assert "gemma_rms_norm" not in names and "gelu_tanh_mul" not in names and "rms_norm" in names
    finally:
        for gemma in gemmas:
            models.register(gemma, replace=True)
    odd_act = dataclasses.replace(SILU_MUL, vllm_patch="relu2_mul")
    odd = models.register(
        dataclasses.replace(models.family("llama"), model_types=("samepath_odd2",), activation=odd_act)
    )
    try:
        with pytest.raises(ValueError, match="relu2_mul"):
            plugin.patch_groups()
    finally:
        models.unregister(odd)
