"""One resolution of a model's formulas, for both sides of an RL step.

:func:`model_formulas` reads a Hugging Face config (the trainer's ``model.config``, or the
``hf_config`` vLLM loaded) and returns the per-model formula choices that change bits — rope type
and parameters, norm variant and epsilon, activation, MoE routing, attention scale — as a plain,
JSON-serialisable dict. Both integrations compute their rotary tables from
:func:`rope_formula` (through :func:`samepath.rotary_cos_sin`), and
:func:`samepath.fingerprint` folds :func:`model_formulas` into the fingerprint when given the
config, so a rollout and a trainer that resolved a model differently (another rope scaling, an
override on one side, another checkpoint revision) compare unequal and refuse to run together.

Which formula a model type gets (norm, activation, rope handling, MoE routing, attention scale
and window) comes from its :class:`~samepath.models.descriptor.ModelFamily` in
:mod:`samepath.models.registry`. A config samepath cannot resolve into one of its formulas
(another model type, partial rotary on a family that rotates the whole head, an activation other
than the family's, ...) is a :class:`UnsupportedModelError`, raised the same way on both sides.
:func:`model_fingerprint` hashes :func:`model_formulas`; importing this module registers it with
:mod:`samepath.kernels.config`, whose ``fingerprint(model_config=...)`` appends it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from samepath.kernels import config as numerics_config
from samepath.kernels.moe_routing import SIGMOID_GROUPED_TOPK_FORMULA
from samepath.kernels.rotary import ROPE_TYPES
from samepath.kernels.softcap import SOFTCAP_FORMULA
from samepath.models.descriptor import (
    INTERLEAVED_MULTIMODAL_ROPE,
    MULTIMODAL_ROPE,
    PER_LAYER_TYPE_ROPE,
    SIGMOID_GROUPED_TOPK,
    SOFTMAX_TOPK,
    SOFTMAX_TOPK_FP32,
    TOPK_SOFTMAX_BIASED,
    ModelFamily,
    UnsupportedModelError,
)
from samepath.models.registry import find, refusal_reason, refusals

#: model_type -> why samepath refuses it (:func:`samepath.models.registry.refusals`).
REFUSED = refusals()


def unsupported_reason(model_type: object) -> str:
    """Why samepath refuses ``model_type`` (:func:`samepath.models.registry.refusal_reason`)."""
    return refusal_reason(model_type)


@dataclass(frozen=True)
class RopeFormula:
    """What :func:`samepath.rotary_cos_sin` needs: the rotated dimensions, ``rope_theta`` and the
    Hugging Face rope parameters (``rope_type`` and its keys, ``max_position_embeddings`` added)."""

    rotary_dim: int
    head_size: int
    base: float
    scaling: dict[str, Any]
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @property
    def rope_type(self) -> str:
        return self.scaling["rope_type"]

    def to_json(self) -> dict[str, Any]:
        formula = {
            "rotary_dim": self.rotary_dim,
            "head_size": self.head_size,
            "base": self.base,
            "style": "neox",
            **self.scaling,
        }
        if self.mrope_section is not None:
            formula["mrope_section"] = list(self.mrope_section)
            formula["mrope_interleaved"] = self.mrope_interleaved
        return formula


def _head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _per_layer_type(params: dict) -> bool:
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def layer_types(config: Any) -> list[str] | None:
    """``config.layer_types`` for a config with per-layer-type rope parameters (Gemma 3: one
    ``"sliding_attention"`` / ``"full_attention"`` entry per layer), else ``None``."""
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    if not _per_layer_type(getattr(config, "rope_parameters", None) or {}):
        return None
    return list(config.layer_types)


def rope_formulas(config: Any) -> dict[str | None, RopeFormula]:
    """Every rotary formula of a config: ``{None: rope_formula(config)}``, or one per layer type
    for per-layer-type rope parameters (Gemma 3's local and global rope)."""
    types = layer_types(config)
    if types is None:
        return {None: rope_formula(config)}
    return {layer_type: rope_formula(config, layer_type) for layer_type in sorted(set(types))}


def rope_formula(config: Any, layer_type: str | None = None) -> RopeFormula:
    """The rotary formula of a Hugging Face decoder config, as transformers 5 resolves it; for a
    config with per-layer-type rope parameters (``rope_parameters[layer_type]``, Gemma 3), the one
    of ``layer_type``.

    Raises :class:`UnsupportedModelError` for a rope type outside
    :data:`samepath.kernels.rotary.ROPE_TYPES`, per-layer-type rope parameters without a
    ``layer_type`` of them (or a ``layer_type`` for a config without them), or partial rotary in
    a family whose attention rotates the whole head (Hugging Face's Llama ignores
    ``partial_rotary_factor`` for the default type and fails for the others). A family with
    ``partial_rotary`` (GLM-4.5) rotates ``int(head_size * partial_rotary_factor)`` dimensions, as
    its Hugging Face rotary module and vLLM's ``get_rope`` compute.
    """
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = getattr(config, "rope_parameters", None) or {}
    if _per_layer_type(params):
        if layer_type not in params:
            raise UnsupportedModelError(
                f"per-layer-type rope parameters ({sorted(params)}) need one of their layer types, got {layer_type!r}"
            )
        params = params[layer_type]
    elif layer_type is not None:
        raise UnsupportedModelError(
            f"layer_type={layer_type!r} given for a config without per-layer-type rope parameters"
        )
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not one samepath computes on both sides ({', '.join(ROPE_TYPES)})"
        )
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise UnsupportedModelError("the config has no rope_theta")
    head_size = _head_size(config)
    partial = params.get("partial_rotary_factor", 1.0)
    family = find(getattr(config, "model_type", None))
    if family is not None and family.partial_rotary:
        rotary_dim = int(head_size * partial)
        if not 0 < partial <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor={partial} gives rotary_dim {rotary_dim} of head size {head_size} "
                "(samepath rotates a positive even number of dimensions)"
            )
    elif rope_type == "default":
        rotary_dim = head_size
    else:
        rotary_dim = int(head_size * partial)
    if (family is None or not family.partial_rotary) and (rotary_dim != head_size or partial != 1.0):
        raise UnsupportedModelError(
            f"partial rotary (partial_rotary_factor={partial}) is not supported for model_type "
            f"{getattr(config, 'model_type', None)!r}: its Hugging Face attention rotates the whole head"
        )
    mrope = ("mrope_section", "mrope_interleaved")
    section = params.get("mrope_section")
    multimodal = family is not None and family.rope in (MULTIMODAL_ROPE, INTERLEAVED_MULTIMODAL_ROPE)
    if (section is not None) != multimodal:
        raise UnsupportedModelError(
            f"mrope_section={section} for model_type {getattr(config, 'model_type', None)!r}: samepath computes "
            "multimodal rope for the families whose descriptor says so (Qwen3-VL's text decoder), with the "
            "config's sections"
        )
    interleaved = multimodal and family.rope == INTERLEAVED_MULTIMODAL_ROPE
    if section is not None and bool(params.get("mrope_interleaved", interleaved)) != interleaved:
        # Hugging Face's module interleaves (or not) whatever the config says; vLLM follows the config.
        raise UnsupportedModelError(
            f"mrope_interleaved={params.get('mrope_interleaved')} contradicts {config.model_type}'s rotary module "
            f"({'interleaved' if interleaved else 'contiguous'} sections)"
        )
    if section is not None and (rope_type != "default" or len(section) != 3):
        raise UnsupportedModelError(
            f"multimodal rope with rope_type {rope_type!r}, sections {section} is not supported"
        )
    skip = ("type", "rope_theta", "partial_rotary_factor", *mrope)
    scaling = {k: _plain(v) for k, v in params.items() if k not in skip}
    scaling["rope_type"] = rope_type
    scaling["max_position_embeddings"] = int(config.max_position_embeddings)
    return RopeFormula(
        rotary_dim=rotary_dim,
        head_size=head_size,
        base=float(base),
        scaling=scaling,
        mrope_section=None if section is None else tuple(int(x) for x in section),
        mrope_interleaved=interleaved,
    )


