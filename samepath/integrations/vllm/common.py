"""What the vLLM and vllm-ascend integrations share besides the environment and the sampler.

* :func:`apply_patch_groups`: reversible patches (one :class:`~samepath.integrations.patcher.Patcher`)
  under :func:`samepath.batch_invariant`; :func:`optional_module`.
* :class:`StepCache`: values derived from one step's attention metadata, built by the first
  layer that sees that metadata object and reused by the others.
* :func:`cached_cos_sin`: rotary cos/sin of one step's positions, computed once per step.
* :func:`validate_metadata`: whether the first layer of a step checks the metadata's values (once per
  layout by default).
* :func:`rms_norm`, :func:`linear`, :func:`swiglu`, :func:`geglu_tanh`, :func:`apply_rotary`, :func:`rotary_cos_sin`,
  :func:`moe`: the kernels, as opaque custom ops when called inside a torch.compile'd region.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from samepath.integrations.moe import (
    biased_experts_forward,
    experts_forward,
    topk_softmax_biased_routing,
    topk_softmax_routing,
)
from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.env import VALIDATE_ENV_VAR
from samepath.kernels.gelu_tanh_mul import geglu_tanh as _kernel_geglu_tanh
from samepath.kernels.matmul import batch_invariant
from samepath.kernels.matmul import linear as _kernel_linear
from samepath.kernels.moe_routing import sigmoid_grouped_topk_routing
from samepath.kernels.rms_norm import rms_norm as _kernel_rms_norm
from samepath.kernels.rotary import apply_rotary as _kernel_apply_rotary
from samepath.kernels.rotary import rotary_cos_sin as _kernel_rotary_cos_sin
from samepath.kernels.swiglu import swiglu as _kernel_swiglu
from samepath.models.formulas import routing_weights_fp32
from samepath.models.registry import find


def apply_patch_groups(groups: Sequence[tuple[str, Callable[[Patcher], bool]]], installed: list[str]) -> ExitStack:
    """Enter :func:`samepath.batch_invariant` and apply each ``(name, patch)`` group with one
    :class:`Patcher`, appending the names of the groups that applied to ``installed``. Closing the
    returned stack restores every original and empties ``installed``; on an error, whatever was
    applied is undone before it propagates."""
    stack = ExitStack()
    try:
        patcher = Patcher()
        stack.callback(patcher.restore)
        stack.callback(installed.clear)
        stack.enter_context(batch_invariant())
        for name, patch in groups:
            if patch(patcher):
                installed.append(name)
    except BaseException:
        stack.close()
        raise
    return stack


def optional_module(name: str):
    """The module ``name``, or ``None`` when it does not import (an optional vLLM part)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def has_dense_weight(layer: torch.nn.Module) -> bool:
    """Whether ``layer.weight`` is a plain 2-D float weight :func:`samepath.linear` can read."""
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.numel() > 0
        and not weight.is_meta
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def capturing_graph() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: Metadata layouts whose values were checked once (``SAMEPATH_VLLM_VALIDATE`` unset: ``shape``).
_checked_layouts: set[tuple] = set()
_VALIDATE_MODES = {
    "": "shape", "shape": "shape",
    "1": "step", "step": "step", "on": "step", "true": "step", "yes": "step",
    "0": "off", "off": "off", "false": "off", "no": "off",
}  # fmt: skip


def validate_metadata(layout: tuple) -> bool:
    """Whether the first attention layer of a step should check the metadata's values, one
    device-to-host copy (:data:`VALIDATE_ENV_VAR`): ``shape`` (the default) the first time this
    process sees the ``layout`` (the metadata's shapes), so a steady decode step reads nothing
    from the device; ``1`` / ``step`` (debugging) every step; ``off`` never. Never while a graph is
    captured or compiled."""
    value = os.environ.get(VALIDATE_ENV_VAR, "").strip().lower()
    if value not in _VALIDATE_MODES:
        raise ValueError(f"{VALIDATE_ENV_VAR}={value!r}: expected shape (the default), 1 / step, or 0 / off")
    mode = _VALIDATE_MODES[value]
    if mode == "off" or capturing_graph() or torch.compiler.is_compiling():
        return False
    if mode == "step":
        return True
    if layout in _checked_layouts:
        return False
    _checked_layouts.add(layout)
    return True


class StepCache:
    """Values derived from one step's attention metadata object, by identity.

    Every attention layer of a step receives the same metadata object (one per KV-cache group),
    so :meth:`get` builds a value on the first layer and returns it to the others. The last
    ``size`` objects are held (strongly, so their ids cannot be reused); vLLM builds a new
    metadata object every step. A value built outside a CUDA graph capture is not reused inside
    one, and nothing is cached while torch.compile traces.
    """

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: list[tuple[Any, Any, bool]] = []
        self._lock = threading.Lock()

    def get(self, owner: Any, build: Callable[[], Any]) -> tuple[Any, bool]:
        """``(value, built)``: the value cached for ``owner`` (``built`` False), or ``build()``'s."""
        if torch.compiler.is_compiling():
            return build(), True
        capturing = capturing_graph()
        with self._lock:
            for entry_owner, value, captured in self._entries:
                if entry_owner is owner and captured == capturing:
                    return value, False
        value = build()
        with self._lock:
            self._entries.append((owner, value, capturing))
            del self._entries[: -self._size]
        return value, True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_rotary_cache = StepCache()


