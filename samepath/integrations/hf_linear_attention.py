"""Hugging Face's hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE) on samepath's kernels.

Installed by :func:`samepath.integrations.hf.apply_to_model_type` from a family's descriptor
(``linear_attention``, ``attention_output_gate``, ``shared_expert_gate``):

* ``{Prefix}GatedDeltaNet.forward`` -> :func:`gated_delta_net_forward`: the real tokens of the padded batch
  (``attention_mask``; packed sequences split where ``position_ids`` do not continue by +1, as samepath's
  attention splits them) packed into sequences that start at their first token; the causal conv1d
  (:func:`samepath.kernels.causal_conv1d.causal_conv1d`), the gates
  (:func:`samepath.kernels.gated_ops.gated_delta_gates`), the delta rule on samepath's one schedule
  (:func:`samepath.kernels.gated_delta.chunk_gated_delta` for the trainer,
  :func:`~samepath.kernels.gated_delta.gated_delta_continue_slots` with a cache; a differentiable prefill that
  also fills a cache — Hugging Face's default ``use_cache`` — runs both, the same bits; gradients through a
  continuation are refused) and the gated output norm
  (:func:`samepath.kernels.gated_ops.gated_rms_norm`). Padding rows come back as zeros. Host reads: none for a
  decode step (or a forward given neither a mask nor ``position_ids``); one per forward (not per layer) with
  a padding mask or ``position_ids`` to split at (Hugging Face passes them on every forward; the token and
  sequence counts size the launches).
* ``generate``'s cache: each Gated DeltaNet layer's entry of the model's hybrid cache (transformers'
  ``LinearAttentionLayer``) carries samepath's state as attributes: :data:`CONV_STATE_ATTR` (each row's last
  ``W - 1`` conv inputs) and :data:`DELTA_CACHE_ATTR` (a :class:`~samepath.kernels.gated_delta.GatedDeltaSlots`,
  slot r = row r: the boundary state plus the ``< C`` tokens since it, updated in place on the device; beam
  search indexes the slot buffers). Hugging Face's own fixed recurrent state is never read or written; an
  entry Hugging Face's stock code filled is refused, never continued from.
* ``{Prefix}RMSNormGated.forward`` -> the gated norm; ``{Prefix}Attention.forward`` -> Hugging Face's with
  the output gate on :func:`~samepath.kernels.gated_ops.sigmoid_gate`; ``{Prefix}SparseMoeBlock.forward``
  -> Hugging Face's with the shared expert's gate on it; ``{Prefix}DecoderLayer.forward`` hands
  ``position_ids`` to its Gated DeltaNet layer (Hugging Face's decoder layer does not).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import sys
import weakref
from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.kernels.causal_conv1d import causal_conv1d
from samepath.kernels.gated_delta import GatedDeltaSlots, chunk_gated_delta, gated_delta_continue_slots
from samepath.kernels.gated_ops import gated_delta_gates, gated_rms_norm, sigmoid_gate
from samepath.kernels.opaque import compile_opaque
from samepath.models.descriptor import ModelFamily

# Under torch.compile samepath's kernels are torch.library custom ops (samepath.kernels.opaque: Dynamo records one
# node each, never traces a launcher; eager bits); the packing, with its host read, is an opaque planning call.

#: The attributes of a cache layer that hold samepath's Gated DeltaNet state.
CONV_STATE_ATTR = "samepath_conv_state"
DELTA_CACHE_ATTR = "samepath_delta_cache"
#: Set on a cache layer a forward over packed sequences filled: it cannot be continued.
PACKED_ATTR = "samepath_packed"
#: The attribute through which a decoder layer hands its ``position_ids`` to its Gated DeltaNet layer.
POSITION_IDS_ATTR = "samepath_position_ids"


class LinearAttentionCacheError(ValueError):
    """A cache samepath cannot continue from with its own schedule (filled by the stock layer, reordered)."""


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where a padded ``[batch, length]`` forward's Gated DeltaNet sequences lie: ``index`` (the flat positions of
    the real tokens, in order), ``cu_seqlens`` ``[N + 1]`` over them, and whether there is exactly one sequence
    per row (what a cache needs)."""

    index: torch.Tensor
    cu_seqlens: torch.Tensor
    one_per_row: bool


