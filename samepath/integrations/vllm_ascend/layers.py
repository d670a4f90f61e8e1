"""vllm-ascend's model ops on samepath: ``AscendRMSNorm``, the rotary classes, ``AscendSiluAndMul``,
``AscendUnquantizedLinearMethod`` (and vLLM's lm_head method), ``AscendUnquantizedFusedMoEMethod``.

Each ``patch_*`` function records what it replaces (:func:`~samepath.integrations.vllm_ascend.state.set_original`)
and returns whether it applied; see :mod:`samepath.integrations.vllm_ascend` for what each replaces.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from samepath.audit import ALLOW_ENV_VAR, allowed_names
from samepath.integrations.moe import experts_forward, topk_softmax_routing
from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import has_dense_weight, loading_model_routing_fp32, optional_module
from samepath.integrations.vllm.layers import (
    UnsupportedRopeError,
    family_rotary_classes,
    moe_parallel_layout,
    parallel_moe,
    rotary_forward,
    rotate,
)
from samepath.integrations.vllm.state import record_expert_parallel
from samepath.integrations.vllm_ascend.compat import moe_method_base
from samepath.integrations.vllm_ascend.state import original, set_original
from samepath.kernels.matmul import linear
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.swiglu import swiglu

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def norm_variant(norm: Any, x: torch.Tensor) -> str | None:
    """Why samepath's norm does not implement this ``AscendRMSNorm`` call, or ``None``."""
    if getattr(norm, "bias", None) is not None:
        return "a norm bias (anti-outlier quantization: npu_add_rms_norm_bias with a bias)"
    if not getattr(norm, "has_weight", True):
        return "a norm without a weight"
    if getattr(norm, "variance_size_override", None) is not None:
        return "variance over part of the hidden size (variance_size_override)"
    if x.dtype not in FLOATS or norm.weight.dtype != x.dtype:
        return f"input {x.dtype} with weight {norm.weight.dtype}"
    return None


def patch_rms_norm(patcher: Patcher) -> bool:
    """``AscendRMSNorm.forward_oot``: vllm-ascend's default path is
    ``torch.ops._C_ascend.npu_add_rms_norm_bias`` (custom ops built) or ``npu_add_rms_norm`` with a
    residual, ``npu_rms_norm`` without; both become :func:`samepath.rms_norm`. Without a residual,
    vllm-ascend's weight-prefetch post-process step runs after the norm as in the original. A norm
    samepath does not implement (:func:`norm_variant`) raises ``NotImplementedError`` at its first
    call, unless ``SAMEPATH_ALLOW_UNCOVERED`` names ``rms_norm`` / ``AscendRMSNorm`` / ``all``:
    then vllm-ascend's op runs (off samepath's contract)."""
    from vllm_ascend.ops.layernorm import AscendRMSNorm

    prefetch_method = getattr(optional_module("vllm_ascend.utils"), "get_weight_prefetch_method", lambda: None)

    def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        variant = norm_variant(self, x)
        if variant is not None:
            if not {"all", "rms_norm", "AscendRMSNorm"} & set(allowed_names()):
                raise NotImplementedError(
                    f"samepath's vllm-ascend RMSNorm does not implement {variant}; the rollout would run "
                    f"vllm-ascend's op and differ from the trainer. Set {ALLOW_ENV_VAR}=rms_norm to run it "
                    "anyway (off samepath's contract), or unset SAMEPATH_VLLM."
                )
            return original(AscendRMSNorm, "forward_oot")(self, x, residual)
        if residual is None:
            out = rms_norm(x, self.weight.data, self.variance_epsilon)
            prefetch = prefetch_method()
            if prefetch is not None:
                prefetch.maybe_prefetch_mlp_weight_postprocess(out)
            return out
        if residual.shape[0] != x.shape[0]:  # sequence-parallel: this rank's chunk, as vllm-ascend takes it
            residual = torch.ops.vllm.maybe_chunk_residual(x, residual)
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual)

    set_original(patcher, AscendRMSNorm, "forward_oot", forward_oot)
    return True


