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
#: Multimodal rope (``rope_parameters["mrope_section"]``, position ids ``[3, batch, seq]``) with contiguous
#: sections (Qwen2-VL / Qwen2.5-VL's ``recomposition_frequencies``).
MULTIMODAL_ROPE = "mrope"
#: Multimodal rope with interleaved sections (Qwen3-VL's text rotary module always interleaves).
INTERLEAVED_MULTIMODAL_ROPE = "mrope_interleaved"
ROPE_MODES = (SINGLE_ROPE, PER_LAYER_TYPE_ROPE, MULTIMODAL_ROPE, INTERLEAVED_MULTIMODAL_ROPE)

#: MoE routing: fp32 softmax, top-k, optional renormalisation, weights cast to the dtype (Qwen3-MoE).
SOFTMAX_TOPK = "softmax_topk"
#: MoE routing: fp32 softmax, top-k, renormalised, weights kept in fp32 (Mixtral).
SOFTMAX_TOPK_FP32 = "softmax_topk_fp32"
#: MoE routing: fp32 sigmoid, score-correction bias for the choice, grouped top-k, routed scaling
#: factor, weights kept in fp32 (GLM-4.5, :func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing`).
SIGMOID_GROUPED_TOPK = "sigmoid_grouped_topk"
#: MoE routing: router logits with a bias, top-k of the logits, fp32 softmax over the k, weights cast
#: to the dtype; experts with biases (GPT-OSS).
TOPK_SOFTMAX_BIASED = "topk_softmax_biased"
MOE_KINDS = (SOFTMAX_TOPK, SOFTMAX_TOPK_FP32, SIGMOID_GROUPED_TOPK, TOPK_SOFTMAX_BIASED)

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
    #: The vLLM plugin's patch group that runs it (``samepath.integrations.vllm.plugin``).
    vllm_patch: str = ""


