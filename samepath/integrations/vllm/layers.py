"""vLLM's model ops on samepath: RMSNorm (and Gemma's), rotary (the Hugging Face rope parameters
:func:`vllm_rope` reads off a vLLM rotary layer), SiLU·mul, GELU-tanh·mul, linear layers, the
lm_head and the tensor-parallel row-parallel linear. The fused MoE is :mod:`samepath.integrations.vllm.moe`
(its names are importable from here too).

Each ``patch_*`` function takes the plugin's :class:`~samepath.integrations.patcher.Patcher` and
returns whether it applied; see :mod:`samepath.integrations.vllm` for what each replaces.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import (
    apply_rotary,
    geglu_tanh,
    has_dense_weight,
    linear,
    optional_module,
    rms_norm,
    rotary_cos_sin,
    swiglu,
)
from samepath.integrations.vllm.env import ENV_VAR
from samepath.integrations.vllm.moe import (  # the MoE lives in moe.py; its names stay importable here
    GROUPED_ROUTERS,
    PLAIN_ROUTERS,
    biased_experts,
    check_plain_routing,
    grouped_apply,
    loading_model_swiglu,
    moe_parallel_layout,
    parallel_moe,
    patch_moe,
    plain_experts,
    routed_scaling_factor,
)
from samepath.integrations.vllm.state import check_tensor_parallel_numerics
from samepath.kernels.rotary import mrope_cos_sin
from samepath.models.registry import families


def patch_rms_norm(patcher: Patcher) -> bool:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        plain = (
            type(self).forward_native is RMSNorm.forward_native
            and self.variance_size_override is None
            and self.has_weight
            and getattr(self, "bias", None) is None
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and self.weight.dtype == x.dtype
        )
        if not plain:
            return CustomOp.forward(self, x, residual) if residual is not None else CustomOp.forward(self, x)
        # GPT-OSS's norms: "fp32_weight", marked at load (loader.mark_norm_weight_modes).
        mode = getattr(self, "samepath_weight_mode", "cast_then_weight")
        if residual is None:
            return rms_norm(x, self.weight.data, self.variance_epsilon, weight_mode=mode)
        # HF's decoder layer: hidden = residual + hidden (rounded to the dtype), then the norm.
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual, weight_mode=mode)

    patcher.set(RMSNorm, "forward", forward)
    return True


def plain_gemma_norm(module: Any, dtype: torch.dtype) -> bool:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    return (
        type(module) is GemmaRMSNorm
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and module.weight.dtype == dtype
    )


def patch_gemma_rms_norm(patcher: Patcher) -> bool:
    """``GemmaRMSNorm.forward`` (Gemma 3's four norms per layer, its q/k norms and the final norm):
    :func:`samepath.rms_norm` with ``weight_mode="fp32_one_plus_weight"`` — the fp32 row times
    ``1 + weight.float()``, one rounding, as ``Gemma3RMSNorm`` computes. With a residual, vLLM's
    fused add+norm (whose statistics read the unrounded fp32 sum) becomes ``s = x + residual``
    rounded to the dtype, then the norm of ``s``: Hugging Face's decoder layer's rounding."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not plain_gemma_norm(self, x.dtype):
            return CustomOp.forward(self, x, residual) if residual is not None else CustomOp.forward(self, x)
        weight_mode = "fp32_one_plus_weight"
        if residual is None:
            return rms_norm(x, self.weight.data, self.variance_epsilon, weight_mode=weight_mode)
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual, weight_mode=weight_mode)

    patcher.set(GemmaRMSNorm, "forward", forward)
    return True


class UnsupportedRopeError(NotImplementedError):
    """A vLLM rotary layer whose formula samepath cannot make equal to Hugging Face's."""


