"""Qwen3-MoE (``model_type="qwen3_moe"``): Qwen3's attention, top-k softmax experts whose routing
weights are cast to the activations' dtype (Hugging Face's ``TopKRouter``)."""

from samepath.models.descriptor import SOFTMAX_TOPK, ModelFamily

FAMILY = ModelFamily(
    model_types=("qwen3_moe",),
    hf_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    hf_prefix="Qwen3Moe",
    qk_norm=True,
    moe=SOFTMAX_TOPK,
    vllm_module="vllm.model_executor.models.qwen3_moe",
    vllm_structure=("Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeSparseMoeBlock"),
    vllm_attention="Qwen3MoeAttention",
    vllm_mlp=("Qwen3MoeMLP",),
)