def patch_rotary(patcher: Patcher) -> bool:
    """vllm-ascend's rotary classes (``AscendRotaryEmbedding``, ``AscendYaRNRotaryEmbedding``) and
    vLLM's own (llama3, linear, dynamic NTK, longrope: vllm-ascend does not override them, so they
    would dispatch to vLLM's formula) through :func:`samepath.integrations.vllm.rotate`; GPT-J style,
    LoRA offsets, fp8 outputs and unmapped rope types raise ``UnsupportedRopeError``. The MTP draft
    layers (which only propose tokens) keep vllm-ascend's op."""
    ascend_rope = importlib.import_module("vllm_ascend.ops.rotary_embedding")

    def make(owner: type):
        def forward_oot(
            self,
            positions: torch.Tensor,
            query: torch.Tensor,
            key: torch.Tensor | None,
            offsets: torch.Tensor | None = None,
            is_neox_style_override: bool | None = None,
            out_dtype: torch.dtype | None = None,
        ):
            if getattr(self, "use_mtp", False):
                extra = () if out_dtype is None else (out_dtype,)
                return original(owner, "forward_oot")(
                    self, positions, query, key, offsets, is_neox_style_override, *extra
                )
            neox = self.is_neox_style if is_neox_style_override is None else is_neox_style_override
            problems = [
                what
                for what, bad in (
                    ("GPT-J (interleaved) style", not neox),
                    ("LoRA offsets", offsets is not None),
                    (f"out_dtype={out_dtype}", out_dtype is not None),
                )
                if bad
            ]
            if problems:
                raise UnsupportedRopeError(f"{type(self).__name__}: samepath's rotary does not implement {problems}")
            return rotate(self, positions, query, key)

        return forward_oot

    for name in ("AscendRotaryEmbedding", "AscendYaRNRotaryEmbedding"):
        owner = getattr(ascend_rope, name, None)
        if owner is not None:
            set_original(patcher, owner, "forward_oot", make(owner))
    vllm_rope = optional_module("vllm.model_executor.layers.rotary_embedding")
    if vllm_rope is not None:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        set_original(patcher, RotaryEmbeddingBase, "forward", rotary_forward)
        for cls in family_rotary_classes():
            set_original(patcher, cls, "forward", rotary_forward)
    return True


def patch_silu_mul(patcher: Patcher) -> bool:
    from vllm_ascend.ops.activation import AscendSiluAndMul

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if type(self) is not AscendSiluAndMul or x.dtype not in FLOATS:
            return original(AscendSiluAndMul, "forward_oot")(self, x)
        return swiglu(x)

    set_original(patcher, AscendSiluAndMul, "forward_oot", forward_oot)
    return True


# ----------------------------------------------------------------------------------------------
# Linear layers and the lm_head
# ----------------------------------------------------------------------------------------------


def patch_linear(patcher: Patcher) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm_ascend.ops.linear import AscendUnquantizedLinearMethod

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "tp_size", 1) > 1:
            raise NotImplementedError(
                "samepath's vllm-ascend integration runs tensor_parallel_size=1 only: vllm-ascend's row-parallel "
                "all-reduce is not on samepath's split-K invariant (samepath.integrations.vllm does that for vLLM)"
            )
        if not has_dense_weight(layer) or getattr(layer, "precast_fp32_weight", False):
            return original(AscendUnquantizedLinearMethod, "process_weights_after_loading")(self, layer)
        # vLLM's own step only; no FRACTAL_NZ cast: samepath.linear reads the ND weight.
        super(AscendUnquantizedLinearMethod, self).process_weights_after_loading(layer)
        layer.samepath_linear = True
        return None

    def linear_apply(self, layer, x, bias=None):
        if not getattr(layer, "samepath_linear", False) or x.dtype != layer.weight.dtype:
            return original(AscendUnquantizedLinearMethod, "apply")(self, layer, x, bias)
        return linear(x, layer.weight, bias)

    def embedding_apply(self, layer, x, bias=None):
        if not has_dense_weight(layer) or x.dtype != layer.weight.dtype:
            return original(UnquantizedEmbeddingMethod, "apply")(self, layer, x, bias)
        return linear(x, layer.weight, bias)

    set_original(patcher, AscendUnquantizedLinearMethod, "process_weights_after_loading", process_weights_after_loading)
    set_original(patcher, AscendUnquantizedLinearMethod, "apply", linear_apply)
    set_original(patcher, UnquantizedEmbeddingMethod, "apply", embedding_apply)
    return True


