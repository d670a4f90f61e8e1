"""One attention batch: the metadata every backend launches from, and the checks on it.

:class:`AttentionBatch` holds what a launch needs — the query, key and value (contiguous or a paged
cache), the cumulative query offsets, where each sequence's keys start and how many it has, the
block table, scale, masking, tiles and the :class:`LaunchPlan` — and is built by one constructor per
public entry point (:meth:`AttentionBatch.for_varlen`, :meth:`~AttentionBatch.for_packed`,
:meth:`~AttentionBatch.for_paged`), which run the entry point's argument checks (shapes, dtypes,
devices; the metadata values too unless ``validate=False``). :meth:`AttentionBatch.check_args` is
the shape-only check a backend that trusts nothing (the Ascend C one) runs before it loads anything.

:class:`LaunchPlan` holds the program maps of one batch layout, built once per step and shared by
every layer's call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from samepath.kernels.attention.plan import clamp_cu_seqlens, program_map, segment_work
from samepath.kernels.config import (
    AttentionConfig,
    WideAttentionConfig,
    attention_config,
    check_head_size,
    dtype_name,
    is_wide_head,
)
from samepath.kernels.dispatch import device_kind
from samepath.kernels.softcap import check_softcap

# ----------------------------------------------------------------------------------------------
# Argument checks (ValueError naming the argument)
# ----------------------------------------------------------------------------------------------


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor on {device}, got {type(tensor).__name__}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device} (the query's device)")


def check_int_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D int32/int64 torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64) or tensor.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    if length is not None and tensor.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {tensor.numel()}")


def check_qkv_heads(query: torch.Tensor, key: torch.Tensor, key_name: str) -> int:
    num_heads, head_size = query.shape[-2:]
    num_kv_heads, kv_head_size = key.shape[-2:]
    if kv_head_size != head_size:
        raise ValueError(f"{key_name} head size {kv_head_size} differs from the query's {head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads, which is not a multiple of the {num_kv_heads} KV heads of {key_name}"
        )
    check_head_size(head_size, "query.shape[-1]")
    return num_heads // num_kv_heads


def check_value_head(key: torch.Tensor, value: torch.Tensor, key_name: str = "key", value_name: str = "value") -> None:
    """``value`` is shaped like ``key`` but for its head size, which may differ (MLA's value is the latent
    alone): a supported head size, at most 256 unless the key's head is wide."""
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"{key_name} {tuple(key.shape)} and {value_name} {tuple(value.shape)} must have the same shape "
            "but for the head size"
        )
    head_size, head_size_v = key.shape[-1], value.shape[-1]
    if head_size_v != head_size:
        check_head_size(head_size_v, f"{value_name}.shape[-1]")
        if is_wide_head(head_size_v) and not is_wide_head(head_size):
            raise ValueError(
                f"{value_name}.shape[-1] = {head_size_v}: a value head above 256 needs a key head above 256, "
                f"got {head_size}"
            )


def check_config(config: AttentionConfig | None, head_size: int) -> None:
    """A wide key head runs with a :class:`WideAttentionConfig` (its value-column blocks and chunk)."""
    if config is not None and is_wide_head(head_size) and not isinstance(config, WideAttentionConfig):
        raise ValueError(f"config must be a WideAttentionConfig for head size {head_size}, got {type(config).__name__}")