def packing(
    real: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device,
    split: bool,
) -> Packing:  # fmt: skip
    """The real tokens of ``[batch, length]`` (per row the one contiguous run ``real`` marks, all without a mask),
    cut into sequences at each run's start and, with ``split``, wherever ``position_ids`` do not continue by +1
    (packed sequences). Without a mask and with nothing to split at (``split`` off, as for a decode step, or
    no ``position_ids``) every row is one sequence: no host read. Otherwise computed on the device with one
    host read (the checks and the token and sequence counts, which size the kernel launches); ``ValueError``
    for a row with holes."""
    if real is None and (not split or position_ids is None):
        index = torch.arange(batch * length, device=device)
        cu = torch.arange(batch + 1, device=device) * length
        return Packing(index, cu, batch > 0 and length > 0)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device) if real is None else real.to(device, torch.bool)
    as_int = mask.to(torch.uint8)
    present = mask.any(1)
    first = torch.where(present, as_int.argmax(1), 0)
    end = torch.where(present, length - as_int.flip(1).argmax(1), 0)
    holes = present & (mask.sum(1) != end - first)
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    if split and position_ids is not None:
        pos = position_ids[0] if position_ids.dim() == 3 else position_ids
        pos = pos.to(device).expand(batch, length)
        starts[:, 1:] |= mask[:, 1:] & (pos[:, 1:] != pos[:, :-1] + 1)
    counts = torch.stack([holes.any(), present.all(), mask.sum(), starts.sum()])
    any_holes, all_present, tokens, sequences = counts.tolist()  # the one host read
    if any_holes:
        row = holes.to(torch.uint8).argmax().item()
        raise ValueError(
            f"samepath's Gated DeltaNet layer: attention_mask row {row} has holes (its real tokens must be one "
            "contiguous run, padding before or after it)"
        )
    index = torch.nonzero_static(mask.flatten(), size=tokens).flatten()
    first_tokens = torch.nonzero_static(starts.flatten()[index], size=sequences).flatten()
    cu = torch.cat([first_tokens, first_tokens.new_full((1,), tokens)])
    return Packing(index, cu, bool(all_present) and sequences == batch)


_PACKING_CACHE: collections.OrderedDict[tuple, tuple[tuple, Packing]] = collections.OrderedDict()
_PACKING_CACHE_SIZE = 8


def _source(tensor: torch.Tensor | None) -> tuple:
    return (None, -1) if tensor is None else (weakref.ref(tensor), tensor._version)


def _same(saved: tuple, tensor: torch.Tensor | None) -> bool:
    ref, version = saved
    if tensor is None:
        return ref is None
    return ref is not None and ref() is tensor and tensor._version == version


def _cached_packing(real, position_ids, batch: int, length: int, device: torch.device, split: bool) -> Packing:
    """:func:`packing`, computed once per forward: reused while the same (unmodified) mask and position ids come
    back (every Gated DeltaNet layer of a forward gets the same tensors), so its host read (with a mask or packed
    sequences) is one per forward, not one per layer."""
    if not split:
        position_ids = None
    if real is None and position_ids is None:  # one sequence per row: no host read, nothing to memoise
        return packing(None, None, batch, length, device, split)
    key = (id(real), id(position_ids), batch, length, device, split)
    entry = _PACKING_CACHE.get(key)
    if entry is not None and _same(entry[0][0], real) and _same(entry[0][1], position_ids):
        _PACKING_CACHE.move_to_end(key)
        return entry[1]
    found = packing(real, position_ids, batch, length, device, split)
    _PACKING_CACHE[key] = ((_source(real), _source(position_ids)), found)
    while len(_PACKING_CACHE) > _PACKING_CACHE_SIZE:
        _PACKING_CACHE.popitem(last=False)
    return found