def vllm_rope(layer: Any) -> tuple[int, float, dict[str, Any]]:
    """``(rotary_dim, base, scaling)`` of a vLLM rotary layer: its own constructor arguments as
    Hugging Face rope parameters, the input of :func:`samepath.rotary_cos_sin`.

    Written against vLLM 0.32's ``rotary_embedding`` package: ``RotaryEmbedding`` (default),
    ``LinearScalingRotaryEmbedding`` (one factor), ``DynamicNTKScalingRotaryEmbedding``
    (``max_trained_positions == max_position_embeddings``: Hugging Face's formula below
    ``max_position_embeddings``), ``YaRNScalingRotaryEmbedding``, ``DeepseekScalingRotaryEmbedding``
    (DeepSeek's YaRN: its ``mscale`` ratio is Hugging Face's ``attention_factor``), ``Llama3RotaryEmbedding`` and
    ``Phi3LongRoPEScaledRotaryEmbedding`` (short factors: ``max_model_len`` at most
    ``original_max_position_embeddings``), and ``MRotaryEmbedding`` without scaling (multimodal
    rope: see :func:`vllm_rope_layout`), neox or GPT-J style (:func:`vllm_rope_layout`). Anything
    else — dual-chunk, NTK-alpha / Fourier scaling, mrope with YaRN, LoRA's multi-factor
    linear cache — raises :class:`UnsupportedRopeError`: it is refused rather than left on vLLM's
    formula.
    """
    kind = rope_class_name(type(layer))
    where = f"{type(layer).__name__} (vLLM rotary layer)"
    if kind is None:
        raise UnsupportedRopeError(f"{where}: samepath has no Hugging Face formula for this rotary layer")
    base = float(layer.base)
    if kind == "MRotaryEmbedding":
        if layer.scaling_factor is not None:
            raise UnsupportedRopeError(f"{where}: multimodal rope with YaRN scaling is not supported")
        if not layer.mrope_section or len(layer.mrope_section) != 3:
            raise UnsupportedRopeError(f"{where}: mrope_section {layer.mrope_section} is not three sections")
        return layer.rotary_dim, base, {"rope_type": "default"}
    if kind == "RotaryEmbedding":
        return layer.rotary_dim, base, {"rope_type": "default"}
    if kind == "LinearScalingRotaryEmbedding":
        if len(layer.scaling_factors) != 1:
            raise UnsupportedRopeError(f"{where}: several linear scaling factors {layer.scaling_factors}")
        return layer.rotary_dim, base, {"rope_type": "linear", "factor": layer.scaling_factors[0]}
    if kind == "DynamicNTKScalingRotaryEmbedding":
        if layer.max_trained_positions != layer.max_position_embeddings:
            raise UnsupportedRopeError(
                f"{where}: max_trained_positions={layer.max_trained_positions} differs from "
                f"max_position_embeddings={layer.max_position_embeddings} (not Hugging Face's dynamic rope)"
            )
        scaling = {"rope_type": "dynamic", "factor": layer.scaling_factor}
        return layer.rotary_dim, base, {**scaling, "max_position_embeddings": layer.max_position_embeddings}
    if kind in ("YaRNScalingRotaryEmbedding", "DeepseekScalingRotaryEmbedding"):
        # DeepSeek-V3's YaRN keeps mscale / mscale_all_dim as one ratio in ``mscale`` and always truncates.
        scaling = {"rope_type": "yarn", "factor": layer.scaling_factor, "beta_fast": layer.beta_fast}
        scaling |= {"beta_slow": layer.beta_slow, "truncate": getattr(layer, "truncate", True)}
        scaling |= {"original_max_position_embeddings": layer.max_position_embeddings, "attention_factor": layer.mscale}
        return layer.rotary_dim, base, scaling
    if kind == "Llama3RotaryEmbedding":
        return (
            layer.rotary_dim,
            base,
            {
                "rope_type": "llama3",
                "factor": layer.scaling_factor,
                "low_freq_factor": layer.low_freq_factor,
                "high_freq_factor": layer.high_freq_factor,
                "original_max_position_embeddings": layer.orig_max_position,
            },
        )
    if kind == "Phi3LongRoPEScaledRotaryEmbedding":
        if layer.use_long_rope:
            raise UnsupportedRopeError(
                f"{where}: max_model_len exceeds original_max_position_embeddings="
                f"{layer.original_max_position_embeddings}, so vLLM applies the long factors to every position "
                "while Hugging Face applies the short ones below it; set max_model_len <= "
                f"{layer.original_max_position_embeddings}"
            )
        return (
            layer.rotary_dim,
            base,
            {
                "rope_type": "longrope",
                "short_factor": list(layer.short_factor),
                "long_factor": list(layer.long_factor),
                "original_max_position_embeddings": layer.original_max_position_embeddings,
                "attention_factor": layer.short_mscale,
                "max_position_embeddings": layer.max_position_embeddings,
            },
        )
    raise UnsupportedRopeError(f"{where}: samepath has no Hugging Face formula for this rotary layer")


