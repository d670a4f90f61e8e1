"""Llama (``model_type="llama"``): RMSNorm, SiLU·mul, one rope (every rope type samepath resolves)."""

from samepath.models.descriptor import ModelFamily

FAMILY = ModelFamily(
    model_types=("llama",),
    hf_module="transformers.models.llama.modeling_llama",
    hf_prefix="Llama",
    vllm_module="vllm.model_executor.models.llama",
    vllm_structure=("LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer"),
    vllm_attention="LlamaAttention",
    vllm_mlp=("LlamaMLP",),
)