cached_packing = compile_opaque(_cached_packing, planning=True)  # its host read and cache run eagerly when compiled


def _projections(self: torch.nn.Module, hidden: torch.Tensor):
    """``(mixed_qkv [B, L, conv_dim], z [B, L, HV, DV], b [B, L, HV], a [B, L, HV])`` as Hugging Face's layer
    makes them (Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` with its head ordering, or Qwen3.5's
    separate projections)."""
    batch, length, _ = hidden.shape
    if hasattr(self, "in_proj_qkvz"):
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden), self.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    z = self.in_proj_z(hidden).reshape(batch, length, -1, self.head_v_dim)
    return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)


def gated_delta_net_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``{Prefix}GatedDeltaNet.forward`` on samepath's kernels (see the module docstring)."""
    legacy = kwargs.pop("cache_params", None)  # transformers < 5.2x names the cache so
    cache = legacy if cache is None else cache
    if self.activation not in ("silu", "swish"):
        raise ValueError(f"samepath's Gated DeltaNet layer fuses SiLU into the conv1d, got {self.activation!r}")
    batch, length, _ = hidden_states.shape
    layer = None if cache is None else cache.layers[self.layer_idx]
    conv_state = None if layer is None else getattr(layer, CONV_STATE_ATTR, None)
    delta_cache = None if layer is None else getattr(layer, DELTA_CACHE_ATTR, None)
    continuing = delta_cache is not None
    if layer is not None and not continuing and any(layer.has_previous_state.values()):
        raise LinearAttentionCacheError(
            f"layer {self.layer_idx}: this cache was filled by Hugging Face's stock Gated DeltaNet layer (a fixed "
            "recurrent state); samepath continues only from its own boundary state and partial chunk"
        )
    if layer is not None and getattr(layer, PACKED_ATTR, False):
        raise LinearAttentionCacheError(
            f"layer {self.layer_idx}: this cache was filled by a forward over packed sequences (several per row); "
            "samepath's Gated DeltaNet cache continues one sequence per row"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"samepath's Gated DeltaNet layer takes a 2-D padding mask, got {attention_mask.dim()}-D")
    position_ids = getattr(self, POSITION_IDS_ATTR, None)
    packed = cached_packing(attention_mask, position_ids, batch, length, hidden_states.device, not continuing)
    if continuing and not packed.one_per_row:
        raise LinearAttentionCacheError(
            "samepath's Gated DeltaNet cache continues one sequence per row: every row needs new real tokens"
        )
    if layer is not None and not packed.one_per_row:  # a packed trainer forward with use_cache: no continuation
        setattr(layer, PACKED_ATTR, True)
        layer = None
    index, cu = packed.index, packed.cu_seqlens

    mixed, z, b, a = _projections(self, hidden_states)
    x = mixed.reshape(batch * length, -1)[index]
    weight = self.conv1d.weight[:, 0]
    x, new_conv = causal_conv1d(x, weight, self.conv1d.bias, cu, conv_state, "silu", validate=False)  # our packing
    q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(-1, self.num_k_heads, self.head_k_dim)
    k = k.reshape(-1, self.num_k_heads, self.head_k_dim)
    v = v.reshape(-1, self.num_v_heads, self.head_v_dim)
    g, beta = gated_delta_gates(
        a.reshape(batch * length, -1)[index], b.reshape(batch * length, -1)[index], self.A_log, self.dt_bias
    )
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    if continuing and differentiable:
        raise LinearAttentionCacheError(
            "gradients through a Gated DeltaNet cache continuation are not supported (the trainer's forward runs "
            "whole sequences: pass use_cache=False, or run the continuation under torch.no_grad())"
        )
    if layer is None or differentiable:  # the trainer (a cache of its prefill too: HF's default use_cache)
        out, _ = chunk_gated_delta(q, k, v, g, beta, cu, validate=False)  # cu built on the device
    if layer is not None:
        if delta_cache is None:  # a prefill: one fresh slot per row
            delta_cache = GatedDeltaSlots.allocate(
                batch, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, q.dtype, q.device
            )
        elif delta_cache.state.shape[0] != batch:
            raise LinearAttentionCacheError(
                f"layer {self.layer_idx}: the cache holds {delta_cache.state.shape[0]} rows, this forward has {batch}"
            )
        detached = [t.detach() for t in (q, k, v, g, beta)]
        slot_ids = torch.arange(batch, device=q.device)  # row r is slot r (beam search reorders the slots)
        fresh = gated_delta_continue_slots(*detached, cu, delta_cache, slot_ids)
        out = out if differentiable else fresh
        _store(layer, new_conv, delta_cache, length)
    z = z.reshape(batch * length, self.num_v_heads, self.head_v_dim)[index]
    out = gated_rms_norm(out, z, self.norm.weight, self.norm.variance_epsilon).reshape(index.numel(), -1)
    full = out.new_zeros((batch * length, out.shape[-1])).index_copy(0, index, out)
    return self.out_proj(full.view(batch, length, -1))