def check_packed_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Packed ``[tokens, heads, head_size]`` query/key/value of one dtype and device, GQA heads (the
    value's head size may differ: :func:`check_value_head`)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_size], got shape {tuple(tensor.shape)}")
    check_value_head(key, value)
    dtype_name(query.dtype, "query.dtype")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from the query's {query.dtype}")
    device_kind(query.device)
    check_same_device(query.device, key=key, value=value)
    check_qkv_heads(query, key, "key")


def check_cu_seqlens(name: str, cu: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Value checks on a cumulative-length vector; returns its lengths on the host."""
    values = cu.detach().cpu().to(torch.int64)
    if values.numel() < 1 or values[0] != 0:
        raise ValueError(f"{name} must start with 0")
    lengths = values[1:] - values[:-1]
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing")
    if values[-1] != num_tokens:
        raise ValueError(f"{name}[-1] = {int(values[-1])} must equal the number of tokens, {num_tokens}")
    return lengths


def check_sliding_window(sliding_window: int | None, causal: bool) -> None:
    if sliding_window is None:
        return
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if not causal:
        raise ValueError("sliding_window is only defined for causal attention (causal=True)")


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """An attention-sink logit per query head (GPT-OSS's ``sinks``: ``[num_heads]``, float, the
    query's device), as the fp32 vector the kernels read (a widening: exact); None stays None."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float torch.Tensor of shape [num_heads], got {type(sinks).__name__}")
    if sinks.shape != (query.shape[-2],):
        raise ValueError(f"sinks must have shape [num_heads] = [{query.shape[-2]}], got {tuple(sinks.shape)}")
    dtype_name(sinks.dtype, "sinks.dtype")
    check_same_device(query.device, sinks=sinks)
    return sinks.detach().to(torch.float32).contiguous()


def check_scale(scale: float) -> float:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def check_kv_start(
    kv_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, sliding_window: int | None
) -> None:
    """Value checks on :func:`packed_attention`'s ``kv_start`` (host lengths from the cu checks):
    every key a query of the sequence can see must be among its keys."""
    starts = kv_start.detach().cpu().to(torch.int64)
    if (starts < 0).any():
        seq = int((starts < 0).nonzero()[0, 0])
        raise ValueError(f"kv_start must be non-negative, kv_start[{seq}] = {int(starts[seq])}")
    if (starts + kv_lens > 2**31 - 1).any():
        raise ValueError("kv_start + the sequence's key count must stay below 2**31 (int32 positions)")
    context = kv_lens - q_lens
    needed = 0 if sliding_window is None else sliding_window - 1
    missing = (starts > 0) & (q_lens > 0) & ((context < needed) | (sliding_window is None))
    if missing.any():
        seq = int(missing.nonzero()[0, 0])
        first_query = int(starts[seq] + context[seq])
        sees = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        raise ValueError(
            f"kv_start[{seq}] = {int(starts[seq])}: sequence {seq}'s first query (position {first_query}) sees "
            f"positions from {sees}, but its keys start at kv_start[{seq}]; keys may start after position 0 only "
            f"where the sliding_window (now {sliding_window}) leaves the missing ones invisible"
        )


# ----------------------------------------------------------------------------------------------
# The launch plan of one batch layout
# ----------------------------------------------------------------------------------------------


def _capturing_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class LaunchPlan:
    """The launch metadata of one batch layout, built once and shared by every layer's call.

    A model runs attention over the same sequences in every layer; a plan holds what the
    launchers derive from the cumulative lengths — the program maps (one per block size,
    :func:`.plan.program_map`) and the KV lengths — so that they are computed on the device once per
    forward (or decode step) instead of once per layer. Building a plan reads nothing on the host.

    Pass it as ``plan=`` to :func:`varlen_attention`, :func:`packed_attention` or
    :func:`paged_attention` together with the very tensors it was built from (checked by
    identity); their contents must not change while the plan is in use. A plan built outside a
    CUDA graph capture is not reused inside one (its tensors would live outside the graph).

    Args:
        cu_seqlens_q: ``[num_seqs + 1]`` cumulative query counts (``cu_seqlens`` /
            ``cu_seqlens_q`` / ``query_start_loc``).
        num_tokens: the query tokens (``query.shape[0]``).
        cu_seqlens_kv: for :func:`packed_attention`, its ``cu_seqlens_kv``.
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, num_tokens: int, cu_seqlens_kv: torch.Tensor | None = None):
        check_int_vector("cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_kv is not None:
            check_int_vector("cu_seqlens_kv", cu_seqlens_kv, cu_seqlens_q.numel())
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_kv = cu_seqlens_kv
        self.num_tokens = num_tokens
        self._captured = _capturing_graph()
        self._memo: dict[object, object] = {}

    def _cached(self, key: object, build):
        if self._captured != _capturing_graph():
            return build()
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def program_map(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`.plan.program_map` of the query lengths for ``block``-row blocks."""
        return self._cached(("map", block), lambda: program_map(self.cu_seqlens_q, block, self.num_tokens))

    def clamped_program_map(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`clamp_cu_seqlens` of ``cu_seqlens_q`` and its :func:`.plan.program_map` for ``block``-row
        blocks (the backward's metadata)."""

        def build():
            clamped = clamp_cu_seqlens(self.cu_seqlens_q, self.num_tokens)
            return (clamped, *program_map(clamped, block, self.num_tokens))

        return self._cached(("clamped map", block), build)

    def segment_work(
        self,
        block: int,
        seq_lens: torch.Tensor,
        kv_first_pos: torch.Tensor | None,
        max_kv_len: int,
        seg: int,
        max_segments: int,
    ) -> torch.Tensor:
        """:func:`.plan.segment_work` of the ``block``-row program map over ``seq_lens`` (the split
        schedule's work list), built once per step on the device for these very tensors."""
        key = ("segments", block, id(seq_lens), id(kv_first_pos), max_kv_len, seg, max_segments)

        def build():
            program_seq, _, num_blocks = self.program_map(block)
            work = segment_work(program_seq, num_blocks, seq_lens, kv_first_pos, max_kv_len, seg, max_segments)
            return seq_lens, kv_first_pos, work  # the tensors held, so that their ids stay theirs

        return self._cached(key, build)[2]

    def kv_lens(self) -> torch.Tensor:
        """``cu[1:] - cu[:-1]`` of ``cu_seqlens_kv`` (``cu_seqlens_q`` when there is none)."""
        cu = self.cu_seqlens_q if self.cu_seqlens_kv is None else self.cu_seqlens_kv
        return self._cached("kv_lens", lambda: cu[1:] - cu[:-1])

    def check(self, num_tokens: int, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor | None = None) -> None:
        """Raise ``ValueError`` unless this plan was built from these tensors."""
        if cu_seqlens_q is not self.cu_seqlens_q or cu_seqlens_kv is not self.cu_seqlens_kv:
            raise ValueError("plan was built from other cumulative-length tensors than the ones passed")
        if num_tokens != self.num_tokens:
            raise ValueError(f"plan was built for {self.num_tokens} query tokens, the query has {num_tokens}")


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionBatch:
    """What one attention launch reads, whichever backend runs it.

    Attributes:
        query: ``[num_tokens, num_heads, head_size]``, the queries of all sequences, packed.
        key, value: packed ``[tokens, num_kv_heads, head_size]`` (``block_table`` None: sequence
            ``i``'s keys are rows ``kv_start_loc[i] ..``) or paged caches ``[num_blocks, block_size,
            num_kv_heads, head_size]`` addressed through ``block_table``.
        query_start_loc: ``[num_seqs + 1]`` cumulative query counts.
        kv_start_loc: ``[num_seqs (+1)]`` first packed key of each sequence (ignored when paged).
        seq_lens: ``[num_seqs]`` KV length of each sequence; its queries are its last positions.
        block_table: ``[num_seqs(+), max_blocks]`` page ids, or None for contiguous KV.
        scale, causal, sliding_window: as in :func:`samepath.paged_attention`.
        config: the tiles (``block_m``, ``tile_n``, ``seg``, ``bwd_block_m``, ``bwd_block_n``, launch
            hints); None: the frozen table's for the query's head size, dtype and device.
        kv_first_pos: contiguous KV only: the absolute position of each sequence's first key
            (``packed_attention``'s ``kv_start``; None: position 0).
        plan: the :class:`LaunchPlan` of ``query_start_loc`` (and the KV offsets), or None.
        softcap: attention logit soft-capping (Gemma 2): the scores are ``cap * tanh(s / cap)``
            (:mod:`samepath.kernels.softcap`), or None.
        sinks: fp32 ``[num_heads]``, each head's attention-sink logit (:func:`check_sinks`), or None.

    Building one checks nothing but that ``kv_first_pos`` comes with contiguous KV; the entry points'
    constructors check their arguments, :meth:`check_args` the shapes a trusting backend needs.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_start_loc: torch.Tensor
    kv_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor | None
    scale: float
    causal: bool = True
    sliding_window: int | None = None
    config: AttentionConfig | Any | None = None
    kv_first_pos: torch.Tensor | None = None
    plan: LaunchPlan | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kv_first_pos is not None and self.block_table is not None:
            raise ValueError("kv_first_pos is for contiguous KV; a paged cache keeps every position")
        if self.config is None:
            config = attention_config(self.query.shape[-1], self.query.dtype, self.query.device)
            object.__setattr__(self, "config", config)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def head_size(self) -> int:
        return self.query.shape[-1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[-2]

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_seqs(self) -> int:
        return self.query_start_loc.numel() - 1

    # ------------------------------------------------------------------------------------------
    # One constructor per entry point: its argument checks, in its order
    # ------------------------------------------------------------------------------------------

    @classmethod
    def for_varlen(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float | None,
        causal: bool,
        sliding_window: int | None,
        config: AttentionConfig | None,
        validate: bool,
        plan: LaunchPlan | None,
        softcap: float | None = None,
    ) -> AttentionBatch:
        """The batch of :func:`~samepath.kernels.attention.varlen_attention` (self-attention over
        packed sequences: the keys of a sequence are its own rows)."""
        check_packed_qkv(query, key, value)
        if key.shape[0] != query.shape[0]:
            raise ValueError(
                f"key has {key.shape[0]} tokens, query {query.shape[0]}: self-attention needs equal counts"
            )
        check_int_vector("cu_seqlens", cu_seqlens)
        check_same_device(query.device, cu_seqlens=cu_seqlens)
        check_sliding_window(sliding_window, causal)
        scale = check_scale(query.shape[-1] ** -0.5 if scale is None else scale)
        if validate:
            check_cu_seqlens("cu_seqlens", cu_seqlens, query.shape[0])
        if plan is not None:
            plan.check(query.shape[0], cu_seqlens)
        check_config(config, query.shape[-1])
        cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
        query, key, value = (last_dim_contiguous(t) for t in (query, key, value))
        seq_lens = cu_seqlens[1:] - cu_seqlens[:-1] if plan is None else plan.kv_lens()
        return cls(
            query, key, value, cu_seqlens, cu_seqlens, seq_lens, None, scale, causal, sliding_window, cfg, None, plan,
            check_softcap(softcap),
        )  # fmt: skip

    @classmethod
    def for_packed(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        scale: float,
        causal: bool,
        sliding_window: int | None,
        config: AttentionConfig | None,
        validate: bool,
        plan: LaunchPlan | None,
        kv_start: torch.Tensor | None,
        softcap: float | None = None,
    ) -> AttentionBatch:
        """The batch of :func:`~samepath.kernels.attention.packed_attention` (each sequence's newest
        queries over its packed keys, which may start after position 0)."""
        check_packed_qkv(query, key, value)
        check_same_device(query.device, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
        check_int_vector("cu_seqlens_q", cu_seqlens_q)
        check_int_vector("cu_seqlens_kv", cu_seqlens_kv, cu_seqlens_q.numel())
        if kv_start is not None:
            check_int_vector("kv_start", kv_start, cu_seqlens_q.numel() - 1)
            check_same_device(query.device, kv_start=kv_start)
        check_sliding_window(sliding_window, causal)
        scale = check_scale(scale)
        if validate:
            q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.shape[0])
            kv_lens = check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, key.shape[0])
            if (kv_lens < q_lens).any():
                raise ValueError("each sequence needs at least as many keys (cu_seqlens_kv) as queries (cu_seqlens_q)")
            if kv_start is not None:
                check_kv_start(kv_start, q_lens, kv_lens, sliding_window)
        if plan is not None:
            plan.check(query.shape[0], cu_seqlens_q, cu_seqlens_kv)
        check_config(config, query.shape[-1])
        cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
        query, key, value = (last_dim_contiguous(t) for t in (query, key, value))
        seq_lens = cu_seqlens_kv[1:] - cu_seqlens_kv[:-1] if plan is None else plan.kv_lens()
        return cls(
            query, key, value, cu_seqlens_q, cu_seqlens_kv, seq_lens, None, scale, causal, sliding_window, cfg,
            kv_start, plan, check_softcap(softcap),
        )  # fmt: skip

    @classmethod
    def for_paged(
        cls,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        causal: bool,
        sliding_window: int | None,
        config: AttentionConfig | None,
        validate: bool,
        plan: LaunchPlan | None,
        softcap: float | None = None,
    ) -> AttentionBatch:
        """The batch of :func:`~samepath.kernels.attention.paged_attention` (new queries over a paged
        KV cache: prefill, chunked prefill and decode at once)."""
        if query.dim() != 3:
            raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if cache.dim() != 4:
                raise ValueError(
                    f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got shape {tuple(cache.shape)}"
                )
            if cache.dtype != query.dtype:
                raise ValueError(f"{name} dtype {cache.dtype} differs from the query's {query.dtype}")
            if cache.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
        check_value_head(key_cache, value_cache, "key_cache", "value_cache")
        dtype_name(query.dtype, "query.dtype")
        device_kind(query.device)
        check_same_device(
            query.device,
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=block_table,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
        check_qkv_heads(query, key_cache, "key_cache")
        check_int_vector("query_start_loc", query_start_loc)
        num_seqs = query_start_loc.numel() - 1
        check_int_vector("seq_lens", seq_lens, num_seqs)
        if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if block_table.shape[0] < num_seqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
        check_sliding_window(sliding_window, causal)
        scale = check_scale(scale)
        if validate:
            check_paged_metadata(query, key_cache, block_table, query_start_loc, seq_lens)
        if plan is not None:
            plan.check(query.shape[0], query_start_loc)
        query = last_dim_contiguous(query)
        check_config(config, query.shape[-1])
        cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
        return cls(
            query, key_cache, value_cache, query_start_loc, query_start_loc, seq_lens, block_table, scale, causal,
            sliding_window, cfg, None, plan, check_softcap(softcap),
        )  # fmt: skip

    def check_args(self) -> None:
        """Shape, dtype and device checks for a backend that trusts its arguments (``ValueError`` naming
        the argument); no metadata value is read (no host sync)."""
        query, key, value, block_table = self.query, self.key, self.value, self.block_table
        if query.dim() != 3:
            raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
        kv_dims = 4 if self.paged else 3
        layout = "[num_blocks, block_size, num_kv_heads, head_size]" if self.paged else "[tokens, heads, head]"
        for name, tensor in (("key", key), ("value", value)):
            if tensor.dim() != kv_dims:
                raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")
            if tensor.dtype != query.dtype:
                raise ValueError(f"{name} dtype {tensor.dtype} differs from the query's {query.dtype}")
            if tensor.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
            if tensor.device != query.device:
                raise ValueError(f"{name} is on {tensor.device}, expected {query.device} (the query's device)")
        check_value_head(key, value)
        if query.stride(-1) != 1:
            raise ValueError("query must be contiguous in its last (head_size) dimension")
        num_heads, head_size = query.shape[1:]
        num_kv_heads = key.shape[-2]
        if key.shape[-1] != head_size:
            raise ValueError(f"key head size {key.shape[-1]} differs from the query's {head_size}")
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise ValueError(f"query has {num_heads} heads, not a multiple of the {num_kv_heads} KV heads")
        dtype_name(query.dtype, "query.dtype")
        check_int_vector("query_start_loc", self.query_start_loc)
        num_seqs = self.num_seqs
        check_int_vector("kv_start_loc", self.kv_start_loc)
        check_int_vector("seq_lens", self.seq_lens, num_seqs)
        if block_table is not None and (block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64)):
            raise ValueError(
                f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
            )
        metadata = {
            "query_start_loc": self.query_start_loc,
            "kv_start_loc": self.kv_start_loc,
            "seq_lens": self.seq_lens,
        }
        if block_table is not None:
            metadata["block_table"] = block_table
        check_same_device(query.device, **metadata)
        if not isinstance(self.scale, (int, float)) or not self.scale > 0 or self.scale == float("inf"):
            raise ValueError(f"scale must be a positive finite float, got {self.scale!r}")
        check_softcap(self.softcap)
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1 or not self.causal):
            raise ValueError(f"sliding_window must be None or a positive int with causal=True, got {window!r}")
        if block_table is not None and block_table.shape[0] < num_seqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
        if block_table is None and self.kv_start_loc.numel() < num_seqs:
            raise ValueError(f"kv_start_loc has {self.kv_start_loc.numel()} entries for {num_seqs} sequences")


def check_paged_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Value checks of :func:`~samepath.kernels.attention.paged_attention`'s metadata (device-to-host
    copies of the lengths and of the block table's columns in use, not of its whole width):
    consistent query offsets, KV lengths at least the query counts, a block table wide enough and
    page ids inside the caches."""
    num_seqs = query_start_loc.numel() - 1
    q_lens = check_cu_seqlens("query_start_loc", query_start_loc, query.shape[0])
    kv_lens = seq_lens.detach().cpu().to(torch.int64)
    if (kv_lens < q_lens).any():
        raise ValueError("seq_lens must be at least each sequence's query count (query_start_loc)")
    block_size = key_cache.shape[1]
    needed = (kv_lens + block_size - 1) // block_size
    if num_seqs and int(needed.max()) > block_table.shape[1]:
        raise ValueError(
            f"block_table is too short: a sequence of {int(kv_lens.max())} tokens needs "
            f"{int(needed.max())} blocks of {block_size}, the table has {block_table.shape[1]} columns"
        )
    width = int(needed.max()) if num_seqs else 0  # only the columns in use cross to the host
    pages = block_table.detach()[:num_seqs, :width].cpu()
    used = torch.arange(width)[None, :] < needed[:, None]
    if used.any() and (pages[used].min() < 0 or pages[used].max() >= key_cache.shape[0]):
        raise ValueError(f"block_table holds page ids outside [0, {key_cache.shape[0]})")