# ----------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------


def plain_experts(method: Any, layer: Any) -> bool:
    moe = getattr(method, "moe", None)
    return (
        str(getattr(layer, "activation", "silu")).lower().endswith("silu")
        and not getattr(moe, "has_bias", False)
        and getattr(moe, "is_act_and_mul", True)
        and not getattr(layer, "apply_router_weight_on_input", False)
        and not getattr(method, "dynamic_eplb", False)
        and isinstance(getattr(layer, "w13_weight", None), torch.Tensor)
        and layer.w13_weight.dtype in FLOATS
    )


def check_plain_routing(layer: Any, kwargs: dict[str, Any]) -> None:
    from vllm.distributed import get_tensor_model_parallel_world_size

    kind = getattr(layer, "samepath_parallel", ("plain", 1))[0]
    problems = []
    if kwargs.get("use_grouped_topk"):
        problems.append("grouped top-k")
    if kwargs.get("scoring_func", "softmax") != "softmax":
        problems.append(f"scoring_func={kwargs['scoring_func']!r}")
    if kwargs.get("custom_routing_function") is not None:
        problems.append("a custom routing function")
    if kwargs.get("e_score_correction_bias") is not None:
        problems.append("a score-correction bias")
    if kwargs.get("routed_scaling_factor", 1.0) != 1.0:
        problems.append(f"routed_scaling_factor={kwargs['routed_scaling_factor']}")
    if kwargs.get("global_redundant_expert_num", 0):
        problems.append("redundant experts")
    if (kwargs.get("expert_map") is not None) != (kind == "expert"):
        problems.append("an expert map that differs from the layout read at load")
    if kwargs.get("apply_router_weight_on_input"):
        problems.append("router weights on the input")
    if getattr(layer, "zero_expert_num", 0) or getattr(layer, "n_shared_experts", 0):
        problems.append("zero or shared experts in the routed set")
    if kind == "plain" and get_tensor_model_parallel_world_size() != 1:
        problems.append("experts not laid out for this TP group")
    if problems:
        raise NotImplementedError(
            f"samepath's vllm-ascend MoE does not implement {', '.join(problems)}; "
            "unset SAMEPATH_VLLM to run vllm-ascend's own kernels"
        )


def check_allgather_comm(layer: Any) -> None:
    """A tensor- or expert-parallel layer runs under vllm-ascend's ``ALLGATHER`` MoE communication
    (every rank of the TP group holds every token; samepath's exchange replaces the dispatch and
    combine) and without flash-comm sequence parallelism; anything else is refused by name."""
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX, MoECommType

    comm = getattr(_EXTRA_CTX, "moe_comm_type", None)
    if comm != MoECommType.ALLGATHER or getattr(_EXTRA_CTX, "flash_comm_v1_enabled", False):
        raise NotImplementedError(
            f"samepath's vllm-ascend MoE ({getattr(layer, 'layer_name', '?')}) runs its tensor / expert parallel "
            f"experts under the ALLGATHER MoE communication without flash-comm, not {comm}"
            f"{' with flash-comm v1' if getattr(_EXTRA_CTX, 'flash_comm_v1_enabled', False) else ''}"
        )