SILU_MUL = Activation(
    op="silu_mul",
    config_key="hidden_act",
    default="silu",
    accepted=("silu", "swish"),
    refusal="{key}={act!r} is not supported (samepath implements SiLU·mul)",
    vllm_patch="silu_mul",
)
GELU_TANH_MUL = Activation(
    op="gelu_tanh_mul",
    config_key="hidden_activation",
    default=None,
    accepted=("gelu_pytorch_tanh",),
    refusal="{key}={act!r} is not supported for {model_type} (samepath implements GELU-tanh·mul, gelu_pytorch_tanh)",
    vllm_patch="gelu_tanh_mul",
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

#: A norm's ``weight_mode`` -> the vLLM plugin's patch group that runs it (``RMSNorm`` / ``GemmaRMSNorm``;
#: GPT-OSS's norms, marked at load, run under the plain ``RMSNorm`` patch).
NORM_VLLM_PATCHES = {PLAIN_NORM: "rms_norm", GEMMA_NORM: "gemma_rms_norm", FP32_WEIGHT_NORM: "rms_norm"}


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
    * ``rope``: one of :data:`ROPE_MODES` (one rope, one per layer type, multimodal with contiguous or
      interleaved sections);
    * ``partial_rotary``: the attention rotates the first ``int(head_dim * partial_rotary_factor)``
      dimensions of each head and passes the rest through (GLM-4.5); otherwise the config's
      ``partial_rotary_factor`` is refused;
    * ``moe``: ``None`` or one of :data:`MOE_KINDS`; ``hf_router``: the class-name suffix of a
      router module whose forward samepath replaces (GLM-4.5's ``"TopkRouter"``, GPT-OSS's
      ``"TopKRouter"``), ``None`` for routers that are plain torch ops of the trainer (Qwen3-MoE's);
      ``shared_experts``: the MoE block adds a dense shared-experts MLP;
    * ``sliding_window_by_default``: the config's ``sliding_window`` applies unless
      ``use_sliding_window`` is false (Qwen2 windows only with ``use_sliding_window``);
      ``query_pre_attn_scalar``: the attention scale is ``config.query_pre_attn_scalar ** -0.5``
      instead of ``head_size ** -0.5``; ``embedding_scale``: the embeddings are multiplied by
      ``sqrt(hidden_size)`` (Gemma); ``layer_types``: ``config.layer_types`` picks each layer's sliding or
      full attention (recorded in the formulas); ``softcap``: the config's ``attn_logit_softcapping`` and
      ``final_logit_softcapping`` are applied, by :mod:`samepath.kernels.softcap` on both sides (Gemma 2);
      ``attention_sinks``: a learned sink logit per head joins the softmax (GPT-OSS's ``sinks``);
      ``mla``: multi-head latent attention (DeepSeek-V3), run in :mod:`samepath.kernels.mla`'s absorbed
      form on both sides (the ``{prefix}Attention`` forward replaced);
    * ``config_problems``: the config options of this family samepath refuses (soft-capping,
      bidirectional attention, ...) as ``config -> [problem, ...]``; ``extra_formulas``: the
      family's own entries of :func:`samepath.models.model_formulas` (``config -> dict``, merged
      over the generic ones, a dict value into the generic dict of that key);
    * ``vllm_module`` / ``vllm_structure`` / ``vllm_attention`` / ``vllm_mlp``: vLLM's models
      module, the classes whose own code is structure only, the attention class and the MLP
      classes (a name ``"module:Class"`` is looked up in that other module) — the load audit's
      per-family rules; ``vllm_rotary_classes``: rotary classes (``"module:Class"``) the family's vLLM
      layers use outside vLLM's ``RotaryEmbeddingBase`` (Phi-3's long-rope), patched and audited too.
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
    partial_rotary: bool = False
    moe: str | None = None
    hf_router: str | None = None
    shared_experts: bool = False
    sliding_window_by_default: bool = False
    query_pre_attn_scalar: bool = False
    embedding_scale: bool = False
    layer_types: bool = False
    softcap: bool = False
    attention_sinks: bool = False
    mla: bool = False
    config_problems: Callable[[Any], list[str]] | None = None
    extra_formulas: Callable[[Any], dict[str, Any]] | None = None
    vllm_rotary_classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError("a ModelFamily needs at least one model_type")
        if self.norm_weight_mode not in (PLAIN_NORM, GEMMA_NORM, FP32_WEIGHT_NORM):
            raise ValueError(
                f"norm_weight_mode must be {PLAIN_NORM!r}, {GEMMA_NORM!r} or {FP32_WEIGHT_NORM!r}, "
                f"got {self.norm_weight_mode!r}"
            )
        if self.rope not in ROPE_MODES:
            raise ValueError(f"rope must be one of {ROPE_MODES}, got {self.rope!r}")
        if self.moe is not None and self.moe not in MOE_KINDS:
            raise ValueError(f"moe must be None or one of {MOE_KINDS}, got {self.moe!r}")

    @property
    def name(self) -> str:
        return self.model_types[0]

    def vllm_patches(self) -> tuple[str, ...]:
        """The vLLM plugin's family-specific patch groups this family's layers need: its norm's and
        its activation's."""
        # A norm or activation without a group of its own (run by another patch) adds none; what no
        # patch runs is still refused by the load audit.
        names = (NORM_VLLM_PATCHES.get(self.norm_weight_mode, ""), self.activation.vllm_patch)
        return tuple(name for name in names if name)

    @property
    def routing_weights_fp32(self) -> bool:
        """Whether the MoE routing weights stay in fp32 (Mixtral, GLM-4.5) rather than being cast to
        the activations' dtype (Qwen3-MoE) before they scale the experts' outputs."""
        return self.moe in (SOFTMAX_TOPK_FP32, SIGMOID_GROUPED_TOPK)

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
    "INTERLEAVED_MULTIMODAL_ROPE",
    "MOE_KINDS",
    "MULTIMODAL_ROPE",
    "NORM_VLLM_PATCHES",
    "PER_LAYER_TYPE_ROPE",
    "PLAIN_NORM",
    "PRE_NORM_RESIDUAL",
    "ROPE_MODES",
    "SIGMOID_GROUPED_TOPK",
    "SILU_MUL",
    "SINGLE_ROPE",
    "SOFTMAX_TOPK",
    "SOFTMAX_TOPK_FP32",
    "TOPK_SOFTMAX_BIASED",
    "Activation",
    "ModelFamily",
    "UnsupportedModelError",
]
