"""Coverage audit: every module on the forward path is on samepath's contract, or the run is refused.

samepath's promise is bit equality between the rollout and the trainer; a module that samepath
does not cover runs stock on one side and silently breaks it. The audit walks a model — the Hugging
Face trainer's (:func:`audit_hf_model`, run by ``patch_all(model)``) or the model vLLM built
(:func:`audit_vllm_model`, run by the vLLM and vllm-ascend integrations at model load) — and classifies every module:

* ``covered`` — computed by samepath's kernels or by a formula both sides share (RMSNorm, SiLU·mul,
  rotary cos/sin and rotation, attention, linear layers through the batch-invariant matmul, MoE
  routing and experts), or inside such a module;
* ``neutral`` — bits that cannot depend on the batch or the engine: embedding lookups, containers,
  the residual adds and reshapes of the model classes samepath knows, dropout in eval mode;
* ``uncovered`` — anything else, with the reason.

The classification is an allow-list: a module class samepath has no rule for is uncovered, so a
new layer type fails closed. :func:`enforce` turns uncovered entries into
:class:`UncoveredOpsError` (listing module class, op and qualified name) unless the user opts out
with ``allow_uncovered=...`` or ``SAMEPATH_ALLOW_UNCOVERED=...`` (``all``, or comma-separated
module class names / qualified names / ops); an opt-out warns once and is recorded in
:func:`samepath.fingerprint`, so the other side sees it.

The model-level formulas come from :func:`samepath.integrations.formulas.model_formulas` on both
sides: a model type covered on one side only (e.g. ``granite``, ``gemma2``) is refused on both.

``samepath audit [--model DIR] [--json OUT]`` prints the Hugging Face side's report.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from samepath.models.formulas import UnsupportedModelError, model_formulas

#: Environment variable of the opt-out: ``all`` or comma-separated names (module class, qualified
#: module name or op).
ALLOW_ENV_VAR = "SAMEPATH_ALLOW_UNCOVERED"

COVERED, NEUTRAL, UNCOVERED = "covered", "neutral", "uncovered"
#: What :func:`audit_vllm_model` hands a rotary rule for a module in no layer of a config with
#: per-layer-type ropes: the rope it must equal is unknown, so the module is refused.
UNRESOLVED_LAYER_ROPE: tuple = ("unresolved layer rope",)


@dataclass(frozen=True)
class AuditEntry:
    """One module: ``name`` (qualified, ``""`` for the root), ``module_class`` (its class's
    ``module.QualName``), ``op`` (what it computes), ``status`` and ``detail`` (why)."""

    name: str
    module_class: str
    op: str
    status: str
    detail: str


@dataclass
class AuditReport:
    """Every module of one side's model, classified. ``problems`` are model-level refusals (an
    unsupported model type or formula); they count as uncovered."""

    side: str
    model_type: str | None
    entries: list[AuditEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def uncovered(self) -> list[AuditEntry]:
        return [e for e in self.entries if e.status == UNCOVERED]

    @property
    def fully_covered(self) -> bool:
        return not self.uncovered and not self.problems

    def counts(self) -> dict[str, int]:
        return {s: sum(e.status == s for e in self.entries) for s in (COVERED, NEUTRAL, UNCOVERED)}

    def describe_uncovered(self) -> list[str]:
        lines = [f"model: {p}" for p in self.problems]
        lines += [f"{e.name or '<root>'}: {e.module_class} [{e.op}] — {e.detail}" for e in self.uncovered]
        return lines

    def format(self) -> str:
        counts = self.counts()
        head = (
            f"samepath coverage audit ({self.side}, model_type={self.model_type}): {counts[COVERED]} covered, "
            f"{counts[NEUTRAL]} neutral, {counts[UNCOVERED]} uncovered modules"
        )
        lines = [head]
        width = max((len(e.name or "<root>") for e in self.entries), default=8)
        for e in self.entries:
            lines.append(f"  {e.status:<9} {e.name or '<root>':<{width}}  {e.module_class.rsplit('.', 1)[-1]} [{e.op}]")
        if self.fully_covered:
            lines.append("full coverage: every module is on samepath's contract")
        else:
            lines.append("NOT covered:")
            lines += [f"  {line}" for line in self.describe_uncovered()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "model_type": self.model_type,
            "fully_covered": self.fully_covered,
            "counts": self.counts(),
            "problems": list(self.problems),
            "entries": [asdict(e) for e in self.entries],
        }


class UncoveredOpsError(RuntimeError):
    """The model has modules samepath does not cover; raised before the run rather than after it."""

    def __init__(self, report: AuditReport) -> None:
        self.report = report
        listing = "\n  ".join(report.describe_uncovered())
        super().__init__(
            f"samepath refuses this {report.side} model (model_type={report.model_type!r}): these parts are not on "
            f"samepath's contract, so the rollout and the trainer would not be bit-identical:\n  {listing}\n"
            f"To run anyway, opt out explicitly: {ALLOW_ENV_VAR}=<names or 'all'> (or allow_uncovered=... in "
            "patch_all); the opt-out is recorded in samepath.fingerprint()."
        )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _entry(name: str, module: torch.nn.Module, op: str, status: str, detail: str) -> AuditEntry:
    return AuditEntry(name, _qualname(type(module)), op, status, detail)


def _inside(name: str, parents: Iterable[str]) -> str | None:
    for parent in parents:
        if parent == "" or name.startswith(parent + "."):
            return parent
    return None


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _generic(name: str, module: torch.nn.Module) -> AuditEntry | None:
    """Rules shared by both sides (exact classes only: a subclass may compute something else)."""
    kind = type(module)
    if kind in _CONTAINERS:
        return _entry(name, module, "container", NEUTRAL, "holds modules, computes nothing")
    if kind is torch.nn.Identity:
        return _entry(name, module, "identity", NEUTRAL, "returns its input")
    if kind is torch.nn.Dropout:
        if module.p == 0 or not module.training:
            return _entry(name, module, "dropout", NEUTRAL, "p = 0 or eval mode: the identity")
        return _entry(name, module, "dropout", UNCOVERED, f"dropout p={module.p} in train mode")
    return None


# ----------------------------------------------------------------------------------------------
# Hugging Face
# ----------------------------------------------------------------------------------------------


def audit_hf_model(model: torch.nn.Module) -> AuditReport:
    """Classify every module of a Hugging Face causal LM as samepath would run it now (call after
    :func:`samepath.integrations.patch_all`; before, nothing is covered)."""
    from samepath.integrations import hf
    from samepath.kernels.matmul import batch_invariant_enabled

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

    attention_fn = _hf_attention_function(config)
    experts_fn = _hf_experts_function(config)
    rotary_patched = (
        modeling is not None and getattr(modeling, "apply_rotary_pos_emb", None) is hf._apply_rotary_pos_emb
    )
    whole: list[str] = []  # modules whose forward samepath replaced entirely
    for name, module in model.named_modules():
        parent = _inside(name, whole)
        if parent is not None:
            report.entries.append(_entry(name, module, "inside", COVERED, f"computed by {parent or '<root>'}"))
            continue
        entry = _generic(name, module) or _hf_entry(
            name, module, family_class, attention_fn, experts_fn, rotary_patched, batch_invariant_enabled()
        )
        if entry.status == COVERED and entry.op in ("rms_norm", "silu_mul", "gelu_tanh_mul", "experts"):
            whole.append(name)
        report.entries.append(entry)
    return report


def embedding_scale_entry(
    name: str,
    module: torch.nn.Module,
    scale: torch.Tensor,
    dtype: torch.dtype,
    hidden_size: int,
    *,
    multiplied_as_stored: bool = False,
) -> AuditEntry:
    """A scaled embedding (Gemma 3; ``module`` the module that multiplies): neutral while the factor
    it multiplies by, in the model dtype, is :func:`~samepath.integrations.formulas.sqrt_hidden_scale`
    rounded to that dtype, the factor both sides use: a lookup,
    then one dtype multiply. ``multiplied_as_stored``: the module multiplies by ``scale`` without
    casting it (vLLM's ``normalizer``), so ``scale`` must itself be in ``dtype`` (an fp32 factor
    would multiply unrounded)."""
    from samepath.models.formulas import sqrt_hidden_scale

    want = torch.tensor(sqrt_hidden_scale(hidden_size), dtype=torch.float32).to(dtype)
    if multiplied_as_stored and scale.dtype != dtype:
        detail = f"embedding scale stored in {scale.dtype}, multiplied unrounded into {dtype} activations"
        return _entry(name, module, "embedding", UNCOVERED, detail)
    got = scale.detach().to(device="cpu").to(dtype)
    if got.numel() != 1 or not torch.equal(got.reshape(()), want):
        return _entry(name, module, "embedding", UNCOVERED, f"embedding scale {got.tolist()} is not {want.item()}")
    return _entry(name, module, "embedding", NEUTRAL, f"a row lookup times {want.item()} in {dtype} (one rounding)")


def _hf_attention_function(config: Any) -> Any:
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return None
    return AttentionInterface._global_mapping.get(getattr(config, "_attn_implementation", None))


def _hf_experts_function(config: Any) -> Any:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface._global_mapping.get(getattr(config, "_experts_implementation", None))


def _hf_entry(
    name: str,
    module: torch.nn.Module,
    family_class,
    attention_fn,
    experts_fn,
    rotary_patched: bool,
    matmul_on: bool,
) -> AuditEntry:
    from samepath.integrations import hf

    kind = type(module)
    if kind is torch.nn.Linear:
        if matmul_on:
            return _entry(name, module, "linear", COVERED, "torch's mm/addmm on samepath's batch-invariant matmul")
        return _entry(name, module, "linear", UNCOVERED, "samepath.batch_invariant() is not in effect")
    if kind is torch.nn.Embedding:
        return _entry(name, module, "embedding", NEUTRAL, "a row lookup")
    if family_class(module, "RMSNorm"):
        mode = next((m for m, f in hf.RMS_NORM_FORWARDS.items() if kind.forward is f), None)
        detail = "stock" if mode is None else f"samepath.rms_norm ({mode})"
        return _entry(name, module, "rms_norm", UNCOVERED if mode is None else COVERED, detail)
    if family_class(module, "MLP"):
        op = hf.MLP_OPS.get(kind.forward)
        if op is None:  # stock: the op the family computes
            gelu = getattr(getattr(module, "config", None), "model_type", None) in hf.GELU_TANH_MLP
            return _entry(name, module, "gelu_tanh_mul" if gelu else "silu_mul", UNCOVERED, "stock")
        return _entry(name, module, op, COVERED, f"samepath.{op}")
    if family_class(module, "TextScaledWordEmbedding"):
        return embedding_scale_entry(name, module, module.embed_scale, module.weight.dtype, module.embedding_dim)
    if family_class(module, "RotaryEmbedding"):
        ok = kind.forward is hf._rotary_embedding_forward
        detail = "samepath.rotary_cos_sin (the vLLM plugin's function)" if ok else "stock cos/sin"
        return _entry(name, module, "rotary", COVERED if ok else UNCOVERED, detail)
    if family_class(module, "Attention"):
        problems = []
        if attention_fn is not hf.attention_forward:
            problems.append("the model's attention implementation is not samepath's")
        if not rotary_patched:
            problems.append("apply_rotary_pos_emb is stock")
        if problems:
            return _entry(name, module, "attention", UNCOVERED, "; ".join(problems))
        return _entry(name, module, "attention", COVERED, "samepath varlen/packed attention, samepath.apply_rotary")
    if family_class(module, "Experts"):
        if experts_fn is hf.samepath_experts_forward:
            return _entry(name, module, "experts", COVERED, "samepath.integrations.moe.experts_forward")
        return _entry(name, module, "experts", UNCOVERED, "the model's experts implementation is not samepath's")
    if family_class(module, "TopKRouter"):
        detail = "Hugging Face's fp32 softmax top-k: the router the vLLM plugin runs (samepath.integrations.moe)"
        return _entry(name, module, "moe_routing", COVERED, detail)
    for suffix in ("ForCausalLM", "Model", "TextModel", "DecoderLayer", "SparseMoeBlock"):
        if family_class(module, suffix):
            return _entry(name, module, "structure", NEUTRAL, "residual adds in the model dtype, reshapes")
    return _entry(name, module, "unknown", UNCOVERED, "samepath has no rule for this module class")


# ----------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------

#: model_type -> (vLLM models module, class names whose own code is structure only); a name
#: ``"module:Class"`` is looked up in that other module.
VLLM_STRUCTURE: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": ("vllm.model_executor.models.llama", ("LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer")),
    "qwen2": ("vllm.model_executor.models.qwen2", ("Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer")),
    "qwen3": ("vllm.model_executor.models.qwen3", ("Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer")),
    "qwen3_moe": (
        "vllm.model_executor.models.qwen3_moe",
        ("Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeSparseMoeBlock"),
    ),
    "mistral": ("vllm.model_executor.models.mistral", ("MistralForCausalLM", "MistralModel", "MistralDecoderLayer")),
    # vLLM's Phi3ForCausalLM is a LlamaForCausalLM (fused qkv / gate_up weights loaded into Llama's modules).
    "phi3": (
        "vllm.model_executor.models.llama",
        ("LlamaModel", "LlamaDecoderLayer", "vllm.model_executor.models.phi3:Phi3ForCausalLM"),
    ),
    "mixtral": (
        "vllm.model_executor.models.mixtral",
        ("MixtralForCausalLM", "MixtralModel", "MixtralDecoderLayer", "MixtralMoE"),
    ),
    # Gemma3Model's own code also scales the embeddings (its ``normalizer``: checked separately).
    "gemma3_text": ("vllm.model_executor.models.gemma3", ("Gemma3ForCausalLM", "Gemma3Model", "Gemma3DecoderLayer")),
}

#: model_type -> (module, attention class, MLP classes) in vLLM: the attention module's own code
#: is q/k/v split, q/k norms, rotary, attention, o_proj; the MLP's gate_up, SiLU·mul (Gemma: GELU-tanh·mul), down.
VLLM_ATTENTION_MLP: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama": ("vllm.model_executor.models.llama", "LlamaAttention", ("LlamaMLP",)),
    "qwen2": ("vllm.model_executor.models.qwen2", "Qwen2Attention", ("Qwen2MLP",)),
    "qwen3": ("vllm.model_executor.models.qwen3", "Qwen3Attention", ("Qwen3MLP",)),  # qwen2.Qwen2MLP there
    "qwen3_moe": ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeAttention", ("Qwen3MoeMLP",)),
    # MistralAttention: LlamaAttention's forward plus llama_4_scaling, which the formulas refuse.
    "mistral": (
        "vllm.model_executor.models.mistral",
        "MistralAttention",
        ("vllm.model_executor.models.llama:LlamaMLP",),
    ),
    "phi3": ("vllm.model_executor.models.llama", "LlamaAttention", ("LlamaMLP",)),
    "mixtral": ("vllm.model_executor.models.mixtral", "MixtralAttention", ()),
    # Gemma3Attention: q/k norms (GemmaRMSNorm) on the heads, the rope of its layer type, its window.
    "gemma3_text": ("vllm.model_executor.models.gemma3", "Gemma3Attention", ("Gemma3MLP",)),
}


def _named_classes(module_name: str, names: Sequence[str]) -> tuple[type, ...]:
    import importlib

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


def audit_vllm_model(model: torch.nn.Module, hf_config: Any, rules: Any = None) -> AuditReport:
    """Classify every module of a model vLLM built (after its weights are processed) as samepath
    runs it; ``hf_config`` is vLLM's ``model_config.hf_config``, ``rules`` the platform's
    :class:`samepath.integrations.vllm.ModuleRules` (default: the vLLM plugin's; vllm-ascend's is
    :func:`samepath.integrations.vllm_ascend.ascend_rules`).

    Besides the per-module rules, each rotary layer's formula (:func:`samepath.integrations.vllm.vllm_rope`)
    must give the same ``inv_freq``, attention scaling and position limit as the Hugging Face
    side's resolution of ``hf_config``, and each RMSNorm the config's epsilon.
    """
    from samepath.integrations import vllm as plugin
    from samepath.kernels.rotary import rotary_inv_freq, rotary_position_limit
    from samepath.models.formulas import layer_types, rope_formulas

    rules = rules or plugin.vllm_rules()
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
        index = _layer_index(name)
        if index is None or index >= len(types) or types[index] not in hf_ropes:
            return UNRESOLVED_LAYER_ROPE if hf_ropes else None
        return hf_ropes[types[index]]

    structure = _named_classes(*VLLM_STRUCTURE[model_type]) if model_type in VLLM_STRUCTURE else ()
    attention_mlp = VLLM_ATTENTION_MLP.get(model_type)
    attention_cls = _named_classes(attention_mlp[0], (attention_mlp[1],)) if attention_mlp else ()
    mlp_cls = _named_classes(attention_mlp[0], attention_mlp[2]) if attention_mlp else ()
    whole: list[str] = []
    for name, module in model.named_modules():
        parent = _inside(name, whole)
        if parent is not None:
            report.entries.append(_entry(name, module, "inside", COVERED, f"computed by {parent or '<root>'}"))
            continue
        entry = _generic(name, module)
        if entry is None:
            kind = type(module)
            if kind in structure and hasattr(module, "normalizer"):  # Gemma3Model: embed * normalizer
                entry = embedding_scale_entry(
                    name,
                    module,
                    module.normalizer,
                    module.embed_tokens.weight.dtype,
                    hf_config.hidden_size,
                    multiplied_as_stored=True,
                )
            elif kind in structure:
                entry = _entry(name, module, "structure", NEUTRAL, "residual adds in the model dtype, reshapes")
            elif kind in attention_cls:
                entry = _entry(
                    name, module, "attention_block", NEUTRAL, "q/k/v split, norms, rotary, attention, o_proj"
                )
            elif kind in mlp_cls:
                entry = _entry(name, module, "mlp_block", NEUTRAL, "gate_up, activation·mul, down")
            else:
                entry = plugin.classify_module(name, module, formulas, hf_rope_of(name), rules)
        covering = ("rotary", "moe", "rms_norm", "silu_mul", "gelu_tanh_mul", "linear", "lm_head")
        if entry.status == COVERED and entry.op in covering:
            whole.append(name)
        report.entries.append(entry)
    return report


def _layer_index(name: str) -> int | None:
    """``i`` of the first ``layers.<i>`` in a qualified module name."""
    parts = name.split(".")
    for part, following in itertools.pairwise(parts):
        if part == "layers" and following.isdigit():
            return int(following)
    return None


# ----------------------------------------------------------------------------------------------
# Refusal and opt-out
# ----------------------------------------------------------------------------------------------

_warned: set[tuple[str, ...]] = set()


def allowed_names(allow_uncovered: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The opt-out: the argument, else ``SAMEPATH_ALLOW_UNCOVERED``; ``("all",)`` allows everything."""
    value: Any = allow_uncovered if allow_uncovered is not None else os.environ.get(ALLOW_ENV_VAR, "")
    if isinstance(value, str):
        value = value.split(",")
    elif not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            "allow_uncovered must be 'all', a comma-separated string or a sequence of strings (module class "
            f"names, qualified module names or ops), got {allow_uncovered!r}"
        )
    names = tuple(sorted({str(v).strip() for v in value if str(v).strip()}))
    return ("all",) if "all" in names or "*" in names else names


