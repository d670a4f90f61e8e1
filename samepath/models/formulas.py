"""One resolution of a model's formulas, for both sides of an RL step.

:func:`model_formulas` reads a Hugging Face config (the trainer's ``model.config``, or the
``hf_config`` vLLM loaded) and returns the per-model formula choices that change bits — rope type
and parameters, norm variant and epsilon, activation, MoE routing, attention scale — as a plain,
JSON-serialisable dict. Both integrations compute their rotary tables from
:func:`rope_formula` (through :func:`samepath.rotary_cos_sin`), and
:func:`samepath.fingerprint` folds :func:`model_formulas` into the fingerprint when given the
config, so a rollout and a trainer that resolved a model differently (another rope scaling, an
override on one side, another checkpoint revision) compare unequal and refuse to run together.

A config samepath cannot resolve into one of its formulas (another model type, partial rotary on
a family that rotates the whole head, an activation other than SiLU, ...) is a
:class:`UnsupportedModelError`, raised the same way on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from samepath.kernels.rotary import ROPE_TYPES

#: model_type -> the formulas samepath implements for it, on the trainer (Hugging Face) and the
#: rollout (vLLM, vllm-ascend) alike. A type that is not here is refused on both sides.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"norm": "rms_norm", "qk_norm": False, "mlp": "silu_mul", "moe": None},
    "qwen2": {"norm": "rms_norm", "qk_norm": False, "mlp": "silu_mul", "moe": None},
    "qwen3": {"norm": "rms_norm", "qk_norm": True, "mlp": "silu_mul", "moe": None},
    "qwen3_moe": {"norm": "rms_norm", "qk_norm": True, "mlp": "silu_mul", "moe": "softmax_topk"},
    # Llama's modules (vLLM: mistral.py, a LlamaModel) with the config's sliding window.
    "mistral": {"norm": "rms_norm", "qk_norm": False, "mlp": "silu_mul", "moe": None},
    # Llama's modules with fused q/k/v and gate/up projections (vLLM: phi3.py, a LlamaForCausalLM).
    "phi3": {"norm": "rms_norm", "qk_norm": False, "mlp": "silu_mul", "moe": None},
    # Mistral's attention with top-k softmax experts whose routing weights stay in fp32 (vLLM: mixtral.py).
    "mixtral": {"norm": "rms_norm", "qk_norm": False, "mlp": None, "moe": "softmax_topk_fp32"},
    # Gemma 3 text: (1 + weight) fp32 norms (four per layer, and q/k), GELU-tanh·mul, a scaled
    # embedding, query_pre_attn_scalar, alternating sliding / full layers with a rope per layer type.
    "gemma3_text": {"norm": "rms_norm", "qk_norm": True, "mlp": "gelu_tanh_mul", "moe": None},
}

#: model_type -> ``samepath.rms_norm``'s ``weight_mode`` of its norms (default ``cast_then_weight``).
NORM_WEIGHT_MODES: dict[str, str] = {"gemma3_text": "fp32_one_plus_weight"}

#: model_type -> why samepath refuses it, the same words on every side (``patch_all(model)``, the
#: vLLM plugin's load audit, ``samepath check``/``audit``). Decided from what each architecture's
#: modules compute in transformers 5 and vLLM, not from its name.
REFUSED: dict[str, str] = {
    "olmo2": (
        "vLLM 0.32 runs Olmo2ForCausalLM through its Transformers backend, whose fusers swap the model's norms, "
        "projections and attention for vLLM layers found from the modules' dataflow; samepath's vLLM plugin does "
        "not patch or audit that backend. Olmo2RMSNorm's fp32 weight multiply before the cast is samepath's "
        "rms_norm weight_mode='fp32_weight', but its q/k norms run over all heads at once (under tensor "
        "parallelism a norm across ranks), which samepath's vLLM coverage does not include"
    ),
    "granite": (
        "Granite's embedding_multiplier, residual_multiplier and logits_scaling are elementwise ops of the model "
        "classes that samepath does not run: vLLM multiplies the logits by 1/logits_scaling where Hugging Face "
        "divides (the same bits only for a power of two), and vLLM's torch.compile may fuse "
        "residual + h * residual_multiplier without Hugging Face's rounding between the multiply and the add"
    ),
    "gemma2": (
        "Gemma 2 uses attention logit soft-capping (tanh of the scores before the softmax, refused by samepath's "
        "attention kernel) and final logit soft-capping; its (1 + weight) RMSNorm, GELU-tanh MLP, scaled embedding "
        "and alternating sliding-window layers are Gemma 3's, which samepath implements (model_type gemma3_text)"
    ),
    "gemma3": (
        "Gemma3ForConditionalGeneration is multimodal (a SigLIP vision tower, bidirectional attention over image "
        "tokens), which samepath does not implement; the text-only Gemma3ForCausalLM (model_type gemma3_text) "
        "is supported"
    ),
    "gpt_oss": (
        "GPT-OSS uses attention sinks (s_aux, refused by samepath's attention) and clamped SwiGLU experts with "
        "biases; neither is implemented"
    ),
    "deepseek_v2": (
        "DeepSeek-V2 uses multi-head latent attention (low-rank compressed KV with rope on a slice of each head) "
        "and grouped top-k routing with shared experts; neither is implemented"
    ),
    "deepseek_v3": (
        "DeepSeek-V3 uses multi-head latent attention (low-rank compressed KV with rope on a slice of each head) "
        "and sigmoid grouped top-k routing with shared experts; neither is implemented"
    ),
    "gpt2": (
        "GPT-2 is not Llama-shaped: LayerNorm, a GELU MLP, learned absolute positions and Conv1D projections; "
        "none is implemented"
    ),
}


def unsupported_reason(model_type: object) -> str:
    """Why samepath refuses ``model_type`` (one message for the API, the vLLM plugin and the CLI)."""
    supported = ", ".join(sorted(FAMILIES))
    if model_type in REFUSED:
        return f"model_type {model_type!r} is not supported: {REFUSED[model_type]} (supported: {supported})"
    return (
        f"model_type {model_type!r} is not covered by samepath on both the trainer and the rollout side "
        f"(supported: {supported})"
    )


_ACTIVATIONS = ("silu", "swish")
#: model type -> the MLP activation its samepath formula implements (read from ``hidden_activation``).
_FAMILY_ACTIVATIONS = {"gemma3_text": ("gelu_pytorch_tanh",)}


class UnsupportedModelError(ValueError):
    """The model's config selects a formula samepath does not implement on both sides."""