def cached_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.rotary_cos_sin` of ``positions``, computed once per positions tensor (vLLM
    passes every layer the same one in a step) and unmodified version, and reused by every layer
    with the same ``rotary_dim``, ``base``, ``dtype`` and rope ``scaling``."""
    key = (positions._version, rotary_dim, base, dtype, _scaling_key(scaling))
    table, _ = _rotary_cache.get(positions, dict)
    if key not in table:
        table[key] = _kernel_rotary_cos_sin(positions, rotary_dim, base, dtype, scaling)
    return table[key]


@torch.compiler.assume_constant_result  # a layer's rope parameters: constants of the compiled graph
def _scaling_key(scaling: dict | None) -> str:
    """The rope parameters as one canonical string (a custom op's argument, a cache key)."""
    return "" if not scaling else json.dumps(scaling, sort_keys=True, default=repr)


# ----------------------------------------------------------------------------------------------
# The kernels as opaque custom ops inside vLLM's compiled graph (enforce_eager=False)
# ----------------------------------------------------------------------------------------------
#
# vLLM compiles the model's forward with torch.compile (fullgraph): Dynamo cannot trace samepath's
# launchers, and Inductor would re-fuse (and re-round) anything it can see. Inside a compiled
# region the patched forwards therefore call samepath's kernels through these custom ops, which
# Dynamo records as single opaque nodes and which run the very same kernels when the graph runs;
# outside one they call the kernels directly.


@torch.library.custom_op("samepath_vllm::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_mode: str) -> torch.Tensor:
    return _kernel_rms_norm(x, weight, eps, weight_mode=weight_mode)


@_rms_norm_op.register_fake
def _(x, weight, eps, weight_mode):
    return torch.empty_like(x)


@torch.library.custom_op("samepath_vllm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, weight_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _kernel_rms_norm(x, weight, eps, residual=residual, weight_mode=weight_mode)
    return out, summed


@_add_rms_norm_op.register_fake
def _(x, weight, eps, residual, weight_mode):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("samepath_vllm::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _kernel_linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("samepath_vllm::swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _kernel_swiglu(gate_up)


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("samepath_vllm::geglu_tanh", mutates_args=())
def _geglu_tanh_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _kernel_geglu_tanh(gate_up)


@_geglu_tanh_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("samepath_vllm::rotary_cos_sin", mutates_args=())
def _cos_sin_op(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: str
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cached_cos_sin(positions, rotary_dim, base, dtype, json.loads(scaling) if scaling else None)
    return cos.clone(), sin.clone()  # a custom op's outputs are its own (the cached ones stay cached)


@_cos_sin_op.register_fake
def _(positions, rotary_dim, base, dtype, scaling):
    shape = (*positions.shape, rotary_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


@torch.library.custom_op("samepath_vllm::apply_rotary", mutates_args=())
def _apply_rotary_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int | None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _kernel_apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    return q_out.contiguous(), k_out.contiguous()


@_apply_rotary_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim, interleaved=False):
    return torch.empty_like(q), torch.empty_like(k)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_mode: str = "cast_then_weight",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.rms_norm`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_rms_norm(x, weight, eps, residual=residual, weight_mode=weight_mode)
    if residual is None:
        return _rms_norm_op(x, weight, eps, weight_mode)
    return _add_rms_norm_op(x, weight, eps, residual, weight_mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`samepath.linear`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_linear(x, weight, bias)
    return _linear_op(x, weight, bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`samepath.swiglu`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_swiglu(gate_up)
    return _swiglu_op(gate_up)


def geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`samepath.geglu_tanh`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_geglu_tanh(gate_up)
    return _geglu_tanh_op(gate_up)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int | None = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.apply_rotary`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    return _apply_rotary_op(q, k, cos, sin, unsqueeze_dim, interleaved)


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cached_cos_sin` (once per step), an opaque op inside a compiled region (the rope
    ``scaling`` travels as its canonical JSON string)."""
    if not torch.compiler.is_compiling():
        return cached_cos_sin(positions, rotary_dim, base, dtype, scaling)
    return _cos_sin_op(positions, rotary_dim, float(base), dtype, _scaling_key(scaling))


@torch.library.custom_op("samepath_vllm::moe", mutates_args=())
def _moe_op(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_fp32: bool,
) -> torch.Tensor:
    dtype = torch.float32 if weights_fp32 else hidden_states.dtype
    index, weights = topk_softmax_routing(router_logits, top_k, renormalize, dtype)
    return experts_forward(hidden_states, w13, w2, index, weights)


@_moe_op.register_fake
def _(hidden_states, router_logits, w13, w2, top_k, renormalize, weights_fp32):
    return torch.empty_like(hidden_states)


def loading_model_routing_fp32() -> bool:
    """For the model whose weights vLLM is loading now (its current ``VllmConfig``): whether its MoE
    routing weights stay in fp32 (:func:`samepath.models.formulas.routing_weights_fp32`).
    Recorded on each MoE layer at weight loading; the load audit compares it with the config."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return model_config is not None and routing_weights_fp32(model_config.hf_config)


def loading_model_moe() -> str | None:
    """The MoE routing kind (:class:`~samepath.models.descriptor.ModelFamily` ``moe``) of the model
    whose weights vLLM is loading now, ``None`` if it has none or no family. Recorded on each MoE
    layer at weight loading: it picks the router the layer runs and the load audit compares it."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    family = find(getattr(getattr(model_config, "hf_config", None), "model_type", None))
    return family.moe if family is not None else None


def _grouped_moe(hidden_states, router_logits, bias, w13, w2, top_k, n_group, topk_group, renormalize, scale):
    index, weights = sigmoid_grouped_topk_routing(router_logits, bias, top_k, n_group, topk_group, renormalize, scale)
    return experts_forward(hidden_states, w13, w2, index, weights)


@torch.library.custom_op("samepath_vllm::grouped_moe", mutates_args=())
def _grouped_moe_op(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
) -> torch.Tensor:
    return _grouped_moe(hidden_states, router_logits, bias, w13, w2, top_k, n_group, topk_group, renormalize, scale)


@_grouped_moe_op.register_fake
def _(hidden_states, router_logits, bias, w13, w2, top_k, n_group, topk_group, renormalize, scale):
    return torch.empty_like(hidden_states)


def grouped_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """GLM-4.5's router (:func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing`: fp32 weights,
    the routed scaling factor folded into them as Hugging Face does) and the expert loop, an opaque
    op inside a compiled region."""
    args = (hidden_states, router_logits, bias, w13, w2, top_k, n_group, topk_group, renormalize)
    if not torch.compiler.is_compiling():
        return _grouped_moe(*args, routed_scaling_factor)
    return _grouped_moe_op(*args, float(routed_scaling_factor))


def moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_fp32: bool = False,
) -> torch.Tensor:
    """Hugging Face's top-k softmax router and expert loop (:mod:`samepath.integrations.moe`) on
    ``[E, 2I, H]`` / ``[E, H, I]`` expert weights, an opaque op inside a compiled region (its
    per-expert token counts are data-dependent). ``weights_fp32``: the routing weights stay in
    fp32 (Mixtral's router) instead of being cast to the activations' dtype."""
    if not torch.compiler.is_compiling():
        dtype = torch.float32 if weights_fp32 else hidden_states.dtype
        index, weights = topk_softmax_routing(router_logits, top_k, renormalize, dtype)
        return experts_forward(hidden_states, w13, w2, index, weights)
    return _moe_op(hidden_states, router_logits, w13, w2, top_k, renormalize, weights_fp32)


def _biased_moe(hidden_states, router_logits, w13, w13_bias, w2, w2_bias, top_k, limit, alpha) -> torch.Tensor:
    index, weights = topk_softmax_biased_routing(router_logits, top_k, hidden_states.dtype)
    gate_up, down = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I] and [E, I, H]: Hugging Face's layout
    return biased_experts_forward(hidden_states, gate_up, w13_bias, down, w2_bias, index, weights, limit, alpha)


@torch.library.custom_op("samepath_vllm::biased_moe", mutates_args=())
def _biased_moe_op(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_bias: torch.Tensor,
    w2: torch.Tensor,
    w2_bias: torch.Tensor,
    top_k: int,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    return _biased_moe(hidden_states, router_logits, w13, w13_bias, w2, w2_bias, top_k, limit, alpha)


@_biased_moe_op.register_fake
def _(hidden_states, router_logits, w13, w13_bias, w2, w2_bias, top_k, limit, alpha):
    return torch.empty_like(hidden_states)


def biased_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_bias: torch.Tensor,
    w2: torch.Tensor,
    w2_bias: torch.Tensor,
    top_k: int,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """GPT-OSS's router and experts (:func:`samepath.integrations.moe.topk_softmax_biased_routing`,
    :func:`~samepath.integrations.moe.biased_experts_forward`) on vLLM's ``w13_weight`` ``[E, 2I, H]``
    (gate and up interleaved) / ``w2_weight`` ``[E, H, I]`` and their biases, an opaque op inside a
    compiled region."""
    args = (hidden_states, router_logits, w13, w13_bias, w2, w2_bias, top_k, float(limit), float(alpha))
    return _biased_moe(*args) if not torch.compiler.is_compiling() else _biased_moe_op(*args)


__all__ = [
    "StepCache",
    "apply_patch_groups",
    "apply_rotary",
    "biased_moe",
    "cached_cos_sin",
    "capturing_graph",
    "geglu_tanh",
    "grouped_moe",
    "has_dense_weight",
    "linear",
    "loading_model_moe",
    "loading_model_routing_fp32",
    "moe",
    "optional_module",
    "rms_norm",
    "rotary_cos_sin",
    "swiglu",
    "validate_metadata",
]