#: vLLM 0.32 rotary classes :func:`vllm_rope` maps (by exact class, in vLLM's rotary package).
ROPE_CLASSES = (
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
    "MRotaryEmbedding",
)
#: vllm-ascend's subclasses that keep their vLLM parent's parameters (only the kernel differs).
ASCEND_ROPE_CLASSES = {
    "AscendRotaryEmbedding": "RotaryEmbedding",
    "AscendYaRNRotaryEmbedding": "YaRNScalingRotaryEmbedding",
}


def rope_class_name(cls: type) -> str | None:
    """The vLLM rotary class whose parameters ``cls`` carries (see :data:`ROPE_CLASSES`), or ``None``."""
    if cls.__module__.startswith("vllm.model_executor.layers.rotary_embedding") and cls.__name__ in ROPE_CLASSES:
        return cls.__name__
    if cls.__module__.startswith("vllm_ascend."):
        return ASCEND_ROPE_CLASSES.get(cls.__name__)
    return None


def vllm_rope_layout(layer: Any) -> tuple[bool, tuple[int, ...] | None, bool]:
    """``(interleaved, mrope_section, mrope_interleaved)`` of a vLLM rotary layer: GPT-J pairs
    (``is_neox_style=False``: Hugging Face's GLM-4 / Cohere ``rotate_half`` on even / odd columns),
    and for ``MRotaryEmbedding`` its sections (contiguous: Qwen2.5-VL; interleaved: Qwen3-VL) —
    ``None`` for a one-dimensional rope."""
    interleaved = not getattr(layer, "is_neox_style", True)
    if rope_class_name(type(layer)) != "MRotaryEmbedding":
        return interleaved, None, False
    return interleaved, tuple(int(s) for s in layer.mrope_section), bool(layer.mrope_interleaved)


def rotate(self: Any, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None):
    """vLLM's rotary contract (``positions [T]``, or ``[3, T]`` for multimodal rope; ``query
    [T, H*D]``, ``key [T, Hkv*D]`` or ``None``) on samepath: the layer's :func:`vllm_rope` parameters
    and :func:`vllm_rope_layout` (cached on the layer), cos/sin from :func:`samepath.rotary_cos_sin`
    (multimodal: :func:`samepath.kernels.rotary.mrope_cos_sin`), the rotation by
    :func:`samepath.apply_rotary` (GPT-J pairs for a layer that is not neox style)."""
    cached = vars(self).get("_samepath_rope")
    if cached is None:
        cached = (*vllm_rope(self), *vllm_rope_layout(self))
        self._samepath_rope = cached
    rotary_dim, base, scaling, interleaved, mrope_section, mrope_interleaved = cached
    if mrope_section is not None:
        if torch.compiler.is_compiling():
            raise UnsupportedRopeError(f"{type(self).__name__}: multimodal rope in a compiled region (enforce_eager)")
        cos, sin = mrope_cos_sin(
            positions, rotary_dim, base, query.dtype, list(mrope_section), scaling, mrope_interleaved
        )
    else:
        positions = positions.flatten()
        cos, sin = rotary_cos_sin(positions, rotary_dim, base, query.dtype, scaling)
    if interleaved:  # Hugging Face's GLM-4: the first half of each table repeated in place
        half = rotary_dim // 2
        cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    tokens = cos.shape[0]
    q = query.reshape(tokens, -1, self.head_size)
    if key is None:
        q_out, _ = apply_rotary(q, q[:, :1], cos, sin, unsqueeze_dim=1, interleaved=interleaved)
        return q_out.reshape(query.shape), None
    k = key.reshape(tokens, -1, self.head_size)
    q_out, k_out = apply_rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=interleaved)
    return q_out.reshape(query.shape), k_out.reshape(key.shape)


def rotary_forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None, *args, **kw):
    if args or any(v is not None for v in kw.values()):
        raise UnsupportedRopeError(
            f"{type(self).__name__}: extra rotary arguments ({len(args)} positional, {sorted(kw)}; e.g. LoRA offsets)"
        )
    return rotate(self, positions, query, key)


