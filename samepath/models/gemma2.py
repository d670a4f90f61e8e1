"""Gemma 2 (``model_type="gemma2"``, ``Gemma2ForCausalLM``): (1 + weight) fp32 norms (four per layer),
GELU-tanh·mul, a scaled embedding, ``query_pre_attn_scalar``, alternating sliding / full layers
(``config.layer_types``) with one rope, attention logit soft-capping (``attn_logit_softcapping``:
``cap * tanh(s / cap)`` on the scores inside samepath's attention kernels, every caller) and final logit
soft-capping (``final_logit_softcapping``: :func:`samepath.kernels.softcap.softcap_logits` on the
logits, Hugging Face's ``Gemma2ForCausalLM`` and vLLM's ``LogitsProcessor`` alike)."""

from __future__ import annotations

from typing import Any

from samepath.models.descriptor import GELU_TANH_MUL, GEMMA_NORM, ModelFamily
from samepath.models.gemma3_text import gemma_attention_problems


def config_problems(config: Any) -> list[str]:
    """Gemma 2 options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            problems.append(f"{key}={value!r} (a cap must be a positive number or None)")
    return problems + gemma_attention_problems(config)


FAMILY = ModelFamily(
    model_types=("gemma2",),
    hf_module="transformers.models.gemma2.modeling_gemma2",
    hf_prefix="Gemma2",
    norm_weight_mode=GEMMA_NORM,
    residual=(
        "the sublayer's output normed (post_attention / post_feedforward), added to the residual rounded to "
        "the dtype, then the next pre-norm"
    ),
    activation=GELU_TANH_MUL,
    sliding_window_by_default=True,
    query_pre_attn_scalar=True,
    embedding_scale=True,
    layer_types=True,
    softcap=True,
    config_problems=config_problems,
    # Gemma2Model's own code also scales the embeddings (its ``normalizer``: checked separately); the
    # LogitsProcessor soft-caps the logits (soft_cap, checked against the config).
    vllm_module="vllm.model_executor.models.gemma2",
    vllm_structure=("Gemma2ForCausalLM", "Gemma2Model", "Gemma2DecoderLayer"),
    # Gemma2Attention: the rope, its layer's window, logits_soft_cap on its Attention.
    vllm_attention="Gemma2Attention",
    vllm_mlp=("Gemma2MLP",),
)