def _store(layer: Any, conv_state: torch.Tensor, delta_cache: GatedDeltaSlots, new_tokens: int) -> None:
    """Keep samepath's state on the cache layer and Hugging Face's token count (its ``get_seq_length``)."""
    setattr(layer, CONV_STATE_ATTR, conv_state)
    setattr(layer, DELTA_CACHE_ATTR, delta_cache)
    if getattr(layer, "device", None) is None:
        layer.device, layer.dtype = conv_state.device, conv_state.dtype
    count = getattr(layer, "cumulative_length_linear", None)  # transformers >= 5.2x counts a linear layer's tokens
    if count is not None:
        layer.cumulative_length_linear = count.to(conv_state.device).add_(new_tokens)


def reorder_delta_cache(cache: GatedDeltaSlots, index: torch.Tensor) -> GatedDeltaSlots:
    """The rows ``index`` of a layer's per-row :class:`GatedDeltaSlots` (beam search's reordering): every slot
    buffer indexed on the device (boundary states, tails, tail lengths), no host read."""
    index = index.to(cache.state.device, torch.int64)
    return GatedDeltaSlots(*(getattr(cache, f.name).index_select(0, index) for f in dataclasses.fields(cache)))


def _cache_layer_reset(original):
    @functools.wraps(original)
    def reset(self) -> None:
        original(self)
        for name in (CONV_STATE_ATTR, DELTA_CACHE_ATTR, PACKED_ATTR):
            if hasattr(self, name):
                delattr(self, name)

    reset.samepath_cache_layer = True
    return reset


def _cache_layer_reorder(original):
    @functools.wraps(original)
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        original(self, beam_idx)
        if getattr(self, DELTA_CACHE_ATTR, None) is not None:
            setattr(self, CONV_STATE_ATTR, getattr(self, CONV_STATE_ATTR).index_select(0, beam_idx.to(self.device)))
            setattr(self, DELTA_CACHE_ATTR, reorder_delta_cache(getattr(self, DELTA_CACHE_ATTR), beam_idx))

    reorder_cache.samepath_cache_layer = True
    return reorder_cache


def _cache_layer_crop(original):
    @functools.wraps(original)
    def crop(self, tokens_to_remove: int) -> None:
        if getattr(self, DELTA_CACHE_ATTR, None) is not None:
            raise LinearAttentionCacheError(
                "cropping a Gated DeltaNet cache (assisted / speculative decoding) is not supported by samepath's "
                "schedule: its boundary state cannot be rolled back"
            )
        original(self, tokens_to_remove)

    crop.samepath_cache_layer = True
    return crop


