"""GPT-OSS (``model_type="gpt_oss"``, ``GptOssForCausalLM``): attention sinks, sliding-window layers
alternating with full ones, YaRN rope, q/k/v/o biases, fp32-weight RMSNorm, and MoE experts with a
biased router (top-k of the logits, softmax over the k) and biased clamped-SwiGLU experts
(:mod:`samepath.kernels.clamped_swiglu`)."""

from __future__ import annotations

from typing import Any

from samepath.kernels.clamped_swiglu import CLAMPED_SWIGLU_FORMULA
from samepath.models.descriptor import CLAMPED_SWIGLU, FP32_WEIGHT_NORM, TOPK_SOFTMAX_BIASED, ModelFamily

#: The attention-sink formula (``samepath.kernels.attention``'s ``sinks``), recorded in the model formulas.
SINKS_FORMULA = (
    "each head's sink logit (fp32) starts every row's running softmax state: m = sink * log2(e), l = 1, acc = 0; "
    "segments merged into it in ascending order"
)


def alternating_layer_types(num_layers: int) -> list[str]:
    """GPT-OSS's layer types: sliding-window layers at even indices, full attention at odd ones (the
    pattern vLLM's ``OAIAttention`` hard-codes from the layer index)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def config_problems(config: Any) -> list[str]:
    """GPT-OSS options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types != alternating_layer_types(config.num_hidden_layers):
        problems.append(
            "layer_types other than sliding / full alternating from layer 0 (vLLM's GPT-OSS windows the even "
            "layers whatever layer_types says)"
        )
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout={config.attention_dropout}")
    if not getattr(config, "attention_bias", True):
        problems.append("attention_bias=False (vLLM's GPT-OSS always has q/k/v/o biases)")
    if float(getattr(config, "rms_norm_eps", 1e-5)) != 1e-5:
        problems.append(f"rms_norm_eps={config.rms_norm_eps} (vLLM's GPT-OSS norms use 1e-5)")
    return problems


def extra_formulas(config: Any) -> dict[str, Any]:
    """GPT-OSS's own formula entries: the experts' clamped SwiGLU and the sinks / layer types."""
    return {
        "activation": {
            "op": CLAMPED_SWIGLU.op,
            "limit": float(config.swiglu_limit),
            "alpha": float(config.swiglu_alpha),
            **CLAMPED_SWIGLU_FORMULA,
        },
        "attention": {"sinks": SINKS_FORMULA, "layer_types": list(config.layer_types)},
    }


FAMILY = ModelFamily(
    model_types=("gpt_oss",),
    hf_module="transformers.models.gpt_oss.modeling_gpt_oss",
    hf_prefix="GptOss",
    norm_weight_mode=FP32_WEIGHT_NORM,
    activation=CLAMPED_SWIGLU,
    dense_mlp=False,
    moe=TOPK_SOFTMAX_BIASED,
    hf_router="TopKRouter",
    sliding_window_by_default=True,
    attention_sinks=True,
    config_problems=config_problems,
    extra_formulas=extra_formulas,
    vllm_module="vllm.model_executor.models.gpt_oss",
    vllm_structure=("GptOssForCausalLM", "GptOssModel", "TransformerBlock"),
    vllm_attention="OAIAttention",
    vllm_mlp=("MLPBlock",),
)