def routing_weights_fp32(config: Any) -> bool:
    """Whether the model's MoE routing weights stay in fp32 (Mixtral) instead of being cast to the
    activations' dtype (Qwen3-MoE) before they scale the experts' outputs."""
    family = find(getattr(config, "model_type", None))
    return family is not None and family.routing_weights_fp32


def _softmax_topk(config: Any) -> dict[str, Any]:
    moe = {
        "routing": "fp32 softmax, top-k, optional renormalisation, cast to the dtype (HF TopKRouter)",
        "num_experts": int(config.num_experts),
        "top_k": int(config.num_experts_per_tok),
        "renormalize": bool(getattr(config, "norm_topk_prob", True)),  # Qwen3.5-MoE's router always renormalises
        "experts": "ascending expert order, fp32 terms and sum, one cast",
    }
    if getattr(config, "shared_expert_intermediate_size", 0):
        family = find(getattr(config, "model_type", None))
        if family is None or not family.shared_expert_gate:
            raise UnsupportedModelError("shared experts are not supported")
        moe["shared_expert"] = (
            "a dense MLP of shared_expert_intermediate_size times sigmoid(shared_expert_gate(x)) (samepath.kernels."
            "gated_ops.sigmoid_gate), added to the experts' output in the dtype"
        )
    return moe


