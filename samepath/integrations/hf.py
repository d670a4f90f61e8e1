"""Hugging Face transformers: attention, norms, MLP, rotary and MoE experts on samepath kernels.

Attention goes through transformers' official extension points: ``AttentionInterface`` (the
function below) with ``AttentionMaskInterface`` giving it the 2-D padding mask (transformers'
``flash_attention_mask``: ``None`` or a bool ``[batch, kv]``), so the kernel applies causality
itself. Each row's real tokens are cut out of the padded batch — left and right padding by the
mask, packed sequences by restarts of ``position_ids`` — and attended as sequences that start at
position 0, so the KV tiles are anchored exactly where the rollout's are. Training (no cache)
runs :func:`samepath.varlen_attention` (differentiable); ``generate`` with a KV cache runs
:func:`samepath.kernels.attention.packed_attention`.

Per model type (``config.model_type``), Liger-style: ``{Prefix}RMSNorm.forward`` →
:func:`samepath.rms_norm`, ``{Prefix}MLP.forward`` → :func:`samepath.silu_mul`, the module's
``apply_rotary_pos_emb`` → :func:`samepath.apply_rotary`, ``{Prefix}RotaryEmbedding.forward`` →
:func:`samepath.rotary_cos_sin` (every rope type :mod:`samepath.integrations.formulas` resolves);
MoE experts through ``ExpertsInterface``.
Linear layers and the lm_head go through :func:`samepath.batch_invariant` (entered by
``patch_all``). Every replacement is recorded by :class:`Patcher` and undone by ``unpatch_all``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from samepath.integrations.formulas import UnsupportedModelError, rope_formula
from samepath.integrations.moe import experts_forward
from samepath.kernels.attention import packed_attention, varlen_attention
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul

#: The name models use in ``attn_implementation=`` / ``experts_implementation=``.
IMPLEMENTATION = "samepath"

#: model_type -> (modeling module, class-name prefix) of the architectures patched per type.
MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe"),
}


class Patcher:
    """Records every attribute it replaces so that :meth:`restore` puts the originals back."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        present = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        self._originals.append((owner, name, present, getattr(owner, name, None)))
        setattr(owner, name, value)

    def set_item(self, mapping: dict, key: str, value: Any) -> None:
        self._originals.append((mapping, key, key in mapping, mapping.get(key)))
        mapping[key] = value

    def on_restore(self, undo: Callable[[], object]) -> None:
        """Have :meth:`restore` call ``undo`` (in reverse order with the recorded replacements)."""
        self._originals.append((None, "", True, undo))

    def restore(self) -> None:
        while self._originals:
            owner, name, present, original = self._originals.pop()
            if owner is None:
                original()
            elif isinstance(owner, dict):
                if present:
                    owner[name] = original
                else:
                    owner.pop(name, None)
            elif present:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def _segments(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, q_len: int, kv_len: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Cut a padded batch into sequences: flat query indices, flat KV indices, and their cu lengths.

    Row ``b``'s real tokens are the one contiguous run of ``attention_mask[b]`` (all of it when
    there is no mask). Without a cache (``q_len == kv_len``) the run is split further wherever
    ``position_ids`` does not continue by +1 (packed sequences). The queries are the last
    ``q_len`` KV slots; those inside a run attend over the run up to themselves.
    """
    mask = None if attention_mask is None else attention_mask[:, -kv_len:].to(torch.bool).cpu()
    positions = None if position_ids is None or q_len != kv_len else position_ids.cpu()
    q_index: list[int] = []
    kv_index: list[int] = []
    cu_q, cu_kv = [0], [0]
    first_query_slot = kv_len - q_len
    for b in range(batch):
        if mask is None:
            first, end = 0, kv_len
        else:
            real = mask[b].nonzero().flatten()
            if real.numel() == 0:
                continue
            first, end = int(real[0]), int(real[-1]) + 1
            if real.numel() != end - first:
                raise ValueError(
                    "attention_mask must mark one contiguous run of real tokens per row (left and/or right "
                    f"padding); row {b} has holes"
                )
        starts = [first]
        if positions is not None:
            row = positions[b if positions.shape[0] > 1 else 0]
            starts += [i for i in range(first + 1, end) if row[i] != row[i - 1] + 1]
        for start, stop in zip(starts, [*starts[1:], end], strict=True):
            query_slots = range(max(start, first_query_slot), stop)
            if not query_slots:
                continue
            kv_index.extend(range(b * kv_len + start, b * kv_len + stop))
            q_index.extend(b * q_len + slot - first_query_slot for slot in query_slots)
            cu_kv.append(len(kv_index))
            cu_q.append(len(q_index))
    return q_index, kv_index, cu_q, cu_kv


#: Keyword arguments transformers passes along to an attention function that do not change what
#: it computes (model-level flags); any other unknown keyword is refused, never ignored.
_NEUTRAL_ATTENTION_KWARGS = frozenset(
    {"use_cache", "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict"}
)


class UnsupportedAttentionError(ValueError):
    """transformers asked samepath's attention for a feature it does not implement (softcap, sinks,
    dropout, attention weights, an unknown keyword): refused rather than dropped."""


def _check_attention_kwargs(
    module: torch.nn.Module, dropout: float, kwargs: dict[str, Any], cu_q: list[int], unpadded_packed: bool
) -> None:
    where = type(module).__name__
    problems = []
    if dropout:
        problems.append(f"dropout={dropout} (attention dropout in train mode; set attention_dropout=0)")
    if kwargs.get("softcap") is not None:
        problems.append(f"softcap={kwargs['softcap']} (logit soft-capping, e.g. Gemma 2)")
    if kwargs.get("s_aux") is not None:
        problems.append("s_aux (attention sinks, e.g. GPT-OSS)")
    if kwargs.get("output_attentions"):
        problems.append("output_attentions=True (samepath returns no attention weights)")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = kwargs.get(name)
        if given is not None and not (unpadded_packed and [int(x) for x in given.flatten()] == cu_q):
            problems.append(f"{name} that differs from the sequences position_ids / the mask delimit")
    known = {"softcap", "s_aux", "output_attentions", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"}
    known |= {"max_length_q", "max_length_k"} | _NEUTRAL_ATTENTION_KWARGS
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
    kernel gives the rollout for the same tokens.

    Raises :class:`UnsupportedAttentionError` for dropout > 0, a ``softcap``, sinks (``s_aux``),
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
    if sliding_window is not None and q_len != kv_len:
        raise ValueError(
            "samepath's Hugging Face attention does not support sliding-window layers with a KV cache yet "
            "(the cache may have dropped the sequence's first positions)"
        )
    scale = scaling if scaling is not None else head_size**-0.5
    q_index, kv_index, cu_q, cu_kv = _segments(attention_mask, kwargs.get("position_ids"), batch, q_len, kv_len)
    _check_attention_kwargs(module, dropout, kwargs, cu_q, unpadded_packed=batch == 1 and cu_q == cu_kv)
    device = query.device
    q_rows = torch.tensor(q_index, dtype=torch.int64, device=device)
    kv_rows = torch.tensor(kv_index, dtype=torch.int64, device=device)
    q = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_size).index_select(0, q_rows)
    k = key.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, head_size).index_select(0, kv_rows)
    v = value.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, head_size).index_select(0, kv_rows)
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
    if cu_q == cu_kv:
        out = varlen_attention(q, k, v, cu_q_t, scale, causal, sliding_window=sliding_window)
    else:
        cu_kv_t = torch.tensor(cu_kv, dtype=torch.int32, device=device)
        out = packed_attention(q, k, v, cu_q_t, cu_kv_t, scale, causal=causal, sliding_window=sliding_window)
    full = query.new_zeros(batch * q_len, num_heads, head_size).index_copy(0, q_rows, out)
    return full.view(batch, q_len, num_heads, head_size), None


def samepath_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``ExpertsInterface`` function: :func:`samepath.integrations.moe.experts_forward` on the
    module's ``gate_up_proj`` / ``down_proj`` (the loop vLLM's MoE layers run under the plugin)."""
    return experts_forward(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)


