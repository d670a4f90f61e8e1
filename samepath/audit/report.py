"""Coverage audit: every module on the forward path is on samepath's contract, or the run is refused.

samepath's promise is bit equality between the rollout and the trainer; a module that samepath
does not cover runs stock on one side and silently breaks it. The audit walks a model — the Hugging
Face trainer's (:func:`samepath.integrations.hf_audit.audit_hf_model`, run by ``patch_all(model)``)
or the model vLLM built (:func:`samepath.audit.engine.audit_vllm_model`, run by the vLLM and
vllm-ascend integrations at model load) — and classifies every module:

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

This module holds the report, the rules every side shares and the refusal; the platform rules
come from the integrations (:mod:`samepath.integrations.hf_audit`, the vLLM / vllm-ascend
``loader`` modules), the model-level formulas from
:func:`samepath.models.formulas.model_formulas` on both sides: a model type covered on one
side only (e.g. ``granite``, ``gemma2``) is refused on both.

``samepath audit [--model DIR] [--json OUT]`` prints the Hugging Face side's report.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: Environment variable of the opt-out: ``all`` or comma-separated names (module class, qualified
#: module name or op).
ALLOW_ENV_VAR = "SAMEPATH_ALLOW_UNCOVERED"

COVERED, NEUTRAL, UNCOVERED = "covered", "neutral", "uncovered"
#: What :func:`samepath.audit.engine.audit_vllm_model` hands a rotary rule for a module in no layer of a config with
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


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def module_entry(name: str, module: torch.nn.Module, op: str, status: str, detail: str) -> AuditEntry:
    return AuditEntry(name, qualname(type(module)), op, status, detail)


def inside(name: str, parents: Iterable[str]) -> str | None:
    for parent in parents:
        if parent == "" or name.startswith(parent + "."):
            return parent
    return None


CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def generic_entry(name: str, module: torch.nn.Module) -> AuditEntry | None:
    """Rules shared by both sides (exact classes only: a subclass may compute something else)."""
    kind = type(module)
    if kind in CONTAINERS:
        return module_entry(name, module, "container", NEUTRAL, "holds modules, computes nothing")
    if kind is torch.nn.Identity:
        return module_entry(name, module, "identity", NEUTRAL, "returns its input")
    if kind is torch.nn.Dropout:
        if module.p == 0 or not module.training:
            return module_entry(name, module, "dropout", NEUTRAL, "p = 0 or eval mode: the identity")
        return module_entry(name, module, "dropout", UNCOVERED, f"dropout p={module.p} in train mode")
    return None


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
    it multiplies by, in the model dtype, is :func:`~samepath.models.formulas.sqrt_hidden_scale`
    rounded to that dtype, the factor both sides use: a lookup,
    then one dtype multiply. ``multiplied_as_stored``: the module multiplies by ``scale`` without
    casting it (vLLM's ``normalizer``), so ``scale`` must itself be in ``dtype`` (an fp32 factor
    would multiply unrounded)."""
    from samepath.models.formulas import sqrt_hidden_scale

    want = torch.tensor(sqrt_hidden_scale(hidden_size), dtype=torch.float32).to(dtype)
    if multiplied_as_stored and scale.dtype != dtype:
        detail = f"embedding scale stored in {scale.dtype}, multiplied unrounded into {dtype} activations"
        return module_entry(name, module, "embedding", UNCOVERED, detail)
    got = scale.detach().to(device="cpu").to(dtype)
    if got.numel() != 1 or not torch.equal(got.reshape(()), want):
        return module_entry(
            name, module, "embedding", UNCOVERED, f"embedding scale {got.tolist()} is not {want.item()}"
        )
    return module_entry(
        name, module, "embedding", NEUTRAL, f"a row lookup times {want.item()} in {dtype} (one rounding)"
    )


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


__all__ = [
    "ALLOW_ENV_VAR",
    "CONTAINERS",
    "COVERED",
    "NEUTRAL",
    "UNCOVERED",
    "UNRESOLVED_LAYER_ROPE",
    "AuditEntry",
    "AuditReport",
    "UncoveredOpsError",
    "allowed_names",
    "embedding_scale_entry",
    "enforce",
    "generic_entry",
    "inside",
    "module_entry",
    "qualname",
]
