"""Qwen3.5's MoE text decoder (``model_type="qwen3_5_moe_text"``, ``Qwen3_5MoeForCausalLM``): Qwen3.5's
hybrid Gated DeltaNet / gated full attention layers (:mod:`samepath.models.qwen3_5_text`) with Qwen3-Next's MoE
blocks: fp32 softmax top-k (Qwen3-MoE's router), samepath's experts and a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Verified on the Hugging Face side only (see :mod:`samepath.models.qwen3_5_text`)."""

from __future__ import annotations

from typing import Any

from samepath.models.descriptor import SOFTMAX_TOPK, ModelFamily
from samepath.models.qwen3_5_text import HYBRID_COMMON
from samepath.models.qwen3_next import hybrid_problems


def config_problems(config: Any) -> list[str]:
    problems = hybrid_problems(config)
    if not getattr(config, "shared_expert_intermediate_size", 0):
        problems.append("shared_expert_intermediate_size=0 (Hugging Face's MoE block always has the shared expert)")
    return problems


FAMILY = ModelFamily(
    model_types=("qwen3_5_moe_text",),
    hf_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    hf_prefix="Qwen3_5Moe",
    vllm_module="vllm.model_executor.models.qwen3_5",
    **{**HYBRID_COMMON, "moe": SOFTMAX_TOPK, "shared_expert_gate": True, "config_problems": config_problems},
)
