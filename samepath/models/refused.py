"""The model types samepath refuses, and why: the same words on every side (``patch_all(model)``, the
vLLM plugin's load audit, ``samepath check`` / ``audit``). Decided from what each architecture's
modules compute in transformers 5 and vLLM, not from its name. A type that is neither here nor a
family of :mod:`samepath.models` is refused with a generic reason
(:func:`samepath.models.registry.refusal_reason`)."""

#: model_type -> why samepath refuses it.
REFUSALS: dict[str, str] = {
    "olmo2": (
        "vLLM 0.32 runs Olmo2ForCausalLM through its Transformers backend, whose fusers swap the model's norms, "
        "projections and attention for vLLM layers found from the modules' dataflow; samepath's vLLM plugin does "
        "not patch or audit that backend. Olmo2RMSNorm's fp32 weight multiply before the cast is samepath's "
        "rms_norm weight_mode='fp32_weight', but its q/k norms run over all heads at once (under tensor "
        "parallelism a norm across ranks), which samepath's vLLM coverage does not include"
    ),
    "granite": (
        "Granite's embedding_multiplier, residual_multiplier and logits_scaling are elementwise ops of the model "
        "classes that samepath does not run: vLLM multiplies the logits by 1/logits_scaling where Hugging Face "
        "divides (the same bits only for a power of two), and vLLM's torch.compile may fuse "
        "residual + h * residual_multiplier without Hugging Face's rounding between the multiply and the add"
    ),
    "gemma3": (
        "Gemma3ForConditionalGeneration is multimodal (a SigLIP vision tower, bidirectional attention over image "
        "tokens), which samepath does not implement; the text-only Gemma3ForCausalLM (model_type gemma3_text) "
        "is supported"
    ),
    "deepseek_v2": (
        "DeepSeek-V2 uses multi-head latent attention (low-rank compressed KV with rope on a slice of each head) "
        "and softmax group-limited greedy routing with shared experts; samepath implements the attention "
        "(model_type deepseek_v3) but not V2's routing"
    ),
    "gpt2": (
        "GPT-2 is not Llama-shaped: LayerNorm, a GELU MLP, learned absolute positions and Conv1D projections; "
        "none is implemented"
    ),
}
