"""vLLM's fused MoE on samepath (:func:`patch_moe`): which expert layers samepath runs
(:func:`plain_experts`, :func:`biased_experts`, their parallel layout :func:`moe_parallel_layout`),
the routing it refuses (:func:`check_plain_routing`), and the runner's apply of each layer kind:
plain / tensor- / expert-parallel top-k softmax (:func:`parallel_moe`), with a shared expert
(:func:`plain_shared_apply`: Qwen3-Next) and GLM-4.5 / DeepSeek-V3's sigmoid grouped top-k
(:func:`grouped_apply`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import (
    biased_moe,
    grouped_moe,
    linear,
    loading_model_moe,
    loading_model_routing_fp32,
    moe,
    optional_module,
)
from samepath.integrations.vllm.env import ENV_VAR
from samepath.integrations.vllm.state import check_tensor_parallel_numerics, record_expert_parallel
from samepath.models.descriptor import SIGMOID_GROUPED_TOPK
from samepath.models.registry import find as find_family


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


def with_shared_experts(runner: Any, shared_experts_input, routed: Callable[[], torch.Tensor], **kwargs):
    """The shared experts (vLLM's own module: samepath's linear and SiLU·mul; Qwen3-Next's sigmoid gate),
    then ``routed()`` — returned as ``(shared_output, routed_output)``, which ``MoERunner`` adds in the
    dtype, as Hugging Face's ``Qwen3NextSparseMoeBlock`` / ``Glm4MoeMoE`` do (``shared_output``: None
    for a layer without shared experts)."""
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    runner._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
    out = routed()
    if runner._shared_experts is None:
        return None, out
    if kwargs.get("shared_experts_overlapping", False):
        runner._shared_experts.wait()
    return runner._shared_experts.output, out


def plain_shared_apply(runner: Any, hidden_states, router_logits, shared_experts_input, top, weights_fp32, **kwargs):
    """``MoERunner._apply_quant_method`` of a softmax top-k layer with a shared expert (Qwen3-Next):
    :func:`with_shared_experts` around :func:`~samepath.integrations.vllm.common.moe`."""
    experts = runner.routed_experts

    def routed():
        return moe(hidden_states, router_logits, experts.w13_weight, experts.w2_weight, *top, weights_fp32)

    return with_shared_experts(runner, shared_experts_input, routed, **kwargs)


def grouped_apply(runner: Any, hidden_states, router_logits, shared_experts_input, **kwargs):
    """``MoERunner._apply_quant_method`` of a GLM-4.5 / DeepSeek-V3 layer: :func:`with_shared_experts`
    around :func:`~samepath.integrations.vllm.common.grouped_moe` on fp32 router logits.

    Hugging Face's router takes the logits of the fp32 input and gate weight: logits in another dtype
    are taken again in fp32 from the runner's ``gate``; without one, refused by name
    (``NotImplementedError``), never routed on the narrower logits."""
    router, experts = runner.router, runner.routed_experts
    gate = getattr(runner, "gate", None)
    if router_logits.dtype != torch.float32 and gate is None:
        raise NotImplementedError(
            f"samepath's vLLM MoE ({getattr(experts, 'layer_name', type(runner).__name__)}): {router_logits.dtype} "
            "router logits and no gate on the MoE runner to take them again in fp32 (Hugging Face's grouped "
            f"router runs on fp32 logits); unset {ENV_VAR} to run vLLM's own kernel"
        )
    if router_logits.dtype != torch.float32:
        # DeepSeek-V3's gate keeps the checkpoint dtype (GLM-4.5's is fp32): taken again here, in fp32.
        router_logits = linear(hidden_states.to(torch.float32), gate.weight.to(torch.float32))
    bias = router.e_score_correction_bias

    def routed():
        return grouped_moe(
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

    return with_shared_experts(runner, shared_experts_input, routed, **kwargs)


__all__ = [
    "GROUPED_ROUTERS",
    "PLAIN_ROUTERS",
    "biased_experts",
    "check_plain_routing",
    "grouped_apply",
    "loading_model_shared_experts",
    "loading_model_swiglu",
    "moe_parallel_layout",
    "parallel_moe",
    "patch_moe",
    "plain_experts",
    "plain_shared_apply",
    "routed_scaling_factor",
    "with_shared_experts",
]