def for_the_all_reduce(out: torch.Tensor, rank: int) -> torch.Tensor:
    """What a TP rank hands vllm-ascend's all-reduce (or reduce-scatter) of the routed output when
    every rank already holds the whole layer ``out``: rank 0 ``out``, the others ``-0.0``
    everywhere. ``x + (-0.0) == x`` exactly for every x (``+0.0`` included) and ``-0.0 + -0.0 ==
    -0.0``, so the sum returns rank 0's bits in any order and any accumulation precision: the
    stock collective stays, carrying no arithmetic."""
    return out if rank == 0 else torch.full_like(out, -0.0)


def patch_moe(patcher: Patcher) -> bool:
    from vllm_ascend.ops.fused_moe.fused_moe import AscendUnquantizedFusedMoEMethod

    unquantized_method = moe_method_base(AscendUnquantizedFusedMoEMethod)  # checked by check_compatibility
    from vllm_ascend.ops.fused_moe.moe_comm_method import FusedExpertsResult

    ascend_forward_context = importlib.import_module("vllm_ascend.ascend_forward_context")
    owner = AscendUnquantizedFusedMoEMethod

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not plain_experts(self, layer):
            return original(owner, "process_weights_after_loading")(self, layer)
        # Refuses, at load, a layout samepath cannot reproduce (vllm-ascend's own map: _expert_map).
        layout = moe_parallel_layout(layer, getattr(layer, "_expert_map", None))
        if layout[0] == "expert":
            record_expert_parallel()  # the load gate compares fingerprint(S, expert_parallel=True)
        # What vllm-ascend runs first, then nothing: w13 [E, 2I, H] / w2 [E, H, I] stay as loaded.
        super(unquantized_method, self).process_weights_after_loading(layer)
        layer.samepath_experts = True
        layer.samepath_parallel = layout
        layer.samepath_routing_fp32 = loading_model_routing_fp32()
        return None

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        use_grouped_topk: bool,
        top_k: int,
        router_logits: torch.Tensor,
        renormalize: bool,
        **kwargs: Any,
    ):
        if not getattr(layer, "samepath_experts", False):
            return original(owner, "apply")(
                self, layer, x, use_grouped_topk, top_k, router_logits, renormalize, **kwargs
            )
        check_plain_routing(layer, {"use_grouped_topk": use_grouped_topk, **kwargs})
        weights_fp32 = bool(getattr(layer, "samepath_routing_fp32", False))
        kind, _ = getattr(layer, "samepath_parallel", ("plain", 1))
        if kind == "plain":
            dtype = torch.float32 if weights_fp32 else x.dtype
            index, weights = topk_softmax_routing(router_logits, top_k, bool(renormalize), dtype)
            return FusedExpertsResult(routed_out=experts_forward(x, layer.w13_weight, layer.w2_weight, index, weights))
        from vllm.distributed import get_tensor_model_parallel_rank

        check_allgather_comm(layer)
        out = parallel_moe(layer, kind, x, router_logits, top_k, bool(renormalize), weights_fp32)
        return FusedExpertsResult(routed_out=for_the_all_reduce(out, get_tensor_model_parallel_rank()))

    original_select = ascend_forward_context.select_moe_comm_method

    def select_moe_comm_method(*args, **kwargs):
        # Expert parallelism's MC2 / all-to-all split the tokens across the TP ranks and dispatch
        # them with vllm-ascend's kernels; samepath's exchange needs every token on every rank.
        chosen = original_select(*args, **kwargs)
        return chosen if chosen is None else ascend_forward_context.MoECommType.ALLGATHER

    set_original(patcher, owner, "process_weights_after_loading", process_weights_after_loading)
    set_original(patcher, owner, "apply", apply)
    patcher.set(ascend_forward_context, "select_moe_comm_method", select_moe_comm_method)
    return True


__all__ = [
    "FLOATS",
    "check_allgather_comm",
    "check_plain_routing",
    "for_the_all_reduce",
    "norm_variant",
    "patch_linear",
    "patch_moe",
    "patch_rms_norm",
    "patch_rotary",
    "patch_silu_mul",
    "plain_experts",
]
