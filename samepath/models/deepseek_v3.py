"""DeepSeek-V3 (``model_type="deepseek_v3"``, ``DeepseekV3ForCausalLM``; Kimi-K2 is the same architecture):
multi-head latent attention (MLA) in :mod:`samepath.kernels.mla`'s absorbed form on both sides — the
query through ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or ``q_proj`` without ``q_lora_rank``), the latent
``kv_a_proj_with_mqa -> [c_kv, k_pe]`` with ``kv_a_layernorm`` on ``c_kv``, rope on ``q_pe`` / ``k_pe`` (GPT-J
interleaved pairs with ``rope_interleave``, the layout kept), ``W_UK`` absorbed into the query, one MQA over
``[c_kv, k_pe]`` at head size ``kv_lora_rank + qk_rope_head_dim``, ``W_UV`` on the output, ``o_proj``; dense
SiLU·mul MLPs in the first ``first_k_dense_replace`` layers, then MoE layers: sigmoid routing with the
score-correction bias, group-limited top-k, ``norm_topk_prob`` and the routed scaling factor (the GLM-4.5
router's formula, :func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing`), routed SwiGLU experts
weighted in fp32, plus shared experts added in the dtype; YaRN rope with ``mscale`` / ``mscale_all_dim``
(the softmax scale times ``mscale(factor, mscale_all_dim) ** 2``, :func:`mla_softmax_scale`).

Kimi-K2 checkpoints say ``model_type="kimi_k2"`` with remote code for the same modules (DeepSeek-V3's
attention, router with ``n_group=1``, experts); transformers has no such type: load the config as a
``DeepseekV3Config`` (``model_type="deepseek_v3"``), which is what vLLM runs it as
(``DeepseekV3ForCausalLM``)."""

from __future__ import annotations

import math
from typing import Any

from samepath.kernels.config import check_head_size
from samepath.kernels.mla import MLA_FORMULA
from samepath.models.descriptor import SIGMOID_GROUPED_TOPK, ModelFamily


def mla_softmax_scale(config: Any) -> float:
    """DeepSeek's softmax scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale * mscale`` with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` for a scaled rope with
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``, vLLM's ``DeepseekV2MLAAttention.scaling``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** (-0.5)
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = params["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


def config_problems(config: Any) -> list[str]:
    """DeepSeek-V3 options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    if not getattr(config, "n_shared_experts", None):
        problems.append(f"n_shared_experts={getattr(config, 'n_shared_experts', None)!r} (no shared experts)")
    latent = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    try:
        # The MLA attends at head size L + R (DeepSeek-V3 / Kimi-K2: 512 + 64 = 576, a wide head) with the
        # latent L as its value head.
        check_head_size(latent, "kv_lora_rank + qk_rope_head_dim")
        check_head_size(int(config.kv_lora_rank), "kv_lora_rank")
    except ValueError as exc:
        problems.append(f"{exc} (MLA attends over the latent [c_kv, k_pe] at that head size, c_kv as the value)")
    return problems


def extra_formulas(config: Any) -> dict[str, Any]:
    return {
        "attention": {
            "scale": mla_softmax_scale(config),
            "mla": {
                **MLA_FORMULA,
                "kv_lora_rank": int(config.kv_lora_rank),
                "q_lora_rank": None if config.q_lora_rank is None else int(config.q_lora_rank),
                "qk_nope_head_dim": int(config.qk_nope_head_dim),
                "qk_rope_head_dim": int(config.qk_rope_head_dim),
                "v_head_dim": int(config.v_head_dim),
                "rope_interleave": bool(getattr(config, "rope_interleave", True)),
            },
        },
    }


FAMILY = ModelFamily(
    model_types=("deepseek_v3",),
    hf_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    hf_prefix="DeepseekV3",
    moe=SIGMOID_GROUPED_TOPK,
    hf_router="TopkRouter",
    shared_experts=True,
    mla=True,
    config_problems=config_problems,
    extra_formulas=extra_formulas,
    # vLLM runs DeepseekV3ForCausalLM from its deepseek_v2 module (the MLA layer: samepath's vLLM MLA patch).
    vllm_module="vllm.model_executor.models.deepseek_v2",
    vllm_structure=("DeepseekV3ForCausalLM", "DeepseekV2Model", "DeepseekV2DecoderLayer", "DeepseekV2MoE"),
    vllm_attention="DeepseekV2MLAAttention",
    vllm_mlp=("DeepseekV2MLP",),
)