def _softmax_topk_fp32(config: Any) -> dict[str, Any]:
    moe = {
        "routing": "fp32 softmax, top-k, renormalisation, weights kept in fp32 (HF MixtralTopKRouter)",
        "num_experts": int(config.num_local_experts),
        "top_k": int(config.num_experts_per_tok),
        "renormalize": True,
        "experts": "ascending expert order, fp32 terms and sum, one cast",
    }
    if getattr(config, "router_jitter_noise", 0.0):
        raise UnsupportedModelError(
            f"router_jitter_noise={config.router_jitter_noise} (random noise on the trainer's router in "
            "train mode only) is not supported"
        )
    return moe


def _sigmoid_grouped_topk(config: Any) -> dict[str, Any]:
    num_experts, n_group = int(config.n_routed_experts), int(config.n_group)
    if n_group < 1 or num_experts % n_group or not 1 <= int(config.topk_group) <= n_group:
        raise UnsupportedModelError(
            f"n_group={config.n_group}, topk_group={config.topk_group} do not group {num_experts} experts"
        )
    if n_group > 1 and num_experts // n_group < 2:
        raise UnsupportedModelError(f"n_group={n_group} leaves groups of fewer than 2 experts")
    return {
        "routing": f"{SIGMOID_GROUPED_TOPK_FORMULA} (HF Glm4MoeTopkRouter)",
        "num_experts": num_experts,
        "top_k": int(config.num_experts_per_tok),
        "n_group": n_group,
        "topk_group": int(config.topk_group),
        "renormalize": bool(config.norm_topk_prob),
        "routed_scaling_factor": float(config.routed_scaling_factor),
        "shared_experts": int(config.n_shared_experts or 0),
        "first_k_dense_replace": int(config.first_k_dense_replace),
        "experts": "ascending expert order, index_add per token; shared experts' output added in the dtype",
    }


def _topk_softmax_biased(config: Any) -> dict[str, Any]:
    return {
        "routing": "router logits = linear(x, weight, bias) in the dtype; top-k of the logits; fp32 softmax over "
        "the k; weights cast to the dtype (HF GptOssTopKRouter)",
        "num_experts": int(config.num_local_experts),
        "top_k": int(config.num_experts_per_tok),
        "renormalize": False,
        "experts": "ascending expert order; x @ gate_up[e], + bias in the dtype; the family's activation; "
        "@ down[e], + bias in the dtype; the moe combine (fp32 terms and sum in ascending expert order, one cast)",
    }


#: A family's ``moe`` -> the routing formula it resolves a config to (refusing what it does not implement).
MOE_ROUTINGS = {
    SOFTMAX_TOPK: _softmax_topk,
    SOFTMAX_TOPK_FP32: _softmax_topk_fp32,
    SIGMOID_GROUPED_TOPK: _sigmoid_grouped_topk,
    TOPK_SOFTMAX_BIASED: _topk_softmax_biased,
}


def _activation(family: ModelFamily, config: Any, model_type: str) -> str:
    activation = family.activation
    act = getattr(config, activation.config_key, activation.default)
    if act not in activation.accepted:
        raise UnsupportedModelError(
            activation.refusal.format(key=activation.config_key, act=act, model_type=model_type)
        )
    return act


