"""Hugging Face transformers: attention, norms, MLP, rotary and MoE experts on samepath kernels.

Attention goes through transformers' official extension points: ``AttentionInterface`` (the
function below) with ``AttentionMaskInterface`` giving it the 2-D padding mask (transformers'
``flash_attention_mask``: ``None`` or a bool ``[batch, kv]``), so the kernel applies causality
itself. Each row of the padded batch is cut into consecutive sequences — the padding before its
real tokens, the real tokens (split where ``position_ids`` restart: packed sequences), the padding
after them — so the real sequences start at position 0 and their KV tiles are anchored exactly
where the rollout's are, without gathering anything. The layout is computed once per forward on
the device (:func:`cached_batch_layout`) and reused by every layer. Training (no cache) runs
:func:`samepath.varlen_attention` (differentiable); ``generate`` with a KV cache runs
:func:`samepath.kernels.attention.packed_attention`.

Per model type (``config.model_type``; its family's descriptor in :mod:`samepath.models` says
which norm, MLP and rope each gets), Liger-style: ``{Prefix}RMSNorm.forward`` →
:func:`samepath.rms_norm` (Gemma 3: ``weight_mode="fp32_one_plus_weight"``), ``{Prefix}MLP.forward`` →
:func:`samepath.silu_mul` (Phi-3's fused ``gate_up_proj``: :func:`samepath.kernels.swiglu.swiglu`,
vLLM's layout; Gemma 3: :func:`samepath.gelu_tanh_mul`), the module's
``apply_rotary_pos_emb`` → :func:`samepath.apply_rotary`, ``{Prefix}RotaryEmbedding.forward`` →
:func:`samepath.rotary_cos_sin` (every rope type :mod:`samepath.models.formulas` resolves,
per layer type where the config has one rope per layer type: Gemma 3's local and global);
MoE experts through ``ExpertsInterface``.
Linear layers and the lm_head go through :func:`samepath.batch_invariant` (entered by
``patch_all``). Every replacement is recorded by :class:`Patcher` and undone by ``unpatch_all``.

The trainer's log-probs without ``[tokens, vocab]`` logits: :func:`causal_lm_logprobs` runs the
model's decoder and the fused lm_head + token log-probs (:func:`fused_lm_head_logprobs`,
:func:`samepath.kernels.logprobs.linear_token_logprobs`), forward and backward, with the bits of
``samepath.logprobs(model(...).logits, ...)`` and so of the rollout.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Mapping, Set
from typing import Any

import torch

from samepath.integrations.hf_linear_attention import apply_to_family as apply_linear_attention
from samepath.integrations.hf_mla import mla_attention_forward
from samepath.integrations.hf_norms import RMS_NORM_FORWARDS, one_plus_weight_rms_norm_forward  # noqa: F401
from samepath.integrations.hf_parallel import ROW_PARALLEL_LINEARS, tensor_parallel_numerics  # noqa: F401 (public here)
from samepath.integrations.hf_softcap import softcapped_causal_lm_forward
from samepath.integrations.moe import biased_topk_router_forward, module_experts_forward
from samepath.integrations.patcher import Patcher
from samepath.kernels.attention import LaunchPlan, packed_attention, varlen_attention
from samepath.kernels.attention.backend import attention_backend
from samepath.kernels.gelu_tanh_mul import gelu_tanh_mul
from samepath.kernels.logprobs import (
    IGNORE_INDEX,
    LM_HEAD_TOKEN_CHUNK,
    check_linear_logprobs_args,
    linear_token_logprobs,
)
from samepath.kernels.moe_routing import sigmoid_grouped_topk_routing
from samepath.kernels.opaque import compile_opaque
from samepath.kernels.rotary import apply_rotary, mrope_cos_sin, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul, swiglu
from samepath.models.descriptor import GELU_TANH_MUL, SIGMOID_GROUPED_TOPK, SILU_MUL, TOPK_SOFTMAX_BIASED, ModelFamily
from samepath.models.formulas import final_logit_softcap, rope_formula
from samepath.models.registry import family_view, find, model_types_where

# Under torch.compile every kernel above calls its torch.library custom op (torch.ops.samepath.*;
# docs/integrations.md, "torch.compile"); the batch layout (host planning) runs as an opaque eager call.

#: The name models use in ``attn_implementation=`` / ``experts_implementation=``.
IMPLEMENTATION = "samepath"

#: model_type -> (modeling module, class-name prefix) of the architectures patched per type: the
#: families of :mod:`samepath.models` (``hf_module`` / ``hf_prefix``), read at each use.
MODEL_TYPES: Mapping[str, tuple[str, str]] = family_view(lambda family: (family.hf_module, family.hf_prefix))


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where a padded ``[batch, len]`` attention call's sequences lie in its flattened rows.

    Every row is cut into consecutive sequences that tile the flattened queries and keys without
    a gap, so no gather or scatter is needed: the padding before a row's real run, the real run
    (split where ``position_ids`` restart, when there is no cache), and the padding after it.
    The padding sequences' rows attend among themselves only and are zeroed afterwards; each real
    sequence starts at position 0 at its first real token, so its KV tiles are anchored exactly
    where the rollout's are.

    ``cu_q`` / ``cu_kv``: int32 cumulative lengths over ``batch * q_len`` query rows and
    ``batch * kv_len`` key rows (``cu_kv`` is ``None`` when ``q_len == kv_len``: self-attention
    over the same sequences); ``plan``: their :class:`~samepath.kernels.attention.LaunchPlan`;
    ``query_valid``: ``[batch * q_len]`` bool, the rows that are real tokens (``None``: all);
    ``kv_start``: int32 per sequence, the position of its first key where a sliding-window cache
    has dropped a row's first tokens (``None``: every sequence's keys start at its position 0).
    """

    cu_q: torch.Tensor
    cu_kv: torch.Tensor | None
    plan: LaunchPlan
    query_valid: torch.Tensor | None
    kv_start: torch.Tensor | None = None


