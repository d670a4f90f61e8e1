"""Gemma 3 text (``model_type="gemma3_text"``, ``Gemma3ForCausalLM``): (1 + weight) fp32 norms (four
per layer, and q/k), GELU-tanh·mul, a scaled embedding, ``query_pre_attn_scalar``, alternating
sliding / full layers with a rope per layer type."""

from __future__ import annotations

from typing import Any

from samepath.models.descriptor import GELU_TANH_MUL, GEMMA_NORM, PER_LAYER_TYPE_ROPE, ModelFamily


def config_problems(config: Any) -> list[str]:
    """Gemma 3 text options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append(
            f"attn_logit_softcapping={config.attn_logit_softcapping} (attention logit soft-capping is refused by "
            "samepath's attention kernel)"
        )
    if getattr(config, "final_logit_softcapping", None) is not None:
        problems.append(
            f"final_logit_softcapping={config.final_logit_softcapping} (tanh soft-capping of the logits: samepath's "
            "log-probs take the raw lm_head logits on both sides)"
        )
    return problems + gemma_attention_problems(config)


def gemma_attention_problems(config: Any) -> list[str]:
    """The attention and layer-type options of a Gemma text config (Gemma 2 and 3 alike) outside
    samepath's formulas."""
    problems = []
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (samepath's attention is causal)")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True (q/k/v/o biases)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout={config.attention_dropout}")
    unknown = sorted(set(config.layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        problems.append(f"layer types {unknown}")
    return problems


FAMILY = ModelFamily(
    model_types=("gemma3_text",),
    hf_module="transformers.models.gemma3.modeling_gemma3",
    hf_prefix="Gemma3",
    norm_weight_mode=GEMMA_NORM,
    qk_norm=True,
    residual=(
        "the sublayer's output normed (post_attention / post_feedforward), added to the residual rounded to "
        "the dtype, then the next pre-norm"
    ),
    activation=GELU_TANH_MUL,
    rope=PER_LAYER_TYPE_ROPE,
    sliding_window_by_default=True,
    query_pre_attn_scalar=True,
    embedding_scale=True,
    config_problems=config_problems,
    # Gemma3Model's own code also scales the embeddings (its ``normalizer``: checked separately).
    vllm_module="vllm.model_executor.models.gemma3",
    vllm_structure=("Gemma3ForCausalLM", "Gemma3Model", "Gemma3DecoderLayer"),
    # Gemma3Attention: q/k norms (GemmaRMSNorm) on the heads, the rope of its layer type, its window.
    vllm_attention="Gemma3Attention",
    vllm_mlp=("Gemma3MLP",),
)