def model_formulas(config: Any) -> dict[str, Any]:
    """The per-model formula choices of a Hugging Face config (see the module docstring).

    Raises :class:`UnsupportedModelError` for a model type without a family in
    :mod:`samepath.models.registry` or a choice samepath does not implement on both sides.
    """
    model_type = getattr(config, "model_type", None)
    family = find(model_type)
    if family is None:
        raise UnsupportedModelError(unsupported_reason(model_type))
    for key in ("llama_4_scaling", "ada_rms_norm_t_cond"):  # vLLM's Mistral-only extras
        if getattr(config, key, None):
            raise UnsupportedModelError(f"{key} ({model_type}) is not supported")
    act = _activation(family, config, model_type)
    problems = family.config_problems(config) if family.config_problems is not None else []
    if problems:
        raise UnsupportedModelError(f"{model_type} with {'; '.join(problems)} is not supported")
    head_size = _head_size(config)
    moe = MOE_ROUTINGS[family.moe](config) if family.moe is not None else None
    # Some families (qwen2) window only with use_sliding_window, others whenever sliding_window is set
    # (gemma3_text: on its sliding_attention layers).
    sliding = bool(getattr(config, "use_sliding_window", family.sliding_window_by_default))
    ropes = rope_formulas(config)
    scale = float(config.query_pre_attn_scalar) ** -0.5 if family.query_pre_attn_scalar else head_size**-0.5
    formulas = {
        "model_type": model_type,
        "rope": ropes[None].to_json() if None in ropes else {k: v.to_json() for k, v in ropes.items()},
        "norm": {
            "kind": "rms_norm",
            "weight_mode": family.norm_weight_mode,
            "eps": float(config.rms_norm_eps),
            "qk_norm": family.qk_norm or bool(getattr(config, "use_qk_norm", False)),
            "residual": family.residual,
        },
        "activation": f"{act}·mul",
        "moe": moe,
        "attention": {
            "scale": scale,
            "sliding_window": getattr(config, "sliding_window", None) if sliding else None,
            "max_window_layers": getattr(config, "max_window_layers", None) if sliding else None,
            "softcap": attention_softcap(family, config),
            "sinks": family.attention_sinks,
        },
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }
    if family.rope == PER_LAYER_TYPE_ROPE or family.layer_types:
        formulas["attention"]["layer_types"] = list(config.layer_types)
    if family.softcap:
        cap = final_logit_softcap(config)
        formulas["final_logit_softcap"] = None if cap is None else {"cap": cap, "formula": SOFTCAP_FORMULA["logits"]}
    if family.embedding_scale:
        formulas["embedding"] = {"scale": embedding_scale(config), "multiply": "in the model dtype, one rounding"}
    for key, value in (family.extra_formulas(config) if family.extra_formulas is not None else {}).items():
        merge = isinstance(value, dict) and isinstance(formulas.get(key), dict)
        formulas[key] = {**formulas[key], **value} if merge else value
    return formulas


def attention_softcap(family: ModelFamily, config: Any) -> dict[str, Any] | None:
    """The attention logit soft-capping of a family that applies it (``config.attn_logit_softcapping``:
    the cap and samepath's formula), ``None`` for none."""
    cap = getattr(config, "attn_logit_softcapping", None) if family.softcap else None
    return None if cap is None else {"cap": float(cap), "formula": SOFTCAP_FORMULA["attention"]}


def final_logit_softcap(config: Any) -> float | None:
    """The cap both sides apply to the logits (``config.final_logit_softcapping`` of a family that
    soft-caps, :func:`samepath.kernels.softcap.softcap_logits`), ``None`` for none."""
    family = find(getattr(config, "model_type", None))
    cap = getattr(config, "final_logit_softcapping", None) if family is not None and family.softcap else None
    return None if cap is None else float(cap)


def model_fingerprint(model_config: Any) -> str:
    """A short hash of a model's formula choices (:func:`model_formulas`: rope type and parameters,
    norm, activation, MoE routing, attention scale) — ``m`` + 12 hex digits."""
    payload = json.dumps(model_formulas(model_config), sort_keys=True, separators=(",", ":"))
    return "m" + hashlib.sha256(payload.encode()).hexdigest()[:12]


def embedding_scale(config: Any) -> float | None:
    """The factor a model multiplies its token embeddings by (Gemma 3: ``sqrt(hidden_size)``, held as
    an fp32 value that both sides round to the model dtype before the multiply), ``None`` for none."""
    family = find(getattr(config, "model_type", None))
    if family is None or not family.embedding_scale:
        return None
    return sqrt_hidden_scale(config.hidden_size)


def sqrt_hidden_scale(hidden_size: int) -> float:
    """``sqrt(hidden_size)`` rounded to fp32: Gemma's embedding factor before its cast to the dtype."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32))


numerics_config.register_model_fingerprint(model_fingerprint)


__all__ = [
    "MOE_ROUTINGS",
    "REFUSED",
    "RopeFormula",
    "UnsupportedModelError",
    "attention_softcap",
    "embedding_scale",
    "final_logit_softcap",
    "layer_types",
    "model_fingerprint",
    "model_formulas",
    "rope_formula",
    "rope_formulas",
    "routing_weights_fp32",
    "sqrt_hidden_scale",
    "unsupported_reason",
]