def _patch_cache_layers(patcher: Patcher) -> None:
    """transformers' linear-attention cache layer: ``reset`` drops samepath's state, ``reorder_cache`` (beam
    search) reorders it, ``crop`` (assisted decoding) refuses it by name."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if mixin is None or getattr(mixin.reset, "samepath_cache_layer", False):
        return
    for name, wrap in (
        ("reset", _cache_layer_reset),
        ("reorder_cache", _cache_layer_reorder),
        ("crop", _cache_layer_crop),
    ):
        if hasattr(mixin, name):
            patcher.set(mixin, name, wrap(getattr(mixin, name)))


def rms_norm_gated_forward(self: torch.nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``{Prefix}RMSNormGated.forward``: :func:`samepath.kernels.gated_ops.gated_rms_norm`."""
    return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)


def gated_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Hugging Face's gated attention (``Qwen3NextAttention.forward``) with the output gate on
    :func:`~samepath.kernels.gated_ops.sigmoid_gate`; the rest is the module's own code (q/k norms, the
    module's ``apply_rotary_pos_emb`` and attention interface, which samepath patches)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    legacy = kwargs.pop("past_key_values", None)  # transformers < 5.2x names the cache so
    cache = legacy if cache is None else cache
    modeling = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = self.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward
    )
    out, weights = attention(
        self, query, key, value, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs,
    )  # fmt: skip
    out = sigmoid_gate(out.reshape(*input_shape, -1).contiguous(), gate)
    return self.o_proj(out), weights


def shared_expert_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``{Prefix}SparseMoeBlock.forward`` with the shared expert's gate on
    :func:`~samepath.kernels.gated_ops.sigmoid_gate` (routing, experts and the dtype add as Hugging Face's)."""
    batch, length, hidden = hidden_states.shape
    flat = hidden_states.view(-1, hidden)
    shared = self.shared_expert(flat)
    _, weights, experts = self.gate(flat)
    out = self.experts(flat, experts, weights)
    shared = sigmoid_gate(shared, self.shared_expert_gate(flat).expand_as(shared))
    return (out + shared).reshape(batch, length, hidden)


def _decoder_layer_forward(original):
    params = [p.name for p in inspect.signature(original).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    at = params.index("position_ids") - 1 if "position_ids" in params else None  # after self

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any):
        linear = getattr(self, "linear_attn", None)
        if linear is None:
            return original(self, *args, **kwargs)
        position_ids = args[at] if at is not None and at < len(args) else kwargs.get("position_ids")
        setattr(linear, POSITION_IDS_ATTR, position_ids)
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(linear, POSITION_IDS_ATTR, None)

    forward.samepath_decoder_layer = True
    return forward


def is_patched_decoder_layer(forward: Any) -> bool:
    return bool(getattr(forward, "samepath_decoder_layer", False))


def apply_to_family(family: ModelFamily, patcher: Patcher) -> None:
    """Patch a hybrid family's Gated DeltaNet, gated attention and shared-expert MoE classes."""
    modeling = family.hf_modeling()
    prefix = family.hf_prefix
    if family.linear_attention:
        patcher.set(getattr(modeling, f"{prefix}GatedDeltaNet"), "forward", gated_delta_net_forward)
        patcher.set(getattr(modeling, f"{prefix}RMSNormGated"), "forward", rms_norm_gated_forward)
        layer = getattr(modeling, f"{prefix}DecoderLayer")
        if not is_patched_decoder_layer(layer.forward):
            patcher.set(layer, "forward", _decoder_layer_forward(layer.forward))
        _patch_cache_layers(patcher)
    if family.attention_output_gate:
        patcher.set(getattr(modeling, f"{prefix}Attention"), "forward", gated_attention_forward)
    if family.shared_expert_gate:
        patcher.set(getattr(modeling, f"{prefix}SparseMoeBlock"), "forward", shared_expert_moe_forward)


__all__ = [
    "CONV_STATE_ATTR",
    "DELTA_CACHE_ATTR",
    "PACKED_ATTR",
    "POSITION_IDS_ATTR",
    "LinearAttentionCacheError",
    "Packing",
    "apply_to_family",
    "cached_packing",
    "gated_attention_forward",
    "gated_delta_net_forward",
    "is_patched_decoder_layer",
    "packing",
    "reorder_delta_cache",
    "rms_norm_gated_forward",
    "shared_expert_moe_forward",
]
