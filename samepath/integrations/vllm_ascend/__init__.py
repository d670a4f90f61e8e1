"""vllm-ascend: samepath inside vLLM on Ascend NPUs.

:func:`install` puts vllm-ascend's attention, norms, rotary, SiLU·mul, linear layers, MoE and the
sampler's log-probs on samepath's kernels (every original recorded; :func:`uninstall` restores
them). Like :mod:`samepath.integrations.vllm`, it must run before the model is built, in every
vLLM process: the ``vllm.general_plugins`` entry point (``SAMEPATH_VLLM=1``) calls it when
vllm-ascend is the platform.

Written against vllm-ascend **0.18.x and 0.23.x** (the PyPI releases 0.18.0, 0.23.0 and
0.23.0.post1, the latest when written; v0.23.0 is git commit
``5cb98caaadeff42b5b62b996e34bb2aaa29d20fd``). :func:`install` refuses any other major.minor
version, and any installation that lacks one of the classes, methods or metadata fields it replaces
or reads (:data:`REQUIRED_API`) or whose replaced methods take other leading parameters
(:mod:`~samepath.integrations.vllm_ascend.compat`), with :class:`UnsupportedVllmAscendError` —
before patching anything. Within those releases the optional patch points (FA3 attention, the
KV-pool fence, the sampler's) are chosen by what the installed tree has
(:func:`detect_features`), not by the version number. vllm-ascend's main branch (commit
``182b75ea84ff13ece27b57391331ef8935410aea``) has already moved the unquantized MoE method out of
``ops/fused_moe/fused_moe.py``; it is refused until checked. :func:`install` also sets (or refuses)
the Ascend determinism environment (``HCCL_DETERMINISTIC=strict``, ``LCCL_DETERMINISTIC=1``,
``VLLM_ASCEND_ENABLE_NZ=0``; :class:`DeterminismEnvError`).

What :func:`install` replaces:

* **Attention** — ``AscendAttentionBackendImpl.forward_impl`` (and ``AscendFAImpl.forward_impl``
  when ``vllm_ascend.attention.fa3_v1`` imports): :func:`paged_attention_from_metadata`, i.e.
  :func:`samepath.paged_attention` over vllm-ascend's own caches (K and V each
  ``[num_blocks, block_size=128, num_kv_heads, head_size]``, samepath's layout) with the
  ``AscendMetadata`` translated by :func:`paged_inputs`. One launch covers decodes, chunked
  prefills and prefix-cache hits in every ``AscendAttentionState``; the decode/prefill split and
  the ``_npu_paged_attention`` / ``npu_fused_infer_attention_score`` choice no longer matter.
  The KV write stays vllm-ascend's (``AscendAttentionBackendImpl.reshape_and_cache`` before
  ``forward_impl``: ``_npu_reshape_and_cache`` or, on A5, ``npu_scatter_pa_kv_cache`` in
  ``"Norm"`` mode — an exact scatter into the same ND layout, with the same slot arithmetic as
  :func:`samepath.write_kv_cache`), so vllm-ascend's KV-sharing and KV-transfer fences stay intact.
  Decoder self-attention only; ALiBi, sinks, a quantized KV cache, Hamming-sparse attention and
  torch.compile are refused with a clear error. Encoder / cross attention keep vllm-ascend's path.
  ACL graphs (``FULL_DECODE_ONLY`` / ``FULL`` without compilation): ``AscendAttentionMetadataBuilder.build``
  also fills samepath's fixed-size metadata buffers on the device, the captured kernels read only those,
  and ``update_graph_params`` has nothing to re-point (:mod:`~samepath.integrations.vllm_ascend.graph`).
* **RMSNorm** — ``AscendRMSNorm.forward_oot``: the fused add + norm (``torch.ops._C_ascend.
  npu_add_rms_norm_bias``, vllm-ascend's default when its custom ops are built, or
  ``npu_add_rms_norm``) becomes ``s = x + residual`` rounded to the model dtype, then the norm of
  ``s`` (:func:`samepath.rms_norm` with ``residual``, Hugging Face's rounding); ``npu_rms_norm``
  becomes :func:`samepath.rms_norm`, followed by vllm-ascend's MLP weight-prefetch post-process
  step as in the original. Norms with a bias (anti-outlier quantization), without a weight or with
  a partial variance are refused at their first call (``SAMEPATH_ALLOW_UNCOVERED`` opts out).
* **Rotary** — ``AscendRotaryEmbedding.forward_oot``, ``AscendYaRNRotaryEmbedding.forward_oot`` and
  vLLM's ``RotaryEmbeddingBase.forward`` (llama3, linear, dynamic NTK, longrope, which vllm-ascend
  does not override): cos/sin from :func:`samepath.rotary_cos_sin` with Hugging Face's parameters
  (:func:`samepath.integrations.vllm.vllm_rope`), the rotation by :func:`samepath.apply_rotary`.
  GPT-J style and unmapped rope types (mrope, DeepSeek, ...) are refused.
* **SiLU·mul** — ``AscendSiluAndMul.forward_oot`` (``npu_swiglu``): :func:`samepath.swiglu`.
* **Linear** — ``AscendUnquantizedLinearMethod``: the weight stays ND (no FRACTAL_NZ cast) and
  ``apply`` runs :func:`samepath.linear`; vLLM's ``UnquantizedEmbeddingMethod.apply`` (the lm_head)
  too. :func:`samepath.batch_invariant` is entered for the whole process.
* **MoE** — ``AscendUnquantizedFusedMoEMethod``: plain SwiGLU experts keep their loaded
  ``[E, 2I, H]`` / ``[E, H, I]`` weights (no transpose, no NZ cast), and ``apply`` runs Hugging
  Face's top-k softmax router and expert loop (:mod:`samepath.integrations.moe`) in place of
  ``npu_moe_gating_top_k`` / ``npu_moe_gating_top_k_softmax`` and the grouped matmuls. Grouped
  top-k, non-softmax scoring, score-correction bias, shared or zero experts, expert parallelism,
  tensor parallelism and dynamic EPLB are refused with a clear error.
* **Sampler log-probs** — vLLM's ``Sampler.compute_logprobs`` (``AscendSampler`` inherits it):
  :func:`samepath.log_softmax` of the raw logits in fp32 (``raw_logprobs``, temperature 1). The
  trainer's equal is ``samepath.logprobs(logits, tokens)``.
* **Sampling edits** (``processed_logprobs``) — ``AscendSampler.apply_penalties``, vllm-ascend's
  module-level ``apply_top_k_top_p`` and vLLM's min-p processor through the functions
  ``samepath.processed_logprobs`` runs (:mod:`~samepath.integrations.vllm_ascend.sampler`); the
  reduce-sample top-k is refused; where a patch point is missing the edits are refused per request.

**Load-time audit** — every vLLM model loader's ``load_model`` (patch group ``model_audit``, the
vLLM plugin's loader hook with ``side="vllm-ascend"``) refuses the V2 model runner's config and
classifies each module of the built model with :func:`ascend_rules` — vLLM's ``CustomOp`` OOT
registration builds vllm-ascend's subclasses (``AscendRMSNorm``, ``AscendSiluAndMul``, the
``Ascend*Linear`` layers with ``AscendUnquantizedLinearMethod``, ``AscendParallelLMHead``,
``AscendFusedMoE`` / ``AscendMoERunner``, vLLM's ``Attention`` around ``AscendAttentionBackendImpl``),
so those are the exact classes samepath covers here. A module without a rule (``AscendGemmaRMSNorm``,
MLA, a linear layer on a vllm-ascend parallel op or with weights samepath did not process, a norm
with a bias or another epsilon than the config's, an impl samepath did not patch, ...) refuses the
load by name; ``SAMEPATH_ALLOW_UNCOVERED`` opts out (warned, recorded in the fingerprint). The
rules were read from vllm-ascend v0.23.0.post1's source and are tested on stand-in subclasses of
vLLM's real layers; the gate has not run against a real vllm-ascend.

``VLLM_BATCH_INVARIANT=1`` (vllm-ascend's own batch-invariant mode) is refused: its ``aten::mm`` /
``matmul`` / ``sum`` / ``softmax`` registrations and its ``npu_add_rms_norm`` patch would collide
with samepath's, and whichever registered last would win.

Limits: eager mode or ACL graphs without torch.compile (``compilation_config`` ``mode=0`` with
``cudagraph_mode`` ``FULL_DECODE_ONLY`` / ``FULL``; vllm-ascend's compile passes would fuse qk-norm + rope
and add + RMSNorm behind the patched ops, so ``VLLM_COMPILE`` / PIECEWISE is refused), vLLM's
V1 model runner (``VLLM_USE_V2_MODEL_RUNNER`` set to anything but ``0`` is refused; unset, install sets
it to ``0``: the V2 runner has its own log-prob kernel),
no prefill/decode context parallelism (those impl classes override ``forward_impl``) and not the
310P path (``vllm_ascend._310p``, NZ caches). None of this has run on an NPU yet: the metadata
translation and the numerics are tested on the CPU (``tests/test_integration_vllm_ascend.py``);
install / uninstall against a real vllm-ascend and the rollout-vs-trainer logdiff await an NPU.

The package, by room: :mod:`~samepath.integrations.vllm_ascend.plugin` (:func:`install` /
:func:`uninstall`), :mod:`~samepath.integrations.vllm_ascend.compat` (the versions and API checked),
:mod:`~samepath.integrations.vllm_ascend.metadata` (the request layout from host values),
:mod:`~samepath.integrations.vllm_ascend.attention` (the metadata translation and ``forward_impl``),
:mod:`~samepath.integrations.vllm_ascend.graph` (ACL graph mode: the fixed-size device metadata),
:mod:`~samepath.integrations.vllm_ascend.layers` (norms, rotary, SiLU·mul, linear, MoE),
:mod:`~samepath.integrations.vllm_ascend.sampler`, :mod:`~samepath.integrations.vllm_ascend.loader`
(the load-time audit rules) and :mod:`~samepath.integrations.vllm_ascend.state` (what is installed,
the originals replaced). It reuses the vLLM plugin's shared pieces
(:mod:`samepath.integrations.vllm`: the environment, the custom ops, rotary, the loader hook).
"""

