"""Phi-3 (``model_type="phi3"``): Llama's modules with fused q/k/v and gate/up projections (vLLM:
phi3.py, a LlamaForCausalLM) and the config's sliding window."""

from samepath.models.descriptor import ModelFamily

FAMILY = ModelFamily(
    model_types=("phi3",),
    hf_module="transformers.models.phi3.modeling_phi3",
    hf_prefix="Phi3",
    fused_gate_up=True,
    sliding_window_by_default=True,
    # vLLM's Phi3ForCausalLM is a LlamaForCausalLM (fused qkv / gate_up weights loaded into Llama's modules).
    vllm_module="vllm.model_executor.models.llama",
    vllm_structure=("LlamaModel", "LlamaDecoderLayer", "vllm.model_executor.models.phi3:Phi3ForCausalLM"),
    vllm_attention="LlamaAttention",
    vllm_mlp=("LlamaMLP",),
    # Its longrope layer is not a RotaryEmbeddingBase: patched and audited by name.
    vllm_rotary_classes=("vllm.model_executor.layers.rotary_embedding:Phi3LongRoPEScaledRotaryEmbedding",),
)
