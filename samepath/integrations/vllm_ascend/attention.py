"""vllm-ascend's attention on samepath: ``AscendMetadata`` translated (:func:`paged_inputs`) and
attended by :func:`samepath.paged_attention` (:func:`paged_attention_from_metadata`), the patched
``forward_impl`` of ``AscendAttentionBackendImpl`` / ``AscendFAImpl``."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import StepCache
from samepath.integrations.vllm_ascend import graph
from samepath.integrations.vllm_ascend.compat import ATTENTION_MODULE
from samepath.integrations.vllm_ascend.metadata import HostLayout, host_layout
from samepath.integrations.vllm_ascend.state import original, set_original
from samepath.kernels.attention import LaunchPlan, paged_attention


@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """:func:`samepath.paged_attention`'s inputs for the real (unpadded) requests of a batch.

    ``query_start_loc`` ``[num_seqs + 1]`` and ``seq_lens`` ``[num_seqs]`` int32 on the target
    device; ``block_table`` the first ``num_seqs`` rows of ``AscendMetadata.block_tables``;
    ``slot_mapping`` its first ``num_tokens`` entries (the KV write's slots, for
    :func:`samepath.write_kv_cache`); ``num_tokens`` the real query tokens (padding excluded).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor | None
    num_tokens: int
    num_seqs: int
    causal: bool

    @functools.cached_property
    def plan(self) -> LaunchPlan:
        """The :class:`~samepath.kernels.attention.LaunchPlan` of ``query_start_loc``, built on first use."""
        return LaunchPlan(self.query_start_loc, self.num_tokens)


