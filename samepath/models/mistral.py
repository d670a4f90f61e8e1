"""Mistral (``model_type="mistral"``): Llama's modules (vLLM: mistral.py, a LlamaModel) with the
config's sliding window."""

from samepath.models.descriptor import ModelFamily

FAMILY = ModelFamily(
    model_types=("mistral",),
    hf_module="transformers.models.mistral.modeling_mistral",
    hf_prefix="Mistral",
    sliding_window_by_default=True,
    vllm_module="vllm.model_executor.models.mistral",
    vllm_structure=("MistralForCausalLM", "MistralModel", "MistralDecoderLayer"),
    # MistralAttention: LlamaAttention's forward plus llama_4_scaling, which the formulas refuse.
    vllm_attention="MistralAttention",
    vllm_mlp=("vllm.model_executor.models.llama:LlamaMLP",),
)