class SlidingWindowCacheError(ValueError):
    """A sliding-window layer's KV cache cannot be attended over exactly: a cached call without
    ``position_ids`` (they locate the cached keys), a cache that has dropped keys the window still
    sees, or ``SAMEPATH_ATTENTION_BACKEND=ascendc`` (whose kernel takes no ``kv_start``) once a row
    has outgrown the window. Hugging Face's own sliding-window cache, which keeps the last
    ``sliding_window - 1`` tokens, is attended over exactly (``kv_start``) by the Triton backend."""


def _holes_error(rows: torch.Tensor) -> ValueError:
    row = int(rows.nonzero()[0, 0])
    return ValueError(
        "attention_mask must mark one contiguous run of real tokens per row (left and/or right padding); "
        f"row {row} has holes"
    )


def _positions_error(rows: torch.Tensor) -> ValueError:
    row = int(rows.nonzero()[0, 0])
    return ValueError(
        f"row {row} is left-padded but its position_ids do not start at 0 at its first real token: Hugging "
        "Face numbers positions from the padding when no position_ids are given, while the rollout "
        "(generate, vLLM) counts them from the first real token, so the rotary embedding would differ. "
        "Pass position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) (or right-pad the batch)"
    )


def batch_layout(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> BatchLayout:
    """Compute a :class:`BatchLayout` on the device, vectorised.

    Row ``b``'s real tokens are the one contiguous run ``attention_mask[b]`` marks (all of them
    without a mask); a row with holes raises ``ValueError``. Without a cache (``q_len ==
    kv_len``) the run is split further wherever ``position_ids`` does not continue by +1
    (packed sequences). The queries are the last ``q_len`` KV slots.

    With a cache and a ``sliding_window``, the cache may have dropped a row's first tokens
    (Hugging Face's sliding-window cache keeps the last ``sliding_window - 1``): the position of
    the run's first key is its last key's position (``position_ids``, counted from the row's first
    real token, as ``generate`` makes them) minus the keys before it, and goes to ``kv_start``. A
    row whose ``position_ids`` contradict its mask raises ``ValueError``; one whose cache lacks
    keys the window sees raises :class:`SlidingWindowCacheError`.

    Reads at most one small tensor on the host: the number of sequences when ``position_ids``
    may split a row; the holes check when there is a mask, together with the ``kv_start`` checks
    for a windowed layer with a cache (which reads once even without a mask); nothing otherwise.
    """
    real = None if attention_mask is None else attention_mask[:, -kv_len:].to(device=device, dtype=torch.bool)
    if q_len == kv_len:
        return _self_attention_layout(real, position_ids, batch, kv_len, device)
    first_query_slot = kv_len - q_len
    rows = torch.arange(batch, device=device, dtype=torch.int64)
    holes = None
    if real is None:
        present = torch.ones(batch, device=device, dtype=torch.bool)
        first = torch.zeros(batch, device=device, dtype=torch.int64)
        end = torch.full((batch,), kv_len, device=device, dtype=torch.int64)
        query_valid = None
    else:
        present = real.any(1)
        as_int = real.to(torch.uint8)
        first = torch.where(present, as_int.argmax(1), kv_len)
        end = torch.where(present, kv_len - as_int.flip(1).argmax(1), kv_len)
        holes = present & (real.sum(1) != end - first)
        query_valid = real[:, first_query_slot:].flatten()
    kv_start = None
    if sliding_window is not None:
        kv_start = _window_kv_start(position_ids, present, first, end, holes, batch, q_len, kv_len, sliding_window)
    elif holes is not None and holes.any():  # the one host read
        raise _holes_error(holes)
    query_real_start = (first - first_query_slot).clamp(min=0)
    query_real_end = (end - first_query_slot).clamp(min=0)
    # Per row: padding before the run, the run, padding after it (any of them may be empty).
    cu_q = torch.stack([rows * q_len, rows * q_len + query_real_start, rows * q_len + query_real_end], 1)
    cu_kv = torch.stack([rows * kv_len, rows * kv_len + first, rows * kv_len + end], 1)
    cu_q = torch.cat([cu_q.flatten(), rows.new_full((1,), batch * q_len)]).to(torch.int32)
    cu_kv = torch.cat([cu_kv.flatten(), rows.new_full((1,), batch * kv_len)]).to(torch.int32)
    return BatchLayout(cu_q, cu_kv, LaunchPlan(cu_q, batch * q_len, cu_kv), query_valid, kv_start)


def _window_kv_start(
    position_ids: torch.Tensor | None,
    present: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    holes: torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    sliding_window: int,
) -> torch.Tensor | None:
    """The ``kv_start`` of a windowed layer's cached call (``[3 * batch]`` int32, one per sequence
    of :func:`batch_layout`; ``None`` when no row has lost a token), with the layout's checks in one
    host read. Row ``b``'s real keys are slots ``first[b] .. end[b] - 1``."""
    if position_ids is None:
        raise SlidingWindowCacheError(
            f"a sliding-window layer (sliding_window={sliding_window}) was called with a KV cache but without "
            "position_ids: samepath needs them to know at which position the cached keys start (Hugging Face's "
            "sliding-window cache drops a row's first tokens). Pass position_ids as generate does"
        )
    first_query_slot = kv_len - q_len
    positions = position_ids.to(device=first.device, dtype=torch.int64).expand(batch, q_len)
    last_key = end - 1
    # Rows whose last real key is a query: its position says where the run starts.
    located = present & (last_key >= first_query_slot)
    last_position = positions.gather(1, (last_key - first_query_slot).clamp(0, q_len - 1)[:, None])[:, 0]
    start = torch.where(located, last_position - (last_key - first), 0)
    first_query = torch.maximum(first, torch.full_like(first, first_query_slot))
    # The cache keeps a row's last tokens: a row that still shows left padding has lost none.
    contradicts = (start < 0) | ((start > 0) & (first > 0))
    missing = (start > 0) & (first_query - first < sliding_window - 1)
    flags = (contradicts.any() * 2 + missing.any()) * 4 + (0 if holes is None else holes.any() * 2) + (start > 0).any()
    flags = int(flags)  # the one host read
    if flags & 2:
        raise _holes_error(holes)
    if flags & 8:
        row = int(contradicts.nonzero()[0, 0])
        raise ValueError(
            f"row {row}'s position_ids ({int(last_position[row])} at its last real key) contradict its attention_mask "
            f"({int(end[row] - first[row])} real keys, {int(first[row])} padding slots before them): a sliding-window "
            "layer with a cache locates its keys from position_ids counted from the row's first real token, as "
            "generate makes them"
        )
    if flags & 4:
        row = int(missing.nonzero()[0, 0])
        raise SlidingWindowCacheError(
            f"row {row}'s KV cache starts at position {int(start[row])} and holds {int(first_query[row] - first[row])} "
            f"keys before its first query, fewer than the sliding_window={sliding_window} - 1 that query sees: the "
            "cache has dropped keys the window needs (a cache whose window is smaller than the layer's?)"
        )
    if not flags & 1:
        return None
    zeros = torch.zeros_like(start)
    return torch.stack([zeros, start, zeros], 1).flatten().to(torch.int32)


def _self_attention_layout(
    real: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device
) -> BatchLayout:
    num_rows = batch * length
    if real is None and position_ids is None:
        cu = (torch.arange(batch + 1, device=device, dtype=torch.int64) * length).to(torch.int32)
        return BatchLayout(cu, None, LaunchPlan(cu, num_rows), None)
    starts = torch.zeros(batch, length, device=device, dtype=torch.bool)
    starts[:, 0] = True
    if real is not None:
        starts[:, 1:] |= real[:, 1:] != real[:, :-1]
    misplaced = None
    if position_ids is not None:
        positions = position_ids.to(device).expand(batch, length)
        restarts = positions[:, 1:] != positions[:, :-1] + 1
        if real is not None:
            restarts &= real[:, 1:] & real[:, :-1]
            # A row's first real token at position 0: the rollout counted from there.
            first_real = real.to(torch.uint8).argmax(1, keepdim=True)
            misplaced = real.any(1) & (positions.gather(1, first_real)[:, 0] != 0)
        starts[:, 1:] |= restarts
    counts = starts.flatten().cumsum(0)
    if real is None:
        num_seqs = int(counts[-1])  # the one host read
    else:
        runs = real.clone()
        runs[:, 1:] &= ~real[:, :-1]
        holes = runs.sum(1) > 1
        flags = holes.any() * 2 + (0 if misplaced is None else misplaced.any())
        num_seqs, flags = divmod(int(counts[-1] * 4 + flags), 4)  # the one host read: all at once
        if flags & 2:
            raise _holes_error(holes)
        if flags & 1:
            raise _positions_error(misplaced)
    # The k-th sequence starts at the first row where the running count of starts reaches k + 1.
    targets = torch.arange(1, num_seqs + 1, device=device, dtype=counts.dtype)
    cu = torch.cat([torch.searchsorted(counts, targets), counts.new_full((1,), num_rows)]).to(torch.int32)
    return BatchLayout(cu, None, LaunchPlan(cu, num_rows), None if real is None else real.flatten())


#: The layouts of the last few calls, keyed by the mask and position_ids objects they came from:
#: every layer of one forward passes the same two tensors, so the layout is built once per forward.
_LAYOUT_CACHE: collections.OrderedDict[tuple, tuple[tuple, BatchLayout]] = collections.OrderedDict()
_LAYOUT_CACHE_SIZE = 8


def _source(tensor: torch.Tensor | None) -> tuple:
    return (None, -1) if tensor is None else (weakref.ref(tensor), tensor._version)


def _same_source(saved: tuple, tensor: torch.Tensor | None) -> bool:
    ref, version = saved
    if tensor is None:
        return ref is None
    return ref is not None and ref() is tensor and tensor._version == version


def cached_batch_layout(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> BatchLayout:
    """:func:`batch_layout`, reused while the same (unmodified) mask and position_ids tensors come back."""
    if q_len == kv_len:
        sliding_window = None  # the layout of self-attention does not depend on it
    elif sliding_window is None:
        position_ids = None  # not read with a cache, except to locate a windowed layer's keys
    key = (id(attention_mask), id(position_ids), batch, q_len, kv_len, device, sliding_window)
    entry = _LAYOUT_CACHE.get(key)
    if entry is not None:
        (mask_source, positions_source), layout = entry
        if _same_source(mask_source, attention_mask) and _same_source(positions_source, position_ids):
            _LAYOUT_CACHE.move_to_end(key)
            return layout
    layout = batch_layout(attention_mask, position_ids, batch, q_len, kv_len, device, sliding_window)
    if not torch.compiler.is_compiling():
        _LAYOUT_CACHE[key] = ((_source(attention_mask), _source(position_ids)), layout)
        while len(_LAYOUT_CACHE) > _LAYOUT_CACHE_SIZE:
            _LAYOUT_CACHE.popitem(last=False)
    return layout


cached_batch_layout = compile_opaque(cached_batch_layout, planning=True)  # host reads and cache: eager under compile


#: Keyword arguments transformers passes along to an attention function that do not change what
#: it computes (model-level flags); any other unknown keyword is refused, never ignored.
_NEUTRAL_ATTENTION_KWARGS = frozenset(
    {"use_cache", "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict"}
)


#: Keywords that say nothing when ``None`` (verl's fused-kernel forward passes ``cache_position=None``
#: explicitly, and transformers hands it on to the attention function); refused with a value.
_NEUTRAL_WHEN_NONE = frozenset({"cache_position"})


class UnsupportedAttentionError(ValueError):
    """transformers asked samepath's attention for a feature it does not implement (dropout,
    attention weights, an unknown keyword): refused rather than dropped."""


def _check_attention_kwargs(
    module: torch.nn.Module, dropout: float, kwargs: dict[str, Any], cu_q: torch.Tensor, unpadded_packed: bool
) -> None:
    where = type(module).__name__
    problems = []
    if dropout:
        problems.append(f"dropout={dropout} (attention dropout in train mode; set attention_dropout=0)")
    if kwargs.get("output_attentions"):
        problems.append("output_attentions=True (samepath returns no attention weights)")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = kwargs.get(name)
        if given is not None and not (unpadded_packed and torch.equal(given.flatten().to(cu_q), cu_q)):
            problems.append(f"{name} that differs from the sequences position_ids / the mask delimit")
    known = {"softcap", "s_aux", "output_attentions", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"}
    known |= {"max_length_q", "max_length_k"} | _NEUTRAL_ATTENTION_KWARGS
    known |= {name for name in _NEUTRAL_WHEN_NONE if kwargs.get(name) is None}
    problems += [f"unknown keyword {name}={kwargs[name]!r}" for name in sorted(set(kwargs) - known)]
    if problems:
        raise UnsupportedAttentionError(
            f"samepath's attention ({where}) does not implement: {'; '.join(problems)}. Refused rather than "
            "dropped: the rollout and the trainer would compute different things"
        )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function: query ``[B, Hq, q, D]``, key/value
    ``[B, Hkv, kv, D]`` (cache included), 2-D padding mask or ``None``; returns ``[B, q, Hq, D]``.

    Padding query rows come back as zeros. Bit-identical, row by row, to what samepath's paged
    kernel gives the rollout for the same tokens. The sequence layout is computed once per forward
    (:func:`cached_batch_layout`); a layer's call reads nothing from the device on the host (unless
    transformers passes ``cu_seq_lens_*``, which are compared with the layout's).

    A sliding-window layer with Hugging Face's sliding-window cache, which drops a row's first
    tokens once it outgrows the window, passes each sequence's first key position to the kernel
    (``kv_start``, located from ``position_ids`` once per forward by :func:`batch_layout`): the
    row's KV tiles stay anchored at its position 0, so its bits are those of the full-cache
    computation, the trainer's forward and the rollout's paged kernel. What cannot be attended
    over exactly raises :class:`SlidingWindowCacheError`.

    A ``softcap`` (Gemma 2's attention logit soft-capping) goes to the kernel, which caps the scores with
    the formula every caller runs (:mod:`samepath.kernels.softcap`). Attention sinks (``s_aux``,
    GPT-OSS's per-head ``sinks``) go to the kernel's ``sinks``: the running softmax state starts from
    them for the trainer's forward and ``generate`` alike.

    Raises :class:`UnsupportedAttentionError` for dropout > 0,
    ``output_attentions=True``, ``cu_seq_lens_*`` other than the sequences it cuts out itself, or
    any keyword it does not know.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "samepath attention takes the 2-D padding mask its AttentionMaskInterface entry provides, got a "
            f"{attention_mask.dim()}-D mask; build the model with attn_implementation='samepath'"
        )
    batch, num_heads, q_len, head_size = query.shape
    kv_len, num_kv_heads = key.shape[2], key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else head_size**-0.5
    layout = cached_batch_layout(
        attention_mask, kwargs.get("position_ids"), batch, q_len, kv_len, query.device, sliding_window
    )
    if layout.kv_start is not None and attention_backend() == "ascendc":
        raise SlidingWindowCacheError(
            f"samepath's Hugging Face attention ({type(module).__name__}, sliding_window={sliding_window}): "
            "Hugging Face's sliding-window cache has dropped a row's first tokens, and the Ascend C attention "
            "backend (SAMEPATH_ATTENTION_BACKEND=ascendc) has no kv_start to attend over such a cache; use the "
            "triton backend, or roll out with vLLM + samepath's plugin (paged cache, every position kept)"
        )
    unpadded_packed = batch == 1 and layout.cu_kv is None and layout.query_valid is None
    _check_attention_kwargs(module, dropout, kwargs, layout.cu_q, unpadded_packed)
    q = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_size)
    k = key.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, head_size)
    v = value.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, value.shape[-1])  # MLA: the latent alone
    sinks = kwargs.get("s_aux")
    if layout.cu_kv is None:
        out = varlen_attention(
            q, k, v, layout.cu_q, scale, causal, sliding_window=sliding_window, validate=False, plan=layout.plan,
            softcap=kwargs.get("softcap"), sinks=sinks,
        )  # fmt: skip
    else:
        out = packed_attention(
            q,
            k,
            v,
            layout.cu_q,
            layout.cu_kv,
            scale,
            causal=causal,
            sliding_window=sliding_window,
            validate=False,
            plan=layout.plan,
            kv_start=layout.kv_start,
            softcap=kwargs.get("softcap"),
            sinks=sinks,
        )
    if layout.query_valid is not None:
        out = torch.where(layout.query_valid[:, None, None], out, 0.0)
    return out.view(batch, q_len, num_heads, value.shape[-1]), None


#: The attribute of an experts module sharded by :func:`samepath.integrations.expert_parallel.shard_experts`.
EXPERT_PARALLEL_ATTR = "samepath_expert_parallel"


def samepath_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``ExpertsInterface`` function: :func:`samepath.integrations.moe.module_experts_forward` (the
    loop vLLM's MoE layers run under the plugin; GPT-OSS's biased experts too), or on an
    expert-parallel shard its exchange (same bits)."""
    shard = getattr(self, EXPERT_PARALLEL_ATTR, None)
    if shard is not None:
        return shard(self, hidden_states, top_k_index, top_k_weights)
    return module_experts_forward(self, hidden_states, top_k_index, top_k_weights)


# ----------------------------------------------------------------------------------------------
# Per-model-type patches
# ----------------------------------------------------------------------------------------------


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"samepath's MLP patch implements SiLU·mul, not hidden_act={self.config.hidden_act!r}")
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _fused_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"samepath's MLP patch implements SiLU·mul, not hidden_act={self.config.hidden_act!r}")
    return self.down_proj(swiglu(self.gate_up_proj(x)))


def _gelu_tanh_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            "samepath's Gemma MLP patch implements GELU-tanh·mul (gelu_pytorch_tanh), not "
            f"hidden_activation={self.config.hidden_activation!r}"
        )
    return self.down_proj(gelu_tanh_mul(self.gate_proj(x), self.up_proj(x)))


#: The MLP forwards samepath installs (:func:`mlp_forward_of` picks one per family), by the op the audit reports.
MLP_FORWARDS = (_mlp_forward, _fused_mlp_forward, _gelu_tanh_mlp_forward)
MLP_OPS = {_mlp_forward: "silu_mul", _fused_mlp_forward: "silu_mul", _gelu_tanh_mlp_forward: "gelu_tanh_mul"}

#: model types whose ``{Prefix}MLP`` is ``act_fn(gate_proj(x)) * up_proj(x)`` with GELU-tanh.
GELU_TANH_MLP: Set[str] = model_types_where(lambda family: family.activation == GELU_TANH_MUL)


def mlp_forward_of(family: ModelFamily) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """The ``{Prefix}MLP.forward`` samepath installs for a family: by its activation and whether its
    gate and up projections are one fused ``gate_up_proj``."""
    if family.activation == GELU_TANH_MUL and not family.fused_gate_up:
        return _gelu_tanh_mlp_forward
    if family.activation == SILU_MUL:
        return _fused_mlp_forward if family.fused_gate_up else _mlp_forward
    raise ValueError(
        f"samepath has no Hugging Face MLP patch for {family.activation.op}"
        f"{' with a fused gate_up_proj' if family.fused_gate_up else ''} (model_type={family.name!r})"
    )


def _sigmoid_grouped_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """``Glm4MoeTopkRouter.forward``: the fp32 router logits (``F.linear`` of the fp32 input and
    weight, on samepath's matmul), then :func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing`
    — the function vLLM's MoE layer runs under the plugin."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    with torch.autocast(hidden_states.device.type, enabled=False):  # fp32 under a trainer's autocast too
        router_logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
    index, weights = sigmoid_grouped_topk_routing(
        router_logits,
        self.e_score_correction_bias,
        self.top_k,
        self.num_group,
        self.topk_group,
        bool(self.norm_topk_prob),
        float(self.routed_scaling_factor),
    )
    return router_logits, weights, index


#: A family's ``moe`` -> the forward samepath installs on its ``{Prefix}{hf_router}`` class.
ROUTER_FORWARDS = {
    SIGMOID_GROUPED_TOPK: _sigmoid_grouped_router_forward,
    TOPK_SOFTMAX_BIASED: biased_topk_router_forward,
}


def samepath_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def rotary_embedding_forward(
    self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    rope = rope_formula(self.config, layer_type)  # Gemma 3: the rope of this layer type (local or global)
    if rope.mrope_section is not None:  # Qwen3-VL: position ids [3, batch, seq]
        section, interleaved = list(rope.mrope_section), rope.mrope_interleaved
        return mrope_cos_sin(position_ids, rope.rotary_dim, rope.base, x.dtype, section, rope.scaling, interleaved)
    return rotary_cos_sin(position_ids, rope.rotary_dim, rope.base, x.dtype, rope.scaling)


def apply_to_model_type(model_type: str, patcher: Patcher) -> None:
    """Patch one architecture's modeling module (works before or after its models are built).

    ``{Prefix}RotaryEmbedding.forward`` computes cos/sin with :func:`samepath.rotary_cos_sin` from
    :func:`samepath.models.formulas.rope_formula` of the model's config — the function the
    vLLM plugin calls — rather than from the module's ``inv_freq`` buffer (which a
    ``model.to(dtype)`` would round)."""
    family = find(model_type)
    if family is None:
        raise ValueError(
            f"samepath has no Hugging Face patches for model_type={model_type!r}; "
            f"supported: {', '.join(sorted(MODEL_TYPES))}"
        )
    modeling = family.hf_modeling()
    prefix = family.hf_prefix
    patcher.set(getattr(modeling, f"{prefix}RMSNorm"), "forward", RMS_NORM_FORWARDS[family.norm_weight_mode])
    mlp = getattr(modeling, f"{prefix}MLP", None)
    if mlp is not None and family.dense_mlp:
        patcher.set(mlp, "forward", mlp_forward_of(family))
    patcher.set(modeling, "apply_rotary_pos_emb", samepath_apply_rotary_pos_emb)
    patcher.set(getattr(modeling, f"{prefix}{family.hf_rotary}"), "forward", rotary_embedding_forward)
    if family.softcap:  # Gemma 2: the final logits capped by samepath's kernel (vLLM's LogitsProcessor's too)
        causal_lm = getattr(modeling, f"{prefix}ForCausalLM")
        patcher.set(causal_lm, "forward", softcapped_causal_lm_forward(causal_lm.forward))
    if family.hf_router is not None:
        patcher.set(getattr(modeling, f"{prefix}{family.hf_router}"), "forward", ROUTER_FORWARDS[family.moe])
    if family.mla:  # DeepSeek-V3: the attention module in samepath's absorbed MLA form
        patcher.set(getattr(modeling, f"{prefix}Attention"), "forward", mla_attention_forward)
    if family.linear_attention or family.attention_output_gate or family.shared_expert_gate:
        apply_linear_attention(family, patcher)  # Qwen3-Next / Qwen3.5: hf_linear_attention.py


def register_interfaces(patcher: Patcher, replace_defaults: bool) -> None:
    """Register ``"samepath"`` in transformers' attention, mask and experts interfaces.

    With ``replace_defaults`` the stock implementations a model may already be using (``sdpa``,
    ``eager`` attention; ``grouped_mm``, ``batched_mm`` experts) are routed to samepath too, so
    models built before :func:`samepath.integrations.patch_all` follow it.
    """
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_utils import AttentionInterface

    attention = AttentionInterface._global_mapping
    masks = AttentionMaskInterface._global_mapping
    experts = ExpertsInterface._global_mapping
    names = [IMPLEMENTATION, *(("sdpa", "eager") if replace_defaults else ())]
    for name in names:
        patcher.set_item(attention, name, attention_forward)
        patcher.set_item(masks, name, flash_attention_mask)
    for name in [IMPLEMENTATION, *(("grouped_mm", "batched_mm") if replace_defaults else ())]:
        patcher.set_item(experts, name, samepath_experts_forward)


def use_samepath(model: torch.nn.Module, patcher: Patcher) -> None:
    """Point an already-built model's config at the samepath attention and experts; ``patcher``'s
    ``restore`` sets back the implementations the model had."""
    attention = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    patcher.on_restore(lambda: model.set_attn_implementation(attention))
    experts = getattr(model.config, "_experts_implementation", None)
    if hasattr(model, "set_experts_implementation") and experts:
        model.set_experts_implementation(IMPLEMENTATION)
        patcher.on_restore(lambda: model.set_experts_implementation(experts))


# ----------------------------------------------------------------------------------------------
# The trainer's log-probs through the fused lm_head
# ----------------------------------------------------------------------------------------------


def fused_lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    ignore_index: int | None = IGNORE_INDEX,
    token_chunk: int = LM_HEAD_TOKEN_CHUNK,
    validate: bool = True,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.kernels.logprobs.linear_token_logprobs` of ``hidden @ weight.T`` (soft-capped by
    ``softcap``: Gemma 2's final logits), with the
    operands the unfused lm_head call ``F.linear(hidden, weight)`` would multiply: under
    ``torch.autocast`` both are cast to the autocast dtype first (differentiably), as autocast casts
    a linear's operands. The result (fp32 ``[...]`` log-probs, and the entropy) has the bits of
    ``samepath.logprobs(F.linear(hidden, weight), labels, temperature)`` computed with samepath's
    matmul — the rollout's logits — without ever holding more than ``token_chunk`` rows of logits.
    """
    check_linear_logprobs_args(hidden, weight, token_chunk, same_dtype=False)  # the dtypes: after autocast's casts
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return linear_token_logprobs(
        hidden,
        weight,
        labels,
        temperature,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        token_chunk=token_chunk,
        validate=validate,
        softcap=softcap,
    )


def _lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The ``[vocab, hidden]`` weight of a supported causal LM whose logits are exactly
    ``lm_head(last_hidden_state)``; ``ValueError`` otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"causal_lm_logprobs takes a Hugging Face causal LM of model_type {', '.join(sorted(MODEL_TYPES))} "
            f"(logits = lm_head(last hidden state)), got model_type={model_type!r}"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"model's lm_head must be an nn.Linear without bias for the fused path, got {type(head).__name__}"
            + ("" if head is None or getattr(head, "bias", None) is None else " with a bias")
        )
    return head.weight


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    token_chunk: int = LM_HEAD_TOKEN_CHUNK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The trainer's next-token log-probs of a patched Hugging Face causal LM, without logits.

    Runs the model's decoder (``model.model``) on ``input_ids`` ``[B, L]`` and feeds its last
    hidden states to the fused lm_head + token log-probs over fixed chunks of ``token_chunk``
    tokens (:func:`fused_lm_head_logprobs`): no ``[B, L, vocab]`` logits exist, forward or backward
    (the backward recomputes one chunk of logits at a time). Differentiable in every parameter.

    Entry ``[b, j]`` of the ``[B, L - 1]`` fp32 result is ``log p(labels[b, j + 1])`` given the
    tokens up to ``j``, at ``temperature`` (``labels`` defaults to ``input_ids``; its ``-100`` entries, and
    the positions whose next token is padding in ``attention_mask``, give 0 and no gradient).
    Bit-identical to ``samepath.logprobs(model(...).logits[:, :-1], labels[:, 1:], temperature)``
    of the same patched model, which is what samepath's rollouts (``generate`` with
    ``output_logits=True``, vLLM's sampler) compute; the hidden-state gradient is the unfused
    one bit for bit, the lm_head weight's gradient sums fp32 per-chunk partials in chunk order
    (deterministic, other bits than the unfused one). With ``return_entropy``, also the fp32
    entropy of each position's distribution at ``temperature``.

    Pass ``attention_mask`` and ``position_ids`` as for the model's own forward (left-padded rows
    need ``position_ids`` counted from their first real token; packed rows restart them).
    Supported: the model types of :data:`MODEL_TYPES` with a bias-free ``nn.Linear`` lm_head
    (``ValueError`` otherwise, and for ``labels`` / ``attention_mask`` not shaped like
    ``input_ids``).
    """
    weight = _lm_head_weight(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor")
    target = input_ids if labels is None else labels
    if not isinstance(target, torch.Tensor) or target.shape != input_ids.shape:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    next_tokens = target[:, 1:]
    if attention_mask is not None:
        next_tokens = torch.where(attention_mask[:, 1:].to(torch.bool), next_tokens, IGNORE_INDEX)
    decoder = model.get_decoder()
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    return fused_lm_head_logprobs(
        hidden[:, :-1],
        weight,
        next_tokens,
        temperature,
        return_entropy=return_entropy,
        token_chunk=token_chunk,
        softcap=final_logit_softcap(model.config),
    )