@dataclass(frozen=True)
class RopeFormula:
    """What :func:`samepath.rotary_cos_sin` needs: the rotated dimensions, ``rope_theta`` and the
    Hugging Face rope parameters (``rope_type`` and its keys, ``max_position_embeddings`` added)."""

    rotary_dim: int
    head_size: int
    base: float
    scaling: dict[str, Any]

    @property
    def rope_type(self) -> str:
        return self.scaling["rope_type"]

    def to_json(self) -> dict[str, Any]:
        return {
            "rotary_dim": self.rotary_dim,
            "head_size": self.head_size,
            "base": self.base,
            "style": "neox",
            **self.scaling,
        }


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
    ``layer_type`` of them (or a ``layer_type`` for a config without them), or partial rotary
    (the supported families rotate the whole head; Hugging Face's Llama ignores
    ``partial_rotary_factor`` for the default type and fails for the others).
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
    rotary_dim = head_size if rope_type == "default" else int(head_size * partial)
    if rotary_dim != head_size or partial != 1.0:
        raise UnsupportedModelError(
            f"partial rotary (partial_rotary_factor={partial}) is not supported for model_type "
            f"{getattr(config, 'model_type', None)!r}: its Hugging Face attention rotates the whole head"
        )
    scaling = {k: _plain(v) for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    scaling["max_position_embeddings"] = int(config.max_position_embeddings)
    return RopeFormula(rotary_dim=rotary_dim, head_size=head_size, base=float(base), scaling=scaling)


def routing_weights_fp32(config: Any) -> bool:
    """Whether the model's MoE routing weights stay in fp32 (Mixtral) instead of being cast to the
    activations' dtype (Qwen3-MoE) before they scale the experts' outputs."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family is not None and family["moe"] == "softmax_topk_fp32"


def model_formulas(config: Any) -> dict[str, Any]:
    """The per-model formula choices of a Hugging Face config (see the module docstring).

    Raises :class:`UnsupportedModelError` for a model type outside :data:`FAMILIES` or a choice
    samepath does not implement on both sides.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(unsupported_reason(model_type))
    family = FAMILIES[model_type]
    for key in ("llama_4_scaling", "ada_rms_norm_t_cond"):  # vLLM's Mistral-only extras
        if getattr(config, key, None):
            raise UnsupportedModelError(f"{key} ({model_type}) is not supported")
    if model_type in _FAMILY_ACTIVATIONS:
        act = getattr(config, "hidden_activation", None)
        if act not in _FAMILY_ACTIVATIONS[model_type]:
            raise UnsupportedModelError(
                f"hidden_activation={act!r} is not supported for {model_type} (samepath implements GELU-tanh·mul, "
                "gelu_pytorch_tanh)"
            )
    else:
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (samepath implements SiLU·mul)")
    gemma = model_type == "gemma3_text"
    if gemma:
        _check_gemma3(config)
    head_size = _head_size(config)
    moe = None
    if family["moe"] == "softmax_topk":
        moe = {
            "routing": "fp32 softmax, top-k, optional renormalisation, cast to the dtype (HF TopKRouter)",
            "num_experts": int(config.num_experts),
            "top_k": int(config.num_experts_per_tok),
            "renormalize": bool(config.norm_topk_prob),
            "experts": "ascending expert order, index_add per token",
        }
        if getattr(config, "shared_expert_intermediate_size", 0):
            raise UnsupportedModelError("shared experts are not supported")
    elif family["moe"] == "softmax_topk_fp32":
        moe = {
            "routing": "fp32 softmax, top-k, renormalisation, weights kept in fp32 (HF MixtralTopKRouter)",
            "num_experts": int(config.num_local_experts),
            "top_k": int(config.num_experts_per_tok),
            "renormalize": True,
            "experts": "ascending expert order, index_add per token",
        }
        if getattr(config, "router_jitter_noise", 0.0):
            raise UnsupportedModelError(
                f"router_jitter_noise={config.router_jitter_noise} (random noise on the trainer's router in "
                "train mode only) is not supported"
            )
    # qwen2 windows only with use_sliding_window; mistral, phi3 and mixtral whenever sliding_window is set;
    # gemma3_text on its sliding_attention layers.
    sliding = bool(getattr(config, "use_sliding_window", model_type in ("mistral", "phi3", "mixtral", "gemma3_text")))
    ropes = rope_formulas(config)
    formulas = {
        "model_type": model_type,
        "rope": ropes[None].to_json() if None in ropes else {k: v.to_json() for k, v in ropes.items()},
        "norm": {
            "kind": family["norm"],
            "weight_mode": NORM_WEIGHT_MODES.get(model_type, "cast_then_weight"),
            "eps": float(config.rms_norm_eps),
            "qk_norm": family["qk_norm"],
            "residual": "add rounded to the dtype, then the norm",
        },
        "activation": f"{act}·mul",
        "moe": moe,
        "attention": {
            "scale": float(config.query_pre_attn_scalar) ** -0.5 if gemma else head_size**-0.5,
            "sliding_window": getattr(config, "sliding_window", None) if sliding else None,
            "max_window_layers": getattr(config, "max_window_layers", None) if sliding else None,
            "softcap": None,
            "sinks": False,
        },
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }
    if gemma:
        formulas["norm"]["residual"] = (
            "the sublayer's output normed (post_attention / post_feedforward), added to the residual rounded to "
            "the dtype, then the next pre-norm"
        )
        formulas["attention"]["layer_types"] = list(config.layer_types)
        formulas["embedding"] = {"scale": embedding_scale(config), "multiply": "in the model dtype, one rounding"}
    return formulas


def embedding_scale(config: Any) -> float | None:
    """The factor a model multiplies its token embeddings by (Gemma 3: ``sqrt(hidden_size)``, held as
    an fp32 value that both sides round to the model dtype before the multiply), ``None`` for none."""
    if getattr(config, "model_type", None) != "gemma3_text":
        return None
    return sqrt_hidden_scale(config.hidden_size)


def sqrt_hidden_scale(hidden_size: int) -> float:
    """``sqrt(hidden_size)`` rounded to fp32: Gemma's embedding factor before its cast to the dtype."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32))


def _check_gemma3(config: Any) -> None:
    """Gemma 3 text options outside samepath's formulas, refused the same way on both sides."""
    problems = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append(
            f"attn_logit_softcapping={config.attn_logit_softcapping} (attention logit soft-capping is refused by "
            "samepath's attention kernel)"
        )
    if getattr(config, "final_logit_softcapping", None) is not None:
        problems.append(
            f"final_logit_softcapping={config.final_logit_softcapping} (tanh soft-capping of the logits: samepath's "
            "log-probs take the raw lm_head logits on both sides)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (samepath's attention is causal)")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True (q/k/v/o biases)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout={config.attention_dropout}")
    unknown = sorted(set(config.layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        problems.append(f"layer types {unknown}")
    if problems:
        raise UnsupportedModelError(f"gemma3_text with {'; '.join(problems)} is not supported")


__all__ = [
    "FAMILIES",
    "NORM_WEIGHT_MODES",
    "REFUSED",
    "RopeFormula",
    "UnsupportedModelError",
    "embedding_scale",
    "layer_types",
    "model_formulas",
    "rope_formula",
    "rope_formulas",
    "routing_weights_fp32",
    "sqrt_hidden_scale",
    "unsupported_reason",
]
