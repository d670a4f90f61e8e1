"""vllm-ascend's load-time audit: :func:`ascend_rules` (the :class:`~samepath.audit.ModuleRules` of
the model vllm-ascend builds) and the model-loader hook (the vLLM plugin's, with these rules)."""

from __future__ import annotations

import os
from typing import Any

import torch

from samepath.audit import COVERED, UNCOVERED, ModuleRules, module_entry
from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import optional_module
from samepath.integrations.vllm.env import FINGERPRINT_ENV_VAR
from samepath.integrations.vllm.loader import (
    attention_impl_problems,
    classify_module,
    moe_formula_problem,
    patch_model_loader,
)
from samepath.integrations.vllm_ascend import state
from samepath.integrations.vllm_ascend.attention import check_attention_supported
from samepath.integrations.vllm_ascend.layers import check_plain_routing

#: vLLM linear classes vllm-ascend registers an ``Ascend`` subclass for (``register_ascend_customop``).
ASCEND_LINEAR_NAMES = (
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
)
#: Where vLLM's ``Attention`` layer lives (vLLM 0.23, which vllm-ascend v0.23.0 pairs with; later).
ATTENTION_LAYER_MODULES = ("vllm.attention.layer", "vllm.model_executor.layers.attention.attention")


def classes(module_name: str, *names: str) -> tuple[type, ...]:
    module = optional_module(module_name)
    return tuple(getattr(module, n) for n in names if isinstance(getattr(module, n, None), type))


def ascend_linear_problems(layer: torch.nn.Module) -> list[str]:
    problems = []
    if not getattr(layer, "samepath_linear", False):
        problems.append("weights not processed by samepath (FRACTAL_NZ cast or fp32 precast: vllm-ascend's GEMM)")
    custom_op = getattr(layer, "custom_op", None)
    if custom_op is not None:
        problems.append(f"vllm-ascend's parallel linear op {type(custom_op).__name__}")
    return problems


def ascend_attention_problems(impl: Any) -> list[str]:
    return attention_impl_problems(impl, (type(impl), "forward_impl") in state.ORIGINALS, check_attention_supported)


#: The routing attributes vllm-ascend's MoE layers (``AscendFusedMoE``, ``AscendMoERunner``) pass to
#: ``quant_method.apply``.
ROUTING_ATTRIBUTES = (
    "use_grouped_topk",
    "scoring_func",
    "custom_routing_function",
    "e_score_correction_bias",
    "routed_scaling_factor",
    "expert_map",
    "apply_router_weight_on_input",
)


def ascend_moe_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    layers = classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendFusedMoE")
    runners = classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendMoERunner")
    if type(module) not in layers + runners:
        return None
    # vLLM 0.23: the quant method (and samepath's flags) sit on the AscendFusedMoE layer; later
    # vLLMs: on the runner's routed experts.
    experts = module.routed_experts if type(module) in runners else module
    method_classes = classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendUnquantizedFusedMoEMethod")
    if type(getattr(experts, "quant_method", None)) not in method_classes:
        method = type(getattr(experts, "quant_method", None)).__name__
        return module_entry(name, module, "moe", UNCOVERED, f"{method} experts (not samepath's unquantized MoE)")
    if not getattr(experts, "samepath_experts", False):
        return module_entry(name, module, "moe", UNCOVERED, "experts left on vllm-ascend's grouped matmuls")
    try:
        check_plain_routing(module, {a: getattr(module, a) for a in ROUTING_ATTRIBUTES if hasattr(module, a)})
    except NotImplementedError as exc:
        return module_entry(name, module, "moe", UNCOVERED, str(exc))
    problem = moe_formula_problem(experts, formulas)
    if problem is not None:
        return module_entry(name, module, "moe", UNCOVERED, problem)
    return module_entry(name, module, "moe", COVERED, "samepath.integrations.moe routing and experts")


def ascend_rules():
    """The :class:`samepath.audit.ModuleRules` of the model vllm-ascend builds.

    vLLM's ``CustomOp`` OOT registration makes vLLM's model build vllm-ascend's subclasses, so the
    exact classes are vllm-ascend's: ``AscendRMSNorm``, ``AscendSiluAndMul``,
    ``AscendVocabParallelEmbedding`` / ``AscendParallelLMHead`` (vLLM's ``UnquantizedEmbeddingMethod``),
    ``AscendLogitsProcessor``, the ``Ascend*Linear`` layers with ``AscendUnquantizedLinearMethod``
    (weights processed by samepath, no vllm-ascend parallel ``custom_op``), vLLM's ``Attention``
    with an ``AscendAttentionBackendImpl`` / ``AscendFAImpl`` samepath patched, and
    ``AscendFusedMoE`` (vLLM 0.23) / ``AscendMoERunner`` with ``AscendUnquantizedFusedMoEMethod``.
    Rotary layers use the shared rule (``RotaryEmbeddingBase.forward`` is samepath's; the Ascend
    classes' parameters are read by :func:`samepath.integrations.vllm.vllm_rope`). Everything else
    (``AscendGemmaRMSNorm``, MLA, ``AscendDeepseekScalingRotaryEmbedding``, the 310P classes, vLLM's
    own classes that vllm-ascend does not replace, ...) has no rule and is uncovered."""
    embedding = "vllm_ascend.ops.vocab_parallel_embedding"
    return ModuleRules(
        platform="vllm-ascend integration",
        installed=state.installed,
        rms_norm=classes("vllm_ascend.ops.layernorm", "AscendRMSNorm"),
        silu_mul=classes("vllm_ascend.ops.activation", "AscendSiluAndMul"),
        embedding=classes(embedding, "AscendVocabParallelEmbedding"),
        lm_head=classes(embedding, "AscendParallelLMHead"),
        logits=classes(embedding, "AscendLogitsProcessor"),
        attention=tuple(c for m in ATTENTION_LAYER_MODULES for c in classes(m, "Attention")),
        linear_methods=classes("vllm_ascend.ops.linear", "AscendUnquantizedLinearMethod"),
        linear_classes=frozenset(f"vllm_ascend.ops.linear.Ascend{n}" for n in ASCEND_LINEAR_NAMES),
        linear_problems=ascend_linear_problems,
        attention_problems=ascend_attention_problems,
        moe=ascend_moe_entry,
        classify=classify_module,
    )


def patch_ascend_model_loader(patcher: Patcher) -> bool:
    """vLLM's model loaders (:func:`samepath.integrations.vllm.patch_ascend_model_loader`): refuse the V2
    model runner's config, then audit the loaded model with :func:`ascend_rules` and refuse its
    uncovered modules by name (``SAMEPATH_ALLOW_UNCOVERED`` opts out, recorded in the fingerprint);
    with ``SAMEPATH_EXPECT_FINGERPRINT`` carrying a model part, refuse a model whose formulas this
    side resolves differently from the trainer (:func:`expected_fingerprint`)."""
    return patch_model_loader(
        patcher, side="vllm-ascend", rules=ascend_rules, engine="vllm-ascend", expected=expected_fingerprint
    )


def expected_fingerprint() -> str | None:
    """The trainer's fingerprint the rollout must match (``SAMEPATH_EXPECT_FINGERPRINT``), or ``None``."""
    return os.environ.get(FINGERPRINT_ENV_VAR) or None


__all__ = [
    "ASCEND_LINEAR_NAMES",
    "ATTENTION_LAYER_MODULES",
    "ROUTING_ATTRIBUTES",
    "ascend_attention_problems",
    "ascend_linear_problems",
    "ascend_moe_entry",
    "ascend_rules",
    "classes",
    "expected_fingerprint",
    "patch_ascend_model_loader",
]