def paged_inputs(attn_metadata: Any, device: torch.device | str | None = None) -> PagedInputs:
    """Translate vllm-ascend's ``AscendMetadata`` into samepath's paged-attention inputs.

    Reads the host-side fields the builder fills (``actual_seq_lengths_q``, the cumulative query
    ends, and ``seq_lens_list``; ``query_start_loc`` / ``seq_lens`` tensors when those are
    ``None``), so no device-to-host copy is needed. Requests past ``num_actual_tokens`` — the dummy
    padding request vllm-ascend appends for the TND layout or graph padding, with its
    ``seq_lens`` 1 and block-table row 0 — are dropped; their output rows are not written.

    Checks what samepath and vllm-ascend's own kernels both rely on, raising ``ValueError`` naming
    the field: query ends non-decreasing and covering exactly ``num_actual_tokens``; every
    ``seq_lens[i]`` at least the request's query count; decodes first (``num_decode_tokens`` equals
    the query tokens of the first ``num_decodes`` requests); ``DecodeOnly`` has one query per
    request; ``PrefillNoCache`` has ``seq_lens`` equal to the query counts (vllm-ascend then
    passes the query lengths as KV lengths); ``block_tables`` has a row per request.

    Args:
        attn_metadata: an ``AscendMetadata`` (or any object with its field names).
        device: where the index tensors go (the query's device); default ``block_tables``'s.

    Returns:
        :class:`PagedInputs`. Sequence ``i``'s queries are rows
        ``query_start_loc[i]:query_start_loc[i+1]`` at positions ``seq_lens[i] - q_len_i ..
        seq_lens[i] - 1``, exactly as vLLM and :func:`samepath.paged_attention` define them.
    """
    layout = host_layout(attn_metadata)
    num_tokens, num_seqs = layout.num_tokens, layout.num_seqs
    block_tables = attn_metadata.block_tables
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise ValueError("attn_metadata.block_tables must be a 2-D tensor [requests, max_blocks]")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"attn_metadata.block_tables has {block_tables.shape[0]} rows for {num_seqs} requests")
    device = block_tables.device if device is None else torch.device(device)
    slot_mapping = getattr(attn_metadata, "slot_mapping", None)
    if slot_mapping is not None:
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"attn_metadata.slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
        slot_mapping = slot_mapping[:num_tokens]
    return PagedInputs(
        query_start_loc=torch.tensor(layout.starts[: num_seqs + 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int32, device=device),
        block_table=block_tables[:num_seqs],
        slot_mapping=slot_mapping,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        causal=layout.causal,
    )


def paged_attention_from_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: Any,
    scale: float,
    output: torch.Tensor,
    *,
    sliding_window: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """vllm-ascend's ``forward_impl`` contract on samepath's kernel.

    Args:
        query: ``[num_tokens(+padding), num_heads, head_size]`` (or ``[tokens, num_heads * head_size]``
            with ``output`` giving the head split).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` each,
            already holding this step's keys and values.
        attn_metadata: ``AscendMetadata`` (see :func:`paged_inputs`).
        scale: the softmax scale.
        output: ``[num_tokens(+padding), num_heads, head_size]``; rows of real tokens are written.
        sliding_window: vLLM's window (a query at ``t`` sees ``t - w + 1 .. t``), or ``None``.
        validate: let :func:`samepath.paged_attention` check block-table values (a device sync).

    The translation (host lists to index tensors on the device) and the kernel's launch plan are
    built once per metadata object, by the first layer of a step, and reused by the others.

    Returns:
        ``output``.
    """
    inputs, _ = step_inputs.get(attn_metadata, lambda: paged_inputs(attn_metadata, query.device))
    if inputs.query_start_loc.device != query.device:
        inputs = paged_inputs(attn_metadata, query.device)
    n = inputs.num_tokens
    if output.dim() != 3:
        raise ValueError(f"output must be [tokens, num_heads, head_size], got shape {tuple(output.shape)}")
    if output.shape[0] < n or query.shape[0] < n:
        raise ValueError(f"query {tuple(query.shape)} / output {tuple(output.shape)} have fewer than {n} rows")
    num_heads, head_size = output.shape[1:]
    out = paged_attention(
        query[:n].reshape(n, num_heads, head_size),
        key_cache,
        value_cache,
        inputs.block_table,
        inputs.query_start_loc,
        inputs.seq_lens,
        scale,
        causal=inputs.causal,
        sliding_window=sliding_window if inputs.causal else None,
        validate=validate,
        plan=inputs.plan,
    )
    output[:n].copy_(out)
    return output


#: One step's translated metadata per ``AscendMetadata`` object, shared by the step's layers.
step_inputs = StepCache()


def capturing() -> bool:
    """Whether vllm-ascend is capturing an ACL graph (``_EXTRA_CTX.capturing``, set by ``ACLGraphWrapper``)."""
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX

    return bool(getattr(_EXTRA_CTX, "capturing", False))


def check_attention_supported(impl: Any) -> None:
    problems = []
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        problems.append("attention sinks")
    if getattr(impl, "logits_soft_cap", None):
        problems.append("logits soft-capping (Gemma 2; samepath's vLLM plugin implements it, this integration not)")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype={impl.kv_cache_dtype!r}")
    if getattr(impl, "enable_hamming_sparse", False):
        problems.append("Hamming-sparse KV compression")
    compiled = graph.compiled_mode(getattr(impl, "vllm_config", None))
    if compiled is not None:
        problems.append(
            f"torch.compile (compilation_config.mode={compiled}: PIECEWISE ACL graphs and vllm-ascend's fusion "
            "passes; for ACL graphs set compilation_config mode=0 (NONE) with cudagraph_mode FULL_DECODE_ONLY or "
            "FULL, or enforce_eager=True)"
        )
    if problems:
        raise NotImplementedError(
            f"samepath's vllm-ascend attention does not implement {', '.join(problems)} "
            f"({type(impl).__name__}); unset SAMEPATH_VLLM to run vllm-ascend's own kernels"
        )


def caches(impl: Any, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache = getattr(impl, "key_cache", None), getattr(impl, "value_cache", None)
    if key_cache is None and kv_cache is not None and len(kv_cache) >= 2:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache is None or value_cache is None or key_cache.dim() != 4:
        raise NotImplementedError(
            "samepath's vllm-ascend attention needs the paged K/V caches [num_blocks, block_size, num_kv_heads, "
            f"head_size]; got {None if key_cache is None else tuple(key_cache.shape)}"
        )
    return key_cache, value_cache


def make_forward_impl(owner: type, fence: Callable[[], None] | None) -> Callable[..., torch.Tensor]:
    def forward_impl(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: Any,
        attn_metadata: Any,
        output: torch.Tensor,
    ) -> torch.Tensor:
        from vllm.v1.attention.backend import AttentionType

        if self.attn_type != AttentionType.DECODER:
            return original(owner, "forward_impl")(self, query, key, value, kv_cache, attn_metadata, output)
        check_attention_supported(self)
        if fence is not None:  # vllm-ascend's KV-pool fence, as its own forward_impl starts
            fence()
        key_cache, value_cache = caches(self, kv_cache)
        window = self.sliding_window if self.sliding_window not in (None, -1) else None
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        in_capture = capturing()
        if in_capture or getattr(attn_metadata, graph.ATTRIBUTE, None) is not None:
            # ACL graph mode: the fixed-size buffers the builder hook filled (every step of such an engine).
            graph.graph_paged_attention(
                query,
                key_cache,
                value_cache,
                attn_metadata,
                self.scale,
                out,
                sliding_window=None if window is None else int(window),
                capturing=in_capture,
            )
            return output
        return paged_attention_from_metadata(
            query,
            key_cache,
            value_cache,
            attn_metadata,
            self.scale,
            output.view(output.shape[0], self.num_heads, self.head_size),
            sliding_window=None if window is None else int(window),
        )

    return forward_impl


def patch_attention(patcher: Patcher) -> bool:
    module = importlib.import_module(ATTENTION_MODULE)
    impl = module.AscendAttentionBackendImpl
    fence = getattr(module, "record_attention_compute_start", None)
    set_original(patcher, impl, "forward_impl", make_forward_impl(impl, fence))
    # ACL graph mode: the builder fills samepath's fixed-size buffers; no fused-attention task to re-point.
    builder = getattr(module, "AscendAttentionMetadataBuilder", None)
    if builder is not None and callable(getattr(builder, "build", None)):
        set_original(patcher, builder, "build", graph.make_build(builder))
    if callable(getattr(impl, "update_graph_params", None)):
        set_original(patcher, impl, "update_graph_params", staticmethod(graph.update_graph_params))
    try:
        fa3 = importlib.import_module("vllm_ascend.attention.fa3_v1")
    except ImportError:  # needs flash_attn_npu_v3
        return True
    set_original(patcher, fa3.AscendFAImpl, "forward_impl", make_forward_impl(fa3.AscendFAImpl, fence))
    return True


__all__ = [
    "HostLayout",
    "PagedInputs",
    "caches",
    "capturing",
    "check_attention_supported",
    "host_layout",
    "make_forward_impl",
    "paged_attention_from_metadata",
    "paged_inputs",
    "patch_attention",
    "step_inputs",
]