# ----------------------------------------------------------------------------------------------
# Per-model-type patches
# ----------------------------------------------------------------------------------------------


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"samepath's MLP patch implements SiLU·mul, not hidden_act={self.config.hidden_act!r}")
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _rotary_embedding_forward(
    self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if layer_type is not None:
        raise UnsupportedModelError(f"per-layer-type rope ({layer_type!r}) is not supported")
    rope = rope_formula(self.config)
    return rotary_cos_sin(position_ids, rope.rotary_dim, rope.base, x.dtype, rope.scaling)


def apply_to_model_type(model_type: str, patcher: Patcher) -> None:
    """Patch one architecture's modeling module (works before or after its models are built).

    ``{Prefix}RotaryEmbedding.forward`` computes cos/sin with :func:`samepath.rotary_cos_sin` from
    :func:`samepath.integrations.formulas.rope_formula` of the model's config — the function the
    vLLM plugin calls — rather than from the module's ``inv_freq`` buffer (which a
    ``model.to(dtype)`` would round)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"samepath has no Hugging Face patches for model_type={model_type!r}; "
            f"supported: {', '.join(sorted(MODEL_TYPES))}"
        )
    module_name, prefix = MODEL_TYPES[model_type]
    modeling = importlib.import_module(module_name)
    patcher.set(getattr(modeling, f"{prefix}RMSNorm"), "forward", _rms_norm_forward)
    mlp = getattr(modeling, f"{prefix}MLP", None)
    if mlp is not None:
        patcher.set(mlp, "forward", _mlp_forward)
    patcher.set(modeling, "apply_rotary_pos_emb", _apply_rotary_pos_emb)
    patcher.set(getattr(modeling, f"{prefix}RotaryEmbedding"), "forward", _rotary_embedding_forward)


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


#: The ``nn.Linear`` submodules of a decoder layer that a tensor-parallel rollout (vLLM's
#: ``RowParallelLinear``) shards along K: their output is a sum over the ranks' partials.
ROW_PARALLEL_LINEARS = ("self_attn.o_proj", "mlp.down_proj")


@contextmanager
def tensor_parallel_numerics(model: torch.nn.Module, tensor_parallel_size: int) -> Iterator[None]:
    """Run ``model`` (a patched dense Hugging Face decoder) with the numerics of a rollout at tensor
    parallelism ``S``: every row-parallel linear (:data:`ROW_PARALLEL_LINEARS`) computes
    ``samepath.linear(x, w, b, k_slices=S)`` — the K dimension in ``S`` slices summed in slice
    order, what ``samepath.distributed.row_parallel_linear`` computes across ``S`` ranks and what
    samepath's vLLM plugin runs at ``tensor_parallel_size=S``. The other layers need nothing: a
    column-parallel or head-parallel split does not change any reduction. Differentiable.

    Raises ``ValueError`` for a mixture-of-experts model (its experts are row-parallel too, and
    the vLLM plugin refuses expert tensor parallelism) or a row-parallel layer whose input features
    are not divisible by ``S``.
    """
    from samepath.kernels.matmul import linear

    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:  # the unsliced schedule: nothing to change
        yield
        return
    layers = []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            raise ValueError(f"tensor_parallel_numerics does not cover mixture-of-experts layers ({name})")
        if isinstance(module, torch.nn.Linear) and name.endswith(tuple("." + p for p in ROW_PARALLEL_LINEARS)):
            if module.in_features % tensor_parallel_size:
                raise ValueError(
                    f"{name} has {module.in_features} input features, not divisible by "
                    f"tensor_parallel_size={tensor_parallel_size}"
                )
            layers.append(module)
    if not layers:
        raise ValueError("model has no row-parallel linears (self_attn.o_proj / mlp.down_proj) to slice")

    def sliced(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias, k_slices=tensor_parallel_size)

    saved = [vars(module).get("forward") for module in layers]  # e.g. accelerate's hooks
    for module in layers:
        module.forward = functools.partial(sliced, module)
    try:
        yield
    finally:
        for module, forward in zip(layers, saved, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
