"""The audit of a model an inference engine built: vLLM's, or vllm-ascend's.

:func:`audit_vllm_model` walks the model vLLM built (after its weights are processed) and
classifies each module: the structure and block classes of the families samepath knows
(:data:`VLLM_STRUCTURE`, :data:`VLLM_ATTENTION_MLP`) here, every other module by the platform's
:class:`ModuleRules`, which the integration supplies (the vLLM plugin's
:func:`samepath.integrations.vllm.vllm_rules`, vllm-ascend's
:func:`samepath.integrations.vllm_ascend.ascend_rules`) together with its ``classify`` function.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from samepath.audit.report import (
    COVERED,
    NEUTRAL,
    UNCOVERED,
    UNRESOLVED_LAYER_ROPE,
    AuditReport,
    embedding_scale_entry,
    generic_entry,
    inside,
    module_entry,
)
from samepath.kernels.rotary import rotary_inv_freq, rotary_position_limit
from samepath.models.formulas import UnsupportedModelError, layer_types, model_formulas, rope_formulas
from samepath.models.registry import family_view, find


@dataclasses.dataclass(frozen=True)
class ModuleRules:
    """Which module classes count as each op on one platform, for its ``classify`` function (the
    vLLM integrations': :func:`samepath.integrations.vllm.classify_module`).

    Exact classes only (a subclass may compute something else). ``installed`` says whether the
    platform's samepath integration is in effect; ``linear_methods`` are the ``quant_method``
    classes whose ``apply`` samepath replaced, ``linear_classes`` the layer classes (qualified
    names) whose forward only calls it, ``linear_problems`` what else a linear layer needs;
    ``attention_problems`` why an ``Attention`` layer's impl is not samepath's; ``moe`` the entry of
    an MoE module, or ``None`` when ``module`` is not one; ``gemma_rms_norm`` the (1 + weight) norm
    classes and ``gelu_tanh_mul`` the GELU·mul classes samepath patched (none on a platform whose
    integration does not patch them: refused there). ``classify(name, module, formulas, hf_rope,
    rules)`` is the platform's classification of a module the shared rules leave open."""

    platform: str
    installed: Callable[[], bool]
    rms_norm: tuple[type, ...]
    silu_mul: tuple[type, ...]
    embedding: tuple[type, ...]
    lm_head: tuple[type, ...]
    logits: tuple[type, ...]
    attention: tuple[type, ...]
    linear_methods: tuple[type, ...]
    linear_classes: frozenset[str]
    linear_problems: Callable[[torch.nn.Module], list[str]]
    attention_problems: Callable[[Any], list[str]]
    moe: Callable[[str, torch.nn.Module, dict | None], Any]
    classify: Callable[..., Any]
    gemma_rms_norm: tuple[type, ...] = ()
    gelu_tanh_mul: tuple[type, ...] = ()


#: model_type -> (vLLM models module, class names whose own code is structure only); a name
#: ``"module:Class"`` is looked up in that other module. From each family's descriptor
#: (:mod:`samepath.models`), read at each use, as :data:`VLLM_ATTENTION_MLP`.
VLLM_STRUCTURE: Mapping[str, tuple[str, tuple[str, ...]]] = family_view(
    lambda family: (family.vllm_module, family.vllm_structure)
)

#: model_type -> (module, attention class, MLP classes) in vLLM: the attention module's own code
#: is q/k/v split, q/k norms, rotary, attention, o_proj; the MLP's gate_up, SiLU·mul (Gemma: GELU-tanh·mul), down.
VLLM_ATTENTION_MLP: Mapping[str, tuple[str, str, tuple[str, ...]]] = family_view(
    lambda family: (family.vllm_module, family.vllm_attention, family.vllm_mlp)
)


def named_classes(module_name: str, names: Sequence[str]) -> tuple[type, ...]:
    found = []
    for name in names:
        where, _, cls = name.rpartition(":")
        try:
            module = importlib.import_module(where or module_name)
        except ImportError:
            continue
        if getattr(module, cls, None) is not None:
            found.append(getattr(module, cls))
    return tuple(found)


def audit_vllm_model(model: torch.nn.Module, hf_config: Any, rules: ModuleRules) -> AuditReport:
    """Classify every module of a model vLLM built (after its weights are processed) as samepath
    runs it; ``hf_config`` is vLLM's ``model_config.hf_config``, ``rules`` the platform's
    :class:`ModuleRules` (the vLLM plugin's :func:`samepath.integrations.vllm.vllm_rules`; vllm-ascend's
    :func:`samepath.integrations.vllm_ascend.ascend_rules`).

    Besides the per-module rules, each rotary layer's formula (``vllm_rope`` of the vLLM integration)
    must give the same ``inv_freq``, attention scaling and position limit as the Hugging Face
    side's resolution of ``hf_config``, and each RMSNorm the config's epsilon.
    """
    model_type = getattr(hf_config, "model_type", None)
    report = AuditReport("vllm", model_type)
    formulas = None
    hf_ropes: dict[str | None, tuple] = {}
    types = None
    try:
        formulas = model_formulas(hf_config)
        types = layer_types(hf_config)
        for key, rope in rope_formulas(hf_config).items():
            inv_freq = rotary_inv_freq(rope.rotary_dim, rope.base, rope.scaling)
            hf_ropes[key] = (*inv_freq, rotary_position_limit(rope.scaling))
    except UnsupportedModelError as exc:
        report.problems.append(str(exc))

    def hf_rope_of(name: str) -> tuple | None:
        """The Hugging Face rope of the layer ``name`` belongs to (per layer type: Gemma 3);
        :data:`UNRESOLVED_LAYER_ROPE` when the config has per-layer-type ropes and ``name`` is in
        no layer they cover (a rotary module there is refused, never passed unchecked)."""
        if types is None:
            return hf_ropes.get(None)
        index = layer_index(name)
        if index is None or index >= len(types) or types[index] not in hf_ropes:
            return UNRESOLVED_LAYER_ROPE if hf_ropes else None
        return hf_ropes[types[index]]

    structure = named_classes(*VLLM_STRUCTURE[model_type]) if model_type in VLLM_STRUCTURE else ()
    family = find(model_type)
    scales_embeddings = family is not None and family.embedding_scale  # vLLM's ``normalizer`` (Gemma)
    attention_mlp = VLLM_ATTENTION_MLP.get(model_type)
    attention_cls = named_classes(attention_mlp[0], (attention_mlp[1],)) if attention_mlp else ()
    mlp_cls = named_classes(attention_mlp[0], attention_mlp[2]) if attention_mlp else ()
    whole: list[str] = []
    for name, module in model.named_modules():
        parent = inside(name, whole)
        if parent is not None:
            report.entries.append(module_entry(name, module, "inside", COVERED, f"computed by {parent or '<root>'}"))
            continue
        entry = generic_entry(name, module)
        if entry is None:
            kind = type(module)
            if kind in structure and hasattr(module, "normalizer") and not scales_embeddings:
                detail = "multiplies its embeddings by a normalizer its family's descriptor does not have"
                entry = module_entry(name, module, "embedding_scale", UNCOVERED, detail)
            elif kind in structure and hasattr(module, "normalizer"):  # Gemma3Model: embed * normalizer
                entry = embedding_scale_entry(
                    name,
                    module,
                    module.normalizer,
                    module.embed_tokens.weight.dtype,
                    hf_config.hidden_size,
                    multiplied_as_stored=True,
                )
            elif kind in structure:
                entry = module_entry(name, module, "structure", NEUTRAL, "residual adds in the model dtype, reshapes")
            elif kind in attention_cls:
                entry = module_entry(
                    name, module, "attention_block", NEUTRAL, "q/k/v split, norms, rotary, attention, o_proj"
                )
            elif kind in mlp_cls:
                entry = module_entry(name, module, "mlp_block", NEUTRAL, "gate_up, activation·mul, down")
            else:
                entry = rules.classify(name, module, formulas, hf_rope_of(name), rules)
        covering = ("rotary", "moe", "rms_norm", "silu_mul", "gelu_tanh_mul", "linear", "lm_head")
        if entry.status == COVERED and entry.op in covering:
            whole.append(name)
        report.entries.append(entry)
    return report


def layer_index(name: str) -> int | None:
    """``i`` of the first ``layers.<i>`` in a qualified module name."""
    parts = name.split(".")
    for part, following in itertools.pairwise(parts):
        if part == "layers" and following.isdigit():
            return int(following)
    return None


__all__ = ["VLLM_ATTENTION_MLP", "VLLM_STRUCTURE", "ModuleRules", "audit_vllm_model", "layer_index", "named_classes"]