def _allowed(entry: AuditEntry, names: tuple[str, ...]) -> bool:
    if "all" in names:
        return True
    short = entry.module_class.rsplit(".", 1)[-1]
    return bool({short, entry.module_class, entry.name, entry.op} & set(names))


def enforce(report: AuditReport, allow_uncovered: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """Raise :class:`UncoveredOpsError` for a report with uncovered modules or model-level problems,
    unless every one is opted out (see :func:`allowed_names`). With an opt-out: warn once, record
    the opted-out parts in the numerics fingerprint, and return them (sorted); ``()`` when the
    model is fully covered."""
    if report.fully_covered:
        return ()
    names = allowed_names(allow_uncovered)
    if report.problems and "all" not in names:
        raise UncoveredOpsError(report)
    missing = [e for e in report.uncovered if not _allowed(e, names)]
    if missing:
        raise UncoveredOpsError(report)
    opted = tuple(sorted({f"{e.module_class.rsplit('.', 1)[-1]}[{e.op}]" for e in report.uncovered}))
    opted += tuple(f"model: {p}" for p in report.problems)
    from samepath.kernels.config import record_uncovered

    record_uncovered(report.side, opted)
    if opted not in _warned:
        _warned.add(opted)
        warnings.warn(
            f"samepath: running {report.side} with parts off its contract ({ALLOW_ENV_VAR} / allow_uncovered): "
            + "; ".join(report.describe_uncovered())
            + ". Their bits may differ between the rollout and the trainer; the fingerprint records this.",
            stacklevel=2,
        )
    return opted


def audit_model_dir(directory: str | None, dtype: torch.dtype = torch.float32) -> AuditReport:
    """Load a Hugging Face causal LM directory (default: ``samepath check``'s embedded tiny Qwen3),
    put it on samepath as ``patch_all`` would and return its audit (a model type samepath does not
    patch is reported, not raised), leaving the patch state as it was."""
    import tempfile

    from samepath import integrations
    from samepath.check.harness import _transformers, build_default_model
    from samepath.integrations import hf

    transformers = _transformers()
    with tempfile.TemporaryDirectory(prefix="samepath-audit-") as scratch:
        if directory is None:
            build_default_model(scratch)
        source = directory or scratch
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True).eval()
    was = integrations.enabled()
    integrations.patch_all()
    try:
        hf.use_samepath(model, hf.Patcher())  # a throwaway model: nothing to set back
        return audit_hf_model(model)
    finally:
        if not was:
            integrations.unpatch_all()


__all__ = [
    "ALLOW_ENV_VAR",
    "AuditEntry",
    "AuditReport",
    "UncoveredOpsError",
    "allowed_names",
    "audit_hf_model",
    "audit_model_dir",
    "audit_vllm_model",
    "enforce",
]