from __future__ import annotations

from samepath.integrations.vllm.env import FINGERPRINT_ENV_VAR
from samepath.integrations.vllm_ascend.attention import PagedInputs, paged_attention_from_metadata, paged_inputs
from samepath.integrations.vllm_ascend.compat import (
    METADATA_FIELDS,
    REQUIRED_API,
    SOURCE_REF,
    SUPPORTED_VERSIONS,
    UnsupportedVllmAscendError,
    check_compatibility,
    detect_features,
    installed_version,
)
from samepath.integrations.vllm_ascend.determinism import DETERMINISM_ENV, DeterminismEnvError
from samepath.integrations.vllm_ascend.loader import ascend_rules, expected_fingerprint, patch_ascend_model_loader
from samepath.integrations.vllm_ascend.plugin import install, uninstall
from samepath.integrations.vllm_ascend.state import INSTALLED, ORIGINALS, installed

__all__ = [
    "DETERMINISM_ENV",
    "FINGERPRINT_ENV_VAR",
    "INSTALLED",
    "METADATA_FIELDS",
    "ORIGINALS",
    "REQUIRED_API",
    "SOURCE_REF",
    "SUPPORTED_VERSIONS",
    "DeterminismEnvError",
    "PagedInputs",
    "UnsupportedVllmAscendError",
    "ascend_rules",
    "check_compatibility",
    "detect_features",
    "expected_fingerprint",
    "install",
    "installed",
    "installed_version",
    "paged_attention_from_metadata",
    "paged_inputs",
    "patch_ascend_model_loader",
    "uninstall",
]
