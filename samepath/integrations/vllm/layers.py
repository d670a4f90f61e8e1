"""vLLM's model ops on samepath: RMSNorm (and Gemma's), rotary (the Hugging Face rope parameters
:func:`vllm_rope` reads off a vLLM rotary layer), SiLU·mul, GELU-tanh·mul, linear layers and the
lm_head, the tensor-parallel row-parallel linear, and the fused MoE.

Each ``patch_*`` function takes the plugin's :class:`~samepath.integrations.patcher.Patcher` and
returns whether it applied; see :mod:`samepath.integrations.vllm` for what each replaces.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import (
    apply_rotary,
    biased_moe,
    geglu_tanh,
    grouped_moe,
    has_dense_weight,
    linear,
    loading_model_moe,
    loading_model_routing_fp32,
    moe,
    optional_module,
    rms_norm,
    rotary_cos_sin,
    swiglu,
)
from samepath.integrations.vllm.env import ENV_VAR
from samepath.integrations.vllm.state import check_tensor_parallel_numerics, record_expert_parallel
from samepath.kernels.rotary import mrope_cos_sin
from samepath.models.descriptor import SIGMOID_GROUPED_TOPK
from samepath.models.registry import families
from samepath.models.registry import find as find_family


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


# ----------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------


def plain_experts(layer: Any) -> bool:
    """Unquantized SwiGLU experts without bias or router weights on the input (their parallel layout
    is :func:`moe_parallel_layout`'s business)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return (
        layer.activation == MoEActivation.SILU
        and layer.moe_config.is_act_and_mul
        and not layer.moe_config.has_bias
        and not layer.apply_router_weight_on_input
        and layer.w13_weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def moe_parallel_layout(layer: Any, expert_map: torch.Tensor | None = None) -> tuple[str, int]:
    """How vLLM laid a plain MoE layer's experts out, as samepath runs it: ``("plain", 1)`` (every
    expert whole on this rank), ``("tensor", S)`` (each expert's intermediate dimension sharded over
    the TP group: :func:`samepath.distributed.tensor_parallel_experts`) or ``("expert", k)`` (whole
    experts in ``k`` contiguous blocks over the EP group: :func:`samepath.distributed.expert_parallel_experts`).

    Raises ``NotImplementedError`` naming what the frozen formulas cannot reproduce: data / context /
    sequence parallel MoE, the expert-parallel load balancer (EPLB) or redundant experts, a number
    of experts the expert-parallel size does not divide, an expert placement other than
    ``"linear"`` (contiguous blocks in rank order), a padded per-rank intermediate dimension, experts
    with biases (GPT-OSS's) over more than one rank. ``expert_map``: the global-to-local map to check
    (default ``layer.expert_map``; vllm-ascend keeps its own in ``layer._expert_map``)."""
    config = layer.moe_config
    parallel = config.moe_parallel_config
    where = f"samepath's vLLM MoE ({getattr(layer, 'layer_name', type(layer).__name__)})"
    problems = []
    if parallel.dp_size > 1:
        problems.append(f"data_parallel_size={parallel.dp_size}")
    if getattr(parallel, "pcp_size", 1) > 1:
        problems.append(f"prefill_context_parallel_size={parallel.pcp_size}")
    if parallel.is_sequence_parallel:
        problems.append("sequence-parallel MoE")
    if parallel.enable_eplb or config.num_experts != getattr(config, "num_logical_experts", config.num_experts):
        problems.append("the expert-parallel load balancer (EPLB) / redundant experts")
    sharded = (parallel.use_ep and parallel.ep_size > 1) or parallel.tp_size > 1
    if getattr(config, "has_bias", False) and sharded:
        problems.append(f"experts with biases (GPT-OSS) at tp_size={parallel.tp_size}, ep_size={parallel.ep_size}")
    if problems:
        raise NotImplementedError(f"{where} does not implement {', '.join(problems)}; unset {ENV_VAR} to run vLLM's")
    if parallel.use_ep and parallel.ep_size > 1:
        experts, size, rank = config.num_experts, parallel.ep_size, parallel.ep_rank
        if experts % size:
            raise NotImplementedError(
                f"{where}: {experts} experts are not divisible by the expert-parallel size {size} (vLLM would give "
                "the ranks unequal blocks); samepath's expert parallelism needs equal contiguous blocks"
            )
        strategy = getattr(layer, "expert_placement_strategy", "linear")
        if strategy != "linear":
            raise NotImplementedError(
                f"{where}: expert_placement_strategy={strategy!r} is not implemented; samepath places experts in "
                "contiguous blocks in rank order (expert_placement_strategy='linear')"
            )
        local = experts // size
        expected = torch.full((experts,), -1, dtype=torch.int64)
        expected[rank * local : (rank + 1) * local] = torch.arange(local)
        expert_map = layer.expert_map if expert_map is None else expert_map
        if expert_map is None or not torch.equal(expert_map[:experts].to("cpu", torch.int64), expected):
            raise NotImplementedError(
                f"{where}: rank {rank}'s expert map is not the contiguous block of experts "
                f"{rank * local}..{(rank + 1) * local - 1}"
            )
        return "expert", size
    if parallel.tp_size > 1:
        width = config.intermediate_size // parallel.tp_size
        if layer.w2_weight.shape[2] != width or layer.w13_weight.shape[1] != 2 * width:
            raise NotImplementedError(
                f"{where}: a padded per-rank intermediate dimension ({tuple(layer.w2_weight.shape)} for "
                f"intermediate_size {config.intermediate_size} over {parallel.tp_size} ranks)"
            )
        return "tensor", parallel.tp_size
    return "plain", 1


def biased_experts(layer: Any) -> bool:
    """GPT-OSS's experts: unquantized, biases, gate and up interleaved (``swigluoai``), no router
    weights on the input (a parallel layout other than ``"plain"`` is refused at load)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return (
        layer.activation == MoEActivation.SWIGLUOAI
        and layer.moe_config.is_act_and_mul
        and layer.moe_config.has_bias
        and not layer.apply_router_weight_on_input
        and layer.w13_weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def loading_model_swiglu() -> tuple[float, float] | None:
    """``(swiglu_limit, swiglu_alpha)`` of the model vLLM is loading now (GPT-OSS's config), or None."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    config = getattr(model_config, "hf_config", None)
    if getattr(config, "swiglu_limit", None) is None or getattr(config, "swiglu_alpha", None) is None:
        return None
    return float(config.swiglu_limit), float(config.swiglu_alpha)


#: Routers whose top-k softmax selection is Hugging Face's (others are refused).
PLAIN_ROUTERS = ("CPURouter", "FusedTopKRouter")
#: Routers that carry a sigmoid grouped top-k configuration samepath runs itself (GLM-4.5).
GROUPED_ROUTERS = ("CPURouter", "GroupedTopKRouter")


def routed_scaling_factor(runner: Any) -> float:
    """The routed scaling factor of a grouped MoE layer: vLLM keeps it on the runner (applied to the
    experts' output) or on the router (applied to the weights); samepath folds it into the fp32
    weights, as Hugging Face's router does."""
    runner_scale = float(getattr(runner, "routed_scaling_factor", 1.0))
    return runner_scale if runner_scale != 1.0 else float(getattr(runner.router, "routed_scaling_factor", 1.0))


def _grouped_routing_problems(runner: Any) -> list[str]:
    router = runner.router
    problems = []
    if type(router).__name__ not in GROUPED_ROUTERS:
        problems.append(f"the {type(router).__name__}")
    if getattr(router, "scoring_func", None) != "sigmoid":
        problems.append(f"scoring_func={getattr(router, 'scoring_func', None)!r} (GLM-4.5's router is sigmoid)")
    if type(router).__name__ == "CPURouter" and not getattr(router, "use_grouped_topk", False):
        problems.append("top-k without groups")
    scales = (
        float(getattr(runner, "routed_scaling_factor", 1.0)),
        float(getattr(router, "routed_scaling_factor", 1.0)),
    )
    if scales[0] != 1.0 and scales[1] != 1.0:
        problems.append("a routed scaling factor on both the router and the runner")
    if getattr(router, "num_fused_shared_experts", 0):
        problems.append("shared experts fused into the routed ones")
    if getattr(runner, "shared_expert_gate", None) is not None:
        problems.append("a shared-expert gate")
    return problems


def check_plain_routing(runner: Any, routing: str | None = None, shared: bool = False) -> None:
    """Refuse (``NotImplementedError``) a MoE layer whose routing samepath does not run: for
    ``routing`` :data:`~samepath.models.descriptor.SIGMOID_GROUPED_TOPK` (the family of the model
    being loaded, GLM-4.5) a sigmoid grouped top-k router; otherwise a plain top-k softmax one, with
    shared experts only where ``shared`` (the family's descriptor has them: Qwen3-Next's shared
    expert, its sigmoid gate inside vLLM's shared MLP)."""
    router = runner.router
    problems = []
    if getattr(runner, "routed_input_transform", None) is not None:
        problems.append("a routed input transform (latent MoE)")
    if getattr(runner, "routed_output_transform", None) is not None:
        problems.append("a routed output transform")
    if getattr(router, "custom_routing_function", None) is not None:
        problems.append("a custom routing function")
    if routing == SIGMOID_GROUPED_TOPK:
        problems += _grouped_routing_problems(runner)
    else:
        if type(router).__name__ not in PLAIN_ROUTERS:
            problems.append(f"the {type(router).__name__}")
        if getattr(runner, "routed_scaling_factor", 1.0) != 1.0:
            problems.append(f"routed_scaling_factor={runner.routed_scaling_factor}")
        if getattr(router, "scoring_func", "softmax") != "softmax":
            problems.append(f"scoring_func={router.scoring_func!r}")
        if getattr(router, "use_grouped_topk", False):
            problems.append("grouped top-k")
        if getattr(router, "e_score_correction_bias", None) is not None:
            problems.append("a score-correction bias")
        if getattr(router, "routed_scaling_factor", 1.0) != 1.0:
            problems.append(f"routed_scaling_factor={router.routed_scaling_factor}")
        if runner._shared_experts is not None and not shared:
            problems.append("shared experts")
        if getattr(runner, "shared_expert_gate", None) is not None:
            problems.append("a shared-expert gate on the runner")
    if problems:
        raise NotImplementedError(
            f"samepath's vLLM MoE does not implement {', '.join(problems)}; unset {ENV_VAR} to run vLLM's own kernel"
        )


def patch_moe(patcher: Patcher) -> bool:
    """vLLM's fused MoE → :mod:`samepath.integrations.moe` (Hugging Face's router and expert loop).

    ``UnquantizedFusedMoEMethod.process_weights_after_loading`` keeps plain experts' ``w13_weight``
    ``[E, 2I, H]`` / ``w2_weight`` ``[E, H, I]`` as loaded (no repacking for a fused kernel) and
    marks the layer; ``MoERunner._apply_quant_method`` then routes and runs those layers with
    samepath. Written against vLLM 0.32's modular MoE (``fused_moe/runner/moe_runner.py``)."""
    runner_module = optional_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    method_module = optional_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method")
    if runner_module is None or method_module is None:
        return False
    method_cls = method_module.UnquantizedFusedMoEMethod
    runner_cls = runner_module.MoERunner
    original_process = method_cls.process_weights_after_loading
    original_apply = runner_cls._apply_quant_method

    original_reduce = runner_cls._maybe_reduce_final_output

    def process_weights_after_loading(self, layer):
        biased = type(self) is method_cls and biased_experts(layer) and loading_model_swiglu() is not None
        if type(self) is not method_cls or not (plain_experts(layer) or biased):
            return original_process(self, layer)
        layout = moe_parallel_layout(layer)  # refuses, at load, a layout samepath cannot reproduce
        if layout[0] == "expert":
            record_expert_parallel()  # part of the fingerprint the trainer's must equal
        super(method_cls, self).process_weights_after_loading(layer)
        layer.samepath_experts = True
        layer.samepath_parallel = layout
        layer.samepath_routing_fp32 = loading_model_routing_fp32()
        layer.samepath_routing = loading_model_moe()
        layer.samepath_shared = loading_model_shared_experts()
        layer.samepath_swiglu = loading_model_swiglu() if biased else None  # GPT-OSS: (limit, alpha)
        return None

    def apply_quant_method(self, hidden_states, router_logits, shared_experts_input, input_ids=None, **kwargs):
        experts = self.routed_experts
        if not getattr(experts, "samepath_experts", False):
            return original_apply(self, hidden_states, router_logits, shared_experts_input, input_ids, **kwargs)
        routing = getattr(experts, "samepath_routing", None)
        shared = bool(getattr(experts, "samepath_shared", False))
        check_plain_routing(self, routing, shared)
        if getattr(experts, "samepath_swiglu", None) is not None:  # GPT-OSS: top-k, then softmax; biases
            out = biased_moe(
                hidden_states, router_logits, experts.w13_weight, experts.w13_bias, experts.w2_weight,
                experts.w2_bias, self.router.top_k, *experts.samepath_swiglu,
            )  # fmt: skip
            return None, out
        kind, _ = getattr(experts, "samepath_parallel", ("plain", 1))
        if routing == SIGMOID_GROUPED_TOPK:
            if kind != "plain":
                raise NotImplementedError(
                    f"samepath's vLLM MoE does not implement {routing} routing under {kind} parallelism; "
                    "use tensor_parallel_size=1 or unset " + ENV_VAR
                )
            return grouped_apply(self, hidden_states, router_logits, shared_experts_input, **kwargs)
        top = (self.router.top_k, bool(self.router.renormalize))
        weights_fp32 = bool(getattr(experts, "samepath_routing_fp32", False))
        if kind == "plain" and shared and self._shared_experts is not None:  # Qwen3-Next: shared + routed
            args = (hidden_states, router_logits, shared_experts_input, top, weights_fp32)
            return plain_shared_apply(self, *args, **kwargs)
        if kind == "plain":
            w13, w2 = experts.w13_weight, experts.w2_weight
            return None, moe(hidden_states, router_logits, w13, w2, *top, weights_fp32)
        return None, parallel_moe(experts, kind, hidden_states, router_logits, *top, weights_fp32)

    def reduce_final_output(self, states, trunc_size, output_is_reduced=None):
        # samepath's TP / EP experts return the whole layer on every rank (their frozen exchange
        # replaces vLLM's all-reduce): only the truncation is left.
        if getattr(self.routed_experts, "samepath_parallel", ("plain", 1))[0] != "plain":
            return states[..., :trunc_size] if trunc_size is not None else states
        return original_reduce(self, states, trunc_size, output_is_reduced)

    original_scale = runner_cls._maybe_apply_routed_scale_to_output

    def maybe_apply_routed_scale_to_output(self, shared_output, fused_output):
        # samepath's grouped router has folded the routed scaling factor into the fp32 weights.
        if getattr(self.routed_experts, "samepath_experts", False):
            return shared_output, fused_output
        return original_scale(self, shared_output, fused_output)

    patcher.set(method_cls, "process_weights_after_loading", process_weights_after_loading)
    patcher.set(runner_cls, "_apply_quant_method", apply_quant_method)
    patcher.set(runner_cls, "_maybe_apply_routed_scale_to_output", maybe_apply_routed_scale_to_output)
    patcher.set(runner_cls, "_maybe_reduce_final_output", reduce_final_output)
    return True


def parallel_moe(
    experts: Any,
    kind: str,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_fp32: bool,
) -> torch.Tensor:
    """A tensor- or expert-parallel MoE layer (:func:`moe_parallel_layout`'s ``kind``): Hugging
    Face's router on the (replicated) logits, then :func:`samepath.distributed.tensor_parallel_experts`
    over vLLM's TP group or :func:`samepath.distributed.expert_parallel_experts` over its EP group;
    the whole layer's output on every rank. (vllm-ascend's path calls it too.)"""
    from vllm.distributed import get_ep_group, get_tp_group

    from samepath.distributed import expert_parallel_experts, tensor_parallel_experts
    from samepath.integrations.moe import topk_softmax_routing

    check_tensor_parallel_numerics()
    dtype = torch.float32 if weights_fp32 else hidden_states.dtype
    index, weights = topk_softmax_routing(router_logits, top_k, renormalize, dtype)
    w13, w2 = experts.w13_weight, experts.w2_weight
    if kind == "tensor":
        return tensor_parallel_experts(hidden_states, w13, w2, index, weights, get_tp_group().device_group)
    group = get_ep_group().device_group
    return expert_parallel_experts(hidden_states, w13, w2, index, weights, experts.global_num_experts, group)


def loading_model_shared_experts() -> bool:
    """Whether the family of the model vLLM is loading now has a sigmoid-gated shared expert beside
    softmax top-k routing (its descriptor's ``shared_expert_gate``: Qwen3-Next)."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    family = find_family(getattr(getattr(model_config, "hf_config", None), "model_type", None))
    return bool(family is not None and getattr(family, "shared_expert_gate", False))


def plain_shared_apply(runner: Any, hidden_states, router_logits, shared_experts_input, top, weights_fp32, **kwargs):
    """``MoERunner._apply_quant_method`` of a softmax top-k layer with a shared expert (Qwen3-Next): the
    shared expert (vLLM's own module: samepath's linear and SiLU·mul, its sigmoid gate), then
    :func:`~samepath.integrations.vllm.common.moe` — returned as ``(shared_output, routed_output)``,
    which the runner adds in the dtype, as Hugging Face's ``Qwen3NextSparseMoeBlock`` does."""
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    runner._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
    experts = runner.routed_experts
    out = moe(hidden_states, router_logits, experts.w13_weight, experts.w2_weight, *top, weights_fp32)
    if kwargs.get("shared_experts_overlapping", False):
        runner._shared_experts.wait()
    return runner._shared_experts.output, out


def grouped_apply(runner: Any, hidden_states, router_logits, shared_experts_input, **kwargs):
    """``MoERunner._apply_quant_method`` of a GLM-4.5 layer: the shared experts (vLLM's own module:
    samepath's linear and SiLU·mul), then :func:`~samepath.integrations.vllm.common.grouped_moe` —
    returned as ``(shared_output, routed_output)``, which the runner adds (in the dtype, as Hugging
    Face's ``Glm4MoeMoE`` does)."""
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    runner._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
    router, experts = runner.router, runner.routed_experts
    gate = getattr(runner, "gate", None)
    if router_logits.dtype != torch.float32 and gate is not None:
        # DeepSeek-V3's gate keeps the checkpoint dtype (GLM-4.5's is fp32): Hugging Face's router
        # takes the logits of the fp32 input and weight, so they are taken again here, in fp32.
        router_logits = linear(hidden_states.to(torch.float32), gate.weight.to(torch.float32))
    bias = router.e_score_correction_bias
    out = grouped_moe(
        hidden_states,
        router_logits,
        None if bias is None else bias.data,
        experts.w13_weight,
        experts.w2_weight,
        router.top_k,
        router.num_expert_group,
        router.topk_group,
        bool(router.renormalize),
        routed_scaling_factor(runner),
    )
    if kwargs.get("shared_experts_overlapping", False):
        runner._shared_experts.wait()
    return (runner._shared_experts.output if runner._shared_experts is not None else None), out


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
