"""vllm-ascend's attention on samepath: ``AscendMetadata`` translated (:func:`paged_inputs`) and
attended by :func:`samepath.paged_attention` (:func:`paged_attention_from_metadata`), the patched
``forward_impl`` of ``AscendAttentionBackendImpl`` / ``AscendFAImpl``."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import StepCache
from samepath.integrations.vllm_ascend.compat import ATTENTION_MODULE
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


def _host_ints(value: Any, name: str) -> list[int]:
    if value is None:
        raise ValueError(f"attn_metadata.{name} is None")
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise ValueError(f"attn_metadata.{name} must be a 1-D int tensor, got {value.dtype} {tuple(value.shape)}")
        return [int(v) for v in value.detach().cpu().tolist()]
    if isinstance(value, Sequence):
        return [int(v) for v in value]
    raise ValueError(f"attn_metadata.{name} must be a list or 1-D tensor, got {type(value).__name__}")


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


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
    for name in ("num_actual_tokens", "block_tables"):
        if getattr(attn_metadata, name, None) is None:
            raise ValueError(f"attn_metadata.{name} is missing")
    num_tokens = int(attn_metadata.num_actual_tokens)
    ends_source = getattr(attn_metadata, "actual_seq_lengths_q", None)
    if ends_source is not None:
        starts = [0, *_host_ints(ends_source, "actual_seq_lengths_q")]
    else:
        starts = _host_ints(getattr(attn_metadata, "query_start_loc", None), "query_start_loc")
    if not starts or starts[0] != 0:
        raise ValueError("attn_metadata.query_start_loc must start at 0")
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError("attn_metadata.actual_seq_lengths_q / query_start_loc must be non-decreasing")
    lens_source = getattr(attn_metadata, "seq_lens_list", None)
    seq_lens_all = _host_ints(
        lens_source if lens_source is not None else getattr(attn_metadata, "seq_lens", None), "seq_lens"
    )

    num_seqs = len(starts) - 1
    while num_seqs > 0 and starts[num_seqs] > num_tokens:
        num_seqs -= 1  # the padding request(s) after the real tokens
    while num_seqs > 0 and starts[num_seqs - 1] == num_tokens:
        num_seqs -= 1  # trailing requests without query tokens (graph padding)
    if starts[num_seqs] != num_tokens:
        raise ValueError(
            f"attn_metadata: the requests' query tokens end at {starts[num_seqs]}, which is not "
            f"num_actual_tokens = {num_tokens} (a padding request overlaps real tokens?)"
        )
    if len(seq_lens_all) < num_seqs:
        raise ValueError(f"attn_metadata.seq_lens has {len(seq_lens_all)} entries for {num_seqs} requests")
    q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    seq_lens = seq_lens_all[:num_seqs]
    short = [i for i in range(num_seqs) if seq_lens[i] < q_lens[i]]
    if short:
        i = short[0]
        raise ValueError(
            f"attn_metadata.seq_lens[{i}] = {seq_lens[i]} is less than request {i}'s {q_lens[i]} query tokens"
        )

    num_decodes = int(getattr(attn_metadata, "num_decodes", 0) or 0)
    num_decode_tokens = int(getattr(attn_metadata, "num_decode_tokens", 0) or 0)
    num_prefills = int(getattr(attn_metadata, "num_prefills", 0) or 0)
    if num_decodes > num_seqs:
        raise ValueError(f"attn_metadata.num_decodes = {num_decodes} exceeds the {num_seqs} requests")
    if starts[num_decodes] != num_decode_tokens:
        raise ValueError(
            f"attn_metadata.num_decode_tokens = {num_decode_tokens}, but the first num_decodes = {num_decodes} "
            f"requests hold {starts[num_decodes]} query tokens (decodes must come first)"
        )
    state = _state_name(getattr(attn_metadata, "attn_state", None))
    if state == "DecodeOnly" and (num_prefills or any(q != 1 for q in q_lens)):
        raise ValueError("attn_metadata.attn_state is DecodeOnly but a request has more than one query token")
    if state == "PrefillNoCache" and seq_lens != q_lens:
        raise ValueError("attn_metadata.attn_state is PrefillNoCache but seq_lens differ from the query counts")

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
    causal = getattr(attn_metadata, "causal", True)
    if isinstance(causal, torch.Tensor):
        raise ValueError("attn_metadata.causal must be a bool (per-request causality is not supported)")
    return PagedInputs(
        query_start_loc=torch.tensor(starts[: num_seqs + 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_tables[:num_seqs],
        slot_mapping=slot_mapping,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        causal=bool(causal),
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


def check_attention_supported(impl: Any) -> None:
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX

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
    if getattr(_EXTRA_CTX, "capturing", False):
        problems.append("ACL graph capture")
    model_config = getattr(getattr(impl, "vllm_config", None), "model_config", None)
    if model_config is not None and not getattr(model_config, "enforce_eager", True):
        problems.append("graph / compiled mode (set enforce_eager=True)")
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
    try:
        fa3 = importlib.import_module("vllm_ascend.attention.fa3_v1")
    except ImportError:  # needs flash_attn_npu_v3
        return True
    set_original(patcher, fa3.AscendFAImpl, "forward_impl", make_forward_impl(fa3.AscendFAImpl, fence))
    return True


__all__ = [
    "PagedInputs",
    "caches",
    "check_attention_supported",
    "make_forward_impl",
    "paged_attention_from_metadata",
    "paged_inputs",
    "patch_attention",
    "step_inputs",
]
