"""Mixtral (``model_type="mixtral"``): Mistral's attention with top-k softmax experts whose routing
weights stay in fp32 (vLLM: mixtral.py); no dense MLP."""

from samepath.models.descriptor import SOFTMAX_TOPK_FP32, ModelFamily

FAMILY = ModelFamily(
    model_types=("mixtral",),
    hf_module="transformers.models.mixtral.modeling_mixtral",
    hf_prefix="Mixtral",
    dense_mlp=False,
    moe=SOFTMAX_TOPK_FP32,
    sliding_window_by_default=True,
    vllm_module="vllm.model_executor.models.mixtral",
    vllm_structure=("MixtralForCausalLM", "MixtralModel", "MixtralDecoderLayer", "MixtralMoE"),
    vllm_attention="MixtralAttention",
    vllm_mlp=(),
)
