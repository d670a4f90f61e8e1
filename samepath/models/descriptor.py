"""What a model family is to samepath: one frozen :class:`ModelFamily` per family.

A descriptor says, by name only (transformers and vLLM stay optional), which Hugging Face and vLLM
classes a family's models are built from, and which of samepath's formulas they compute: the norm
(plain, or Gemma's fp32 ``1 + weight``), the MLP activation (SiLU·mul, GELU-tanh·mul), the rope
(one, or one per layer type), the MoE routing, and the attention's features (sliding window,
``query_pre_attn_scalar``, options refused). :mod:`samepath.models.formulas` resolves a config
from it, :mod:`samepath.integrations.hf` patches by it, and :mod:`samepath.models.registry` finds
it by ``config.model_type``. A new family is one module in this package defining ``FAMILY``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``samepath.rms_norm``'s ``weight_mode`` of a plain RMSNorm (cast to the dtype, then times the weight).
PLAIN_NORM = "cast_then_weight"
#: Gemma's RMSNorm: the fp32 row times ``1 + weight.float()``, one rounding.
GEMMA_NORM = "fp32_one_plus_weight"
#: GPT-OSS's RMSNorm: the fp32 row times ``weight.float()``, one rounding.
FP32_WEIGHT_NORM = "fp32_weight"

#: One rope for every layer (``config.rope_parameters`` is one set of parameters).
SINGLE_ROPE = "single"
#: One rope per layer type (``config.rope_parameters[layer_type]``, ``config.layer_types``: Gemma 3).
PER_LAYER_TYPE_ROPE = "per_layer_type"

#: MoE routing: fp32 softmax, top-k, optional renormalisation, weights cast to the dtype (Qwen3-MoE).
SOFTMAX_TOPK = "softmax_topk"
#: MoE routing: fp32 softmax, top-k, renormalised, weights kept in fp32 (Mixtral).
SOFTMAX_TOPK_FP32 = "softmax_topk_fp32"
#: MoE routing: router logits with a bias, top-k of the logits, fp32 softmax over the k, weights cast
#: to the dtype; experts with biases (GPT-OSS).
TOPK_SOFTMAX_BIASED = "topk_softmax_biased"

#: What the residual stream does around a sublayer in most families.
PRE_NORM_RESIDUAL = "add rounded to the dtype, then the norm"


class UnsupportedModelError(ValueError):
    """The model's config selects a formula samepath does not implement on both sides."""


@dataclass(frozen=True)
class Activation:
    """An MLP activation samepath implements: ``op`` (the audit's name, ``"silu_mul"``), the config
    attribute that selects it (``config_key``, read with ``default``), the values of it that mean
    this formula (``accepted``) and the refusal for another value (``refusal``, formatted with
    ``key``, ``act`` and ``model_type``)."""

    op: str
    config_key: str
    default: str | None
    accepted: tuple[str, ...]
    refusal: str


SILU_MUL = Activation(
    op="silu_mul",
    config_key="hidden_act",
    default="silu",
    accepted=("silu", "swish"),
    refusal="{key}={act!r} is not supported (samepath implements SiLU·mul)",
)
GELU_TANH_MUL = Activation(
    op="gelu_tanh_mul",
    config_key="hidden_activation",
    default=None,
    accepted=("gelu_pytorch_tanh",),
    refusal="{key}={act!r} is not supported for {model_type} (samepath implements GELU-tanh·mul, gelu_pytorch_tanh)",
)
#: GPT-OSS's experts: clamped SwiGLU (``swiglu_limit`` / ``swiglu_alpha``), whatever ``hidden_act`` says
#: (transformers' experts ignore it): :mod:`samepath.kernels.clamped_swiglu`.
CLAMPED_SWIGLU = Activation(
    op="clamped_swiglu",
    config_key="hidden_act",
    default="silu",
    accepted=("silu",),
    refusal="{key}={act!r} is not supported for {model_type} (samepath implements its clamped SwiGLU experts)",
)


