"""Qwen3 (``model_type="qwen3"``): Llama's formulas plus RMSNorms on the query and key heads."""

from samepath.models.descriptor import ModelFamily

FAMILY = ModelFamily(
    model_types=("qwen3",),
    hf_module="transformers.models.qwen3.modeling_qwen3",
    hf_prefix="Qwen3",
    qk_norm=True,
    vllm_module="vllm.model_executor.models.qwen3",
    vllm_structure=("Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer"),
    vllm_attention="Qwen3Attention",
    vllm_mlp=("Qwen3MLP",),  # qwen2.Qwen2MLP there
)
