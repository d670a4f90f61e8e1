"""Qwen3-Next (``model_type="qwen3_next"``, ``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet linear
attention and gated full attention (``config.layer_types``), zero-centred ``1 + weight`` fp32 RMSNorms, and
MoE layers with a sigmoid-gated shared expert.

* Gated DeltaNet layers: the projections, the short causal conv1d with SiLU
  (:mod:`samepath.kernels.causal_conv1d`), the gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` (:func:`samepath.kernels.gated_ops.gated_delta_gates`), the chunked delta rule
  anchored at each sequence's first token (:mod:`samepath.kernels.gated_delta`) and the gated output norm
  (:func:`samepath.kernels.gated_ops.gated_rms_norm`); ``generate``'s cache keeps the conv state, the
  boundary state and the ``< C`` tokens since it (:mod:`samepath.integrations.hf_linear_attention`).
* Full-attention layers: q/k norms, partial rotary (``partial_rotary_factor``), samepath's attention, and
  the output gate ``out * sigmoid(gate)`` (:func:`samepath.kernels.gated_ops.sigmoid_gate`).
* MoE: fp32 softmax top-k (Qwen3-MoE's router), samepath's experts, plus the shared expert scaled by
  ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from typing import Any

from samepath.models.descriptor import GEMMA_NORM, SOFTMAX_TOPK, ModelFamily

#: The layer types of the hybrid families.
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


def hybrid_problems(config: Any) -> list[str]:
    """The Gated DeltaNet options outside samepath's formulas (shared by Qwen3-Next and Qwen3.5)."""
    problems = []
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
        problems.append(f"layer_types={types!r} (samepath runs linear_attention and full_attention layers)")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"hidden_act={config.hidden_act!r} (the conv1d's fused activation is SiLU)")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        value = getattr(config, key, None)
        if not isinstance(value, int) or not 1 <= value <= 256:
            problems.append(f"{key}={value!r} (the Gated DeltaNet kernel takes head sizes 1..256)")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        problems.append(
            f"linear_num_value_heads={config.linear_num_value_heads} not a multiple of "
            f"linear_num_key_heads={config.linear_num_key_heads}"
        )
    if not 1 <= int(getattr(config, "linear_conv_kernel_dim", 4)) <= 8:
        problems.append(f"linear_conv_kernel_dim={config.linear_conv_kernel_dim} (samepath's conv1d takes 1..8 taps)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout={config.attention_dropout}")
    return problems


def hybrid_formulas(config: Any) -> dict[str, Any]:
    """The hybrid families' own formula entries: the layer types and the Gated DeltaNet layer's pieces."""
    from samepath.kernels.causal_conv1d import CAUSAL_CONV1D_FORMULA
    from samepath.kernels.config import GATED_DELTA_FORMULA
    from samepath.kernels.gated_ops import GATED_OPS_FORMULA

    return {
        "attention": {"layer_types": list(config.layer_types), "output_gate": GATED_OPS_FORMULA["sigmoid_gate"]},
        "linear_attention": {
            "conv1d": {"width": int(config.linear_conv_kernel_dim), **CAUSAL_CONV1D_FORMULA},
            "gates": GATED_OPS_FORMULA["gated_delta_gates"],
            "delta_rule": GATED_DELTA_FORMULA,
            "output_norm": GATED_OPS_FORMULA["gated_rms_norm"],
            "heads": [
                int(config.linear_num_key_heads),
                int(config.linear_num_value_heads),
                int(config.linear_key_head_dim),
                int(config.linear_value_head_dim),
            ],
        },
    }


def config_problems(config: Any) -> list[str]:
    problems = hybrid_problems(config)
    if config.num_experts > 0 and not getattr(config, "shared_expert_intermediate_size", 0):
        problems.append("shared_expert_intermediate_size=0 (Hugging Face's MoE block always has the shared expert)")
    return problems


FAMILY = ModelFamily(
    model_types=("qwen3_next",),
    hf_module="transformers.models.qwen3_next.modeling_qwen3_next",
    hf_prefix="Qwen3Next",
    norm_weight_mode=GEMMA_NORM,
    qk_norm=True,
    partial_rotary=True,
    moe=SOFTMAX_TOPK,
    linear_attention=True,
    attention_output_gate=True,
    shared_expert_gate=True,
    config_problems=config_problems,
    extra_formulas=hybrid_formulas,
    vllm_module="vllm.model_executor.models.qwen3_next",
    vllm_structure=("Qwen3NextForCausalLM", "Qwen3NextModel", "Qwen3NextDecoderLayer", "Qwen3NextSparseMoeBlock"),
    vllm_attention="Qwen3NextAttention",
    vllm_mlp=("vllm.model_executor.models.qwen2_moe:Qwen2MoeMLP",),
)