def patch_rotary(patcher: Patcher) -> bool:
    """Every vLLM rotary layer: cos/sin from :func:`samepath.rotary_cos_sin` with the Hugging Face
    parameters :func:`vllm_rope` reads off the layer, the rotation by :func:`samepath.apply_rotary`;
    a layer :func:`vllm_rope` cannot map raises instead of running vLLM's formula."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    patcher.set(RotaryEmbeddingBase, "forward", rotary_forward)
    for cls in family_rotary_classes():
        patcher.set(cls, "forward", rotary_forward)
    return True


def family_rotary_classes() -> tuple[type, ...]:
    """The rotary classes outside ``RotaryEmbeddingBase`` that registered families' vLLM layers use
    (their descriptors' ``vllm_rotary_classes``: Phi-3's long-rope), imported now."""
    found: list[type] = []
    for family in set(families().values()):
        for name in family.vllm_rotary_classes:
            where, _, cls_name = name.rpartition(":")
            cls = getattr(optional_module(where), cls_name, None)
            if cls is not None and cls not in found:
                found.append(cls)
    return tuple(found)


def patch_silu_mul(patcher: Patcher) -> bool:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self) is not SiluAndMul or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return CustomOp.forward(self, x)
        return swiglu(x)

    patcher.set(SiluAndMul, "forward", forward)
    return True


def patch_gelu_tanh_mul(patcher: Patcher) -> bool:
    """``GeluAndMul.forward`` with ``approximate="tanh"`` (``gelu_pytorch_tanh``, Gemma's MLP):
    :func:`samepath.geglu_tanh`, the function the Hugging Face side's ``Gemma3MLP`` runs on the
    gate and up halves. The exact (erf) GELU stays on vLLM's kernel, and the audit calls it
    uncovered."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import GeluAndMul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = (
            type(self) is GeluAndMul
            and self.approximate == "tanh"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        if not plain:
            return CustomOp.forward(self, x)
        return geglu_tanh(x)

    patcher.set(GeluAndMul, "forward", forward)
    return True


# ----------------------------------------------------------------------------------------------
# Linear layers and the lm_head
# ----------------------------------------------------------------------------------------------


def patch_linear(patcher: Patcher) -> bool:
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        # Keep the plain weight (no oneDNN / sgl repacking, no removal): samepath.linear reads it.
        if not has_dense_weight(layer):
            return original_dispatch(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: linear(x, weight, bias)
        return None

    patcher.set(layer_utils, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)
    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        original_apply = method.apply

        def apply(self, layer, x, bias=None, _original=original_apply):
            if not has_dense_weight(layer) or x.dtype != layer.weight.dtype:
                return _original(self, layer, x, bias)
            return linear(x, layer.weight, bias)

        patcher.set(method, "apply", apply)
    return True


def patch_row_parallel(patcher: Patcher) -> bool:
    """``RowParallelLinear.forward`` at ``tensor_parallel_size > 1``: instead of the partial
    products' all-reduce (an order samepath does not control),
    :func:`samepath.distributed.row_parallel_linear` over vLLM's TP group — fp32 partials
    all-gathered and summed in rank order, equal to ``linear(x, w, b, k_slices=S)`` on one process
    (the trainer's side: :func:`samepath.integrations.hf.tensor_parallel_numerics`)."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    from samepath.distributed import row_parallel_linear

    original_forward = RowParallelLinear.forward

    def forward(self, input_):
        if self.tp_size == 1:
            return original_forward(self, input_)
        check_tensor_parallel_numerics()
        problems = []
        if not isinstance(self.quant_method, UnquantizedLinearMethod) or not has_dense_weight(self):
            problems.append("quantized or non-dense weights")
        if not self.reduce_results:
            problems.append("a deferred (fused) all-reduce")
        if problems:
            raise NotImplementedError(
                f"samepath's tensor-parallel RowParallelLinear does not implement {', '.join(problems)} "
                f"({self.prefix}); unset {ENV_VAR} or use tensor_parallel_size=1"
            )
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = None if self.skip_bias_add else self.bias
        output = row_parallel_linear(input_parallel, self.weight, get_tp_group().device_group, bias)
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)

    patcher.set(RowParallelLinear, "forward", forward)
    return True


__all__ = [
    "ASCEND_ROPE_CLASSES",
    "GROUPED_ROUTERS",
    "PLAIN_ROUTERS",
    "ROPE_CLASSES",
    "UnsupportedRopeError",
    "biased_experts",
    "check_plain_routing",
    "family_rotary_classes",
    "grouped_apply",
    "loading_model_swiglu",
    "moe_parallel_layout",
    "parallel_moe",
    "patch_gelu_tanh_mul",
    "patch_gemma_rms_norm",
    "patch_linear",
    "patch_moe",
    "patch_rms_norm",
    "patch_rotary",
    "patch_row_parallel",
    "patch_silu_mul",
    "plain_experts",
    "plain_gemma_norm",
    "rope_class_name",
    "rotary_forward",
    "rotate",
    "routed_scaling_factor",
    "vllm_rope",
    "vllm_rope_layout",
]
