"""Qwen2 (``model_type="qwen2"``): Llama's formulas; a sliding window only with ``use_sliding_window``."""

from samepath.models.descriptor import ModelFamily

FAMILY = ModelFamily(
    model_types=("qwen2",),
    hf_module="transformers.models.qwen2.modeling_qwen2",
    hf_prefix="Qwen2",
    vllm_module="vllm.model_executor.models.qwen2",
    vllm_structure=("Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer"),
    vllm_attention="Qwen2Attention",
    vllm_mlp=("Qwen2MLP",),
)
