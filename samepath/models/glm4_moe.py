"""GLM-4.5 (``model_type="glm4_moe"``, ``Glm4MoeForCausalLM``): Llama-shaped attention with optional q/k
norms and partial rotary (the first ``head_dim * partial_rotary_factor`` dimensions rotate, rotate-half
pairs), dense SiLU·mul MLPs in the first ``first_k_dense_replace`` layers, then MoE layers: the sigmoid
router with the score-correction bias, grouped top-k and the routed scaling factor
(:func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing` on both sides), routed SwiGLU experts
weighted in fp32, plus shared experts (a dense MLP) added in the dtype."""

from __future__ import annotations

from typing import Any

from samepath.models.descriptor import SIGMOID_GROUPED_TOPK, ModelFamily


def config_problems(config: Any) -> list[str]:
    """GLM-4.5 options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    if not getattr(config, "n_shared_experts", None):
        problems.append(
            f"n_shared_experts={getattr(config, 'n_shared_experts', None)!r} (Hugging Face always builds the shared "
            "experts; vLLM drops them for None)"
        )
    return problems


FAMILY = ModelFamily(
    model_types=("glm4_moe",),
    hf_module="transformers.models.glm4_moe.modeling_glm4_moe",
    hf_prefix="Glm4Moe",
    partial_rotary=True,
    moe=SIGMOID_GROUPED_TOPK,
    hf_router="TopkRouter",
    shared_experts=True,
    config_problems=config_problems,
    # q/k norms are optional (use_qk_norm): the norms present are plain RMSNorms either way.
    vllm_module="vllm.model_executor.models.glm4_moe",
    vllm_structure=("Glm4MoeForCausalLM", "Glm4MoeModel", "Glm4MoeDecoderLayer", "Glm4MoE"),
    vllm_attention="Glm4MoeAttention",
    vllm_mlp=("Glm4MoeMLP",),
)
