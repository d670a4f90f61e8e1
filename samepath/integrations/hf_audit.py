"""The Hugging Face side's coverage audit: :func:`audit_hf_model`, the rules of the patched model classes.

``patch_all(model)`` runs it and refuses (:func:`samepath.audit.enforce`) a model with a module
samepath does not cover; the report, the shared rules and the refusal live in :mod:`samepath.audit`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from samepath.audit.report import (
    COVERED,
    NEUTRAL,
    UNCOVERED,
    AuditEntry,
    AuditReport,
    embedding_scale_entry,
    generic_entry,
    inside,
    module_entry,
)
from samepath.integrations import hf
from samepath.integrations.hf_mla import mla_attention_forward
from samepath.integrations.hf_softcap import is_softcapped_forward
from samepath.kernels.matmul import batch_invariant_enabled
from samepath.models.formulas import UnsupportedModelError, model_formulas
from samepath.models.registry import find


def audit_hf_model(model: torch.nn.Module) -> AuditReport:
    """Classify every module of a Hugging Face causal LM as samepath would run it now (call after
    :func:`samepath.integrations.patch_all`; before, nothing is covered)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    report = AuditReport("hf", model_type)
    try:
        model_formulas(config)
    except UnsupportedModelError as exc:
        report.problems.append(str(exc))
    family = hf.MODEL_TYPES.get(model_type)
    modeling = sys.modules.get(family[0]) if family else None
    prefix = family[1] if family else None

    def family_class(module: torch.nn.Module, suffix: str) -> bool:
        return modeling is not None and type(module) is getattr(modeling, f"{prefix}{suffix}", None)

    found = find(model_type)
    dense_mlp = found is None or found.dense_mlp
    attention_fn = hf_attention_function(config)
    experts_fn = hf_experts_function(config)
    rotary_patched = (
        modeling is not None and getattr(modeling, "apply_rotary_pos_emb", None) is hf.samepath_apply_rotary_pos_emb
    )
    whole: list[str] = []  # modules whose forward samepath replaced entirely
    for name, module in model.named_modules():
        parent = inside(name, whole)
        if parent is not None:
            report.entries.append(module_entry(name, module, "inside", COVERED, f"computed by {parent or '<root>'}"))
            continue
        entry = generic_entry(name, module) or hf_entry(
            name, module, family_class, attention_fn, experts_fn, rotary_patched, batch_invariant_enabled(), dense_mlp
        )
        if entry.status == COVERED and entry.op in ("rms_norm", "silu_mul", "gelu_tanh_mul", "experts"):
            whole.append(name)
        report.entries.append(entry)
    return report


def hf_attention_function(config: Any) -> Any:
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return None
    return AttentionInterface._global_mapping.get(getattr(config, "_attn_implementation", None))


def hf_experts_function(config: Any) -> Any:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface._global_mapping.get(getattr(config, "_experts_implementation", None))