@dataclass(frozen=True)
class ModelFamily:
    """One model family (see the module docstring). Fields:

    * ``model_types``: the ``config.model_type`` values it covers (the first is its name);
    * ``hf_module`` / ``hf_prefix``: the transformers modeling module and the class-name prefix of
      its classes (``{prefix}RMSNorm``, ``{prefix}MLP``, ``{prefix}RotaryEmbedding``,
      ``{prefix}Attention``, ...), resolved lazily by :meth:`hf_modeling` / :meth:`hf_class`;
    * ``norm_weight_mode``: :data:`PLAIN_NORM`, :data:`GEMMA_NORM` or :data:`FP32_WEIGHT_NORM`;
      ``qk_norm``: q/k norms on the heads; ``residual``: what the residual stream does around a
      sublayer (recorded in the formulas);
    * ``activation``: :data:`SILU_MUL`, :data:`GELU_TANH_MUL` or :data:`CLAMPED_SWIGLU`; ``dense_mlp``:
      the layers have a dense ``{prefix}MLP`` (Mixtral's and GPT-OSS's have experts only);
      ``fused_gate_up``: its MLP holds one ``gate_up_proj`` (gate first: vLLM's layout, Phi-3);
    * ``rope``: :data:`SINGLE_ROPE` or :data:`PER_LAYER_TYPE_ROPE`;
    * ``moe``: ``None``, :data:`SOFTMAX_TOPK`, :data:`SOFTMAX_TOPK_FP32` or :data:`TOPK_SOFTMAX_BIASED`;
    * ``sliding_window_by_default``: the config's ``sliding_window`` applies unless
      ``use_sliding_window`` is false (Qwen2 windows only with ``use_sliding_window``);
      ``query_pre_attn_scalar``: the attention scale is ``config.query_pre_attn_scalar ** -0.5``
      instead of ``head_size ** -0.5``; ``embedding_scale``: the embeddings are multiplied by
      ``sqrt(hidden_size)`` (Gemma); ``attention_sinks``: a learned sink logit per head joins the
      softmax (GPT-OSS's ``sinks``);
    * ``config_problems``: the config options of this family samepath refuses (soft-capping,
      bidirectional attention, ...) as ``config -> [problem, ...]``; ``extra_formulas``: the
      family's own entries of :func:`samepath.models.model_formulas` (``config -> dict``, merged
      over the generic ones, a dict value into the generic dict of that key);
    * ``vllm_module`` / ``vllm_structure`` / ``vllm_attention`` / ``vllm_mlp``: vLLM's models
      module, the classes whose own code is structure only, the attention class and the MLP
      classes (a name ``"module:Class"`` is looked up in that other module) — the load audit's
      per-family rules.
    """

    model_types: tuple[str, ...]
    hf_module: str
    hf_prefix: str
    vllm_module: str
    vllm_structure: tuple[str, ...]
    vllm_attention: str
    vllm_mlp: tuple[str, ...]
    norm_weight_mode: str = PLAIN_NORM
    qk_norm: bool = False
    residual: str = PRE_NORM_RESIDUAL
    activation: Activation = SILU_MUL
    dense_mlp: bool = True
    fused_gate_up: bool = False
    rope: str = SINGLE_ROPE
    moe: str | None = None
    sliding_window_by_default: bool = False
    query_pre_attn_scalar: bool = False
    embedding_scale: bool = False
    attention_sinks: bool = False
    config_problems: Callable[[Any], list[str]] | None = None
    extra_formulas: Callable[[Any], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError("a ModelFamily needs at least one model_type")
        if self.norm_weight_mode not in (PLAIN_NORM, GEMMA_NORM, FP32_WEIGHT_NORM):
            raise ValueError(
                f"norm_weight_mode must be {PLAIN_NORM!r}, {GEMMA_NORM!r} or {FP32_WEIGHT_NORM!r}, "
                f"got {self.norm_weight_mode!r}"
            )
        if self.rope not in (SINGLE_ROPE, PER_LAYER_TYPE_ROPE):
            raise ValueError(f"rope must be {SINGLE_ROPE!r} or {PER_LAYER_TYPE_ROPE!r}, got {self.rope!r}")
        if self.moe not in (None, SOFTMAX_TOPK, SOFTMAX_TOPK_FP32, TOPK_SOFTMAX_BIASED):
            raise ValueError(
                f"moe must be None, {SOFTMAX_TOPK!r}, {SOFTMAX_TOPK_FP32!r} or {TOPK_SOFTMAX_BIASED!r}, "
                f"got {self.moe!r}"
            )

    @property
    def name(self) -> str:
        return self.model_types[0]

    def hf_modeling(self) -> Any:
        """The transformers modeling module (imported now)."""
        return importlib.import_module(self.hf_module)

    def hf_class(self, suffix: str) -> type | None:
        """``{hf_prefix}{suffix}`` of the modeling module (``hf_class("RMSNorm")``), ``None`` if absent."""
        return getattr(self.hf_modeling(), f"{self.hf_prefix}{suffix}", None)


__all__ = [
    "CLAMPED_SWIGLU",
    "FP32_WEIGHT_NORM",
    "GELU_TANH_MUL",
    "GEMMA_NORM",
    "PER_LAYER_TYPE_ROPE",
    "PLAIN_NORM",
    "PRE_NORM_RESIDUAL",
    "SILU_MUL",
    "SINGLE_ROPE",
    "SOFTMAX_TOPK",
    "SOFTMAX_TOPK_FP32",
    "TOPK_SOFTMAX_BIASED",
    "Activation",
    "ModelFamily",
    "UnsupportedModelError",
]