def hf_entry(
    name: str,
    module: torch.nn.Module,
    family_class,
    attention_fn,
    experts_fn,
    rotary_patched: bool,
    matmul_on: bool,
    dense_mlp: bool = True,
) -> AuditEntry:
    kind = type(module)
    if kind is torch.nn.Linear:
        if matmul_on:
            return module_entry(
                name, module, "linear", COVERED, "torch's mm/addmm on samepath's batch-invariant matmul"
            )
        return module_entry(name, module, "linear", UNCOVERED, "samepath.batch_invariant() is not in effect")
    if kind is torch.nn.Embedding:
        return module_entry(name, module, "embedding", NEUTRAL, "a row lookup")
    if family_class(module, "RMSNorm"):
        mode = next((m for m, f in hf.RMS_NORM_FORWARDS.items() if kind.forward is f), None)
        detail = "stock" if mode is None else f"samepath.rms_norm ({mode})"
        return module_entry(name, module, "rms_norm", UNCOVERED if mode is None else COVERED, detail)
    if family_class(module, "MLP") and not dense_mlp:  # GPT-OSS: the block of a router and experts
        return module_entry(name, module, "structure", NEUTRAL, "router, then experts; reshapes")
    if family_class(module, "MLP"):
        op = hf.MLP_OPS.get(kind.forward)
        if op is None:  # stock: the op the family computes
            gelu = getattr(getattr(module, "config", None), "model_type", None) in hf.GELU_TANH_MLP
            return module_entry(name, module, "gelu_tanh_mul" if gelu else "silu_mul", UNCOVERED, "stock")
        return module_entry(name, module, op, COVERED, f"samepath.{op}")
    if family_class(module, "TextScaledWordEmbedding"):
        return embedding_scale_entry(name, module, module.embed_scale, module.weight.dtype, module.embedding_dim)
    if family_class(module, "RotaryEmbedding"):
        ok = kind.forward is hf.rotary_embedding_forward
        detail = "samepath.rotary_cos_sin (the vLLM plugin's function)" if ok else "stock cos/sin"
        return module_entry(name, module, "rotary", COVERED if ok else UNCOVERED, detail)
    if family_class(module, "Attention"):
        problems = []
        if attention_fn is not hf.attention_forward:
            problems.append("the model's attention implementation is not samepath's")
        if not rotary_patched:
            problems.append("apply_rotary_pos_emb is stock")
        mla = hasattr(module, "kv_b_proj")  # DeepSeek-V3's multi-head latent attention
        if mla and kind.forward is not mla_attention_forward:
            problems.append("the multi-head latent attention forward is stock (decompressed K/V)")
        if problems:
            return module_entry(name, module, "attention", UNCOVERED, "; ".join(problems))
        if mla:
            detail = "samepath.kernels.mla absorbed form: batched matmul, varlen/packed attention, apply_rotary"
            return module_entry(name, module, "attention", COVERED, detail)
        return module_entry(
            name, module, "attention", COVERED, "samepath varlen/packed attention, samepath.apply_rotary"
        )
    if family_class(module, "Experts"):
        if experts_fn is hf.samepath_experts_forward:
            return module_entry(name, module, "experts", COVERED, "samepath.integrations.moe.experts_forward")
        return module_entry(name, module, "experts", UNCOVERED, "the model's experts implementation is not samepath's")
    if family_class(module, "TopkRouter"):  # a router samepath replaces (GLM-4.5's sigmoid grouped top-k)
        if kind.forward in hf.ROUTER_FORWARDS.values():
            detail = "samepath.kernels.moe_routing (the vLLM plugin's function)"
            return module_entry(name, module, "moe_routing", COVERED, detail)
        return module_entry(name, module, "moe_routing", UNCOVERED, "stock router")
    if family_class(module, "TopKRouter") and hasattr(module, "bias"):  # GPT-OSS: top-k of the biased logits
        if kind.forward is hf.biased_topk_router_forward:
            detail = "samepath.integrations.moe.topk_softmax_biased_routing (the vLLM plugin's router)"
            return module_entry(name, module, "moe_routing", COVERED, detail)
        return module_entry(name, module, "moe_routing", UNCOVERED, "stock router (softmax in the model dtype)")
    if family_class(module, "TopKRouter"):
        detail = "Hugging Face's fp32 softmax top-k: the router the vLLM plugin runs (samepath.integrations.moe)"
        return module_entry(name, module, "moe_routing", COVERED, detail)
    if family_class(module, "ForCausalLM") and getattr(module.config, "final_logit_softcapping", None) is not None:
        if is_softcapped_forward(kind.forward):
            return module_entry(name, module, "logits", COVERED, "samepath.kernels.softcap.softcap_logits")
        return module_entry(name, module, "logits", UNCOVERED, "final logit soft-capping in torch (stock)")
    for suffix in ("ForCausalLM", "Model", "TextModel", "DecoderLayer", "SparseMoeBlock", "MoE"):
        if family_class(module, suffix):
            return module_entry(name, module, "structure", NEUTRAL, "residual adds in the model dtype, reshapes")
    return module_entry(name, module, "unknown", UNCOVERED, "samepath has no rule for this module class")


__all__ = ["audit_hf_model", "hf_attention_function", "hf_entry", "hf_experts_function"]
