"""``samepath doctor``: the first operator where the rollout and trainer paths part.

The batch is the one ``samepath check`` compares (:class:`DoctorBatch`): prompts of different
lengths and their completions. The rollout path is what ``generate`` does: a left-padded prefill
of the prompts, then one token at a time with a KV cache. The trainer path is check's trainer: one
right-padded forward of prompt + completion, no cache. Both see the same tokens at the same
positions. Forward hooks on every module (plus wrappers around the attention function and
``apply_rotary_pos_emb``, which are functions, not modules) record each module's input and
output; the rollout's per-step records are concatenated along the sequence dimension (or the
flattened token dimension, as an MoE router's and experts' are), padding is dropped on both
sides, and the two are compared token by token in execution order.

A difference is attributed to the earliest record that differs:

* a module's **output** differs while its input and its submodules' records match: that module's
  own computation (an RMSNorm, a linear, the attention kernel, rotary, SiLU·mul, or a decoder
  layer's residual adds);
* a module's **input** differs while everything recorded before it matches: the code between
  modules (a residual add or cast in the parent's forward);
* a module runs on one path only: a fused op on the other path (e.g. add+RMSNorm).

Then, for each later layer, the first record that differs there (``inherited`` when its input
already differed).
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from samepath.check.doctor_recording import (
    ATTENTION_OP,
    LOGPROBS_OP,
    OWN_CODE,
    ROTARY_OP,
    DoctorBatch,
    Record,
    Recorder,
    layer_of,
    op_kind,
    record_rollout,
    record_trainer,
)

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


@dataclass
class Divergence:
    """One record that differs between the rollout and trainer paths."""

    module: str  #: full module name, e.g. "model.layers.1.input_layernorm"
    layer: int | None  #: decoder layer index, None outside the layers
    submodule: str  #: name inside the layer ("" for the layer itself)
    op: str  #: norm, linear, attention, rotary, mlp, decoder layer, ...
    module_class: str
    phase: str  #: "output", "input" (the code before the module) or "structure"
    cause: str  #: what computes this record, in words
    max_ulp: int | None  #: max distance in units in the last place (None: dtypes differ / no values)
    max_abs_diff: float | None
    first_position: int | None  #: first token position (0-based) where it differs
    first_batch_row: int | None
    differing_positions: int
    inherited: bool  #: the module's input (or an earlier record) already differed


#: What the numerics a report names mean, printed with it.
NUMERICS_MEANING = {
    "stock": "both paths on the framework's own kernels (samepath not patched in)",
    "samepath": "both paths under samepath.integrations.patch_all()",
}


@dataclass
class DoctorReport:
    numerics: str
    prompt_lengths: list[int]
    new_tokens: int
    temperature: float
    records_compared: int
    divergences: list[Divergence] = field(default_factory=list)
    unaligned: list[str] = field(default_factory=list)
    model_description: str = ""

    @property
    def batch(self) -> int:
        return len(self.prompt_lengths)

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    @property
    def identical(self) -> bool:
        return not self.divergences

    def to_json(self) -> dict:
        return {
            "numerics": self.numerics,
            "batch": self.batch,
            "prompt_lengths": self.prompt_lengths,
            "new_tokens": self.new_tokens,
            "temperature": self.temperature,
            "records_compared": self.records_compared,
            "identical": self.identical,
            "first": asdict(self.first) if self.first else None,
            "later": [asdict(d) for d in self.divergences[1:]],
            "unaligned": self.unaligned,
        }

    def format(self) -> str:
        title = f"samepath doctor ({self.numerics} numerics)"
        lengths = ", ".join(map(str, self.prompt_lengths))
        lines = [
            f"{title}: {self.model_description}" if self.model_description else title,
            f"rollout path (as generate): a left-padded prefill of {self.batch} prompts of {lengths} tokens, then "
            f"{self.new_tokens - 1} one-token decode steps with a KV cache; trainer path (as samepath check's): "
            f"one right-padded forward of prompt + {self.new_tokens} completion tokens; log-probs at temperature "
            f"{self.temperature:g}. {self.records_compared} module inputs/outputs compared at every token.",
        ]
        if self.numerics in NUMERICS_MEANING:
            lines.append(f"{self.numerics} numerics: {NUMERICS_MEANING[self.numerics]}.")
        if self.identical:
            lines.append("No divergence: every module's input and output is bit-identical between the two paths.")
        else:
            lines.append("First divergence:")
            lines.append("  " + _describe(self.first, self.prompt_lengths))
            if len(self.divergences) > 1:
                lines.append("Then, in each later layer (and after the layers), the first module output that differs:")
                lines += ["  " + _describe(d, self.prompt_lengths) for d in self.divergences[1:]]
        if self.unaligned:
            lines.append(f"Not compared (no per-position alignment): {', '.join(self.unaligned)}")
        return "\n".join(lines)


def _describe(d: Divergence, prompt_lengths: list[int]) -> str:
    layer = f"layer {d.layer}" if d.layer is not None else "-"
    sub = (d.submodule or "(decoder layer)") if d.layer is not None else d.module
    head = f"{layer:<9} {sub:<40} [{d.op}: {d.module_class}] {d.phase}"
    if d.phase == "structure":
        return f"{head}: {d.cause}"
    ulp = f"max {d.max_ulp} ulp" if d.max_ulp is not None else "dtype differs"
    diff = f", |Δ| max {d.max_abs_diff:.3e}" if d.max_abs_diff is not None else ""
    pos, row = d.first_position, d.first_batch_row
    prompt = prompt_lengths[row] if row is not None else 0
    step = "prefill" if pos is not None and pos < prompt else f"decode step {pos - prompt + 1}"
    where = f"first at position {pos} ({step}), batch row {row}; {d.differing_positions} tokens differ"
    tail = " (inherited: its input already differed)" if d.inherited else f" <- {d.cause}"
    return f"{head}: {ulp}{diff}; {where}{tail}"


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (int64), via the dtype's integer view."""
    int_dtype = _INT_VIEW.get(a.dtype)
    if int_dtype is None:  # fp64 and others: compare in fp32 ulps
        a, b, int_dtype = a.float(), b.float(), torch.int32
    bits = torch.iinfo(int_dtype).bits

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(int_dtype).to(torch.int64)
        mag = i & ((1 << (bits - 1)) - 1)
        return torch.where(i < 0, -mag, mag)

    return (ordered(a) - ordered(b)).abs()


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    int_dtype = _INT_VIEW.get(a.dtype, torch.int64 if a.dtype == torch.float64 else None)
    if int_dtype is None:
        return a != b
    return a.contiguous().view(int_dtype) != b.contiguous().view(int_dtype)


def _fits(piece: torch.Tensor, trainer: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> bool:
    return (
        piece.dim() == trainer.dim()
        and piece.shape[dim] in sizes
        and all(piece.shape[e] == trainer.shape[e] for e in range(trainer.dim()) if e != dim)
    )


def _token_major(
    trainer: torch.Tensor, pieces: list[torch.Tensor], batch: DoctorBatch
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The trainer's record as ``[batch, trainer width, ...]`` and the rollout's calls concatenated
    as ``[batch, sequence, ...]``, from either a ``[batch, ..., sequence, ...]`` layout or tokens
    flattened into the first dimension (an MoE router's or experts' ``[batch * sequence, ...]``).
    None when no dimension lines up."""
    b, width = batch.batch, batch.width
    trainer_width = width + batch.new_tokens
    if b > 1 and trainer.dim() >= 3:  # one row for the whole batch (rotary's cos/sin from shared positions)
        trainer = trainer.expand(b, *trainer.shape[1:]) if trainer.shape[0] == 1 else trainer
        pieces = [p.expand(b, *p.shape[1:]) if p.dim() == trainer.dim() and p.shape[0] == 1 else p for p in pieces]
    first, decode = pieces[0], pieces[1:]
    if trainer.dim() >= 2 and trainer.shape[0] == b:
        for d in range(1, trainer.dim()):
            if (
                trainer.shape[d] == trainer_width
                and _fits(first, trainer, d, (width, 1))
                and all(_fits(p, trainer, d, (1,)) for p in decode)
            ):
                return trainer.movedim(d, 1), torch.cat(pieces, d).movedim(d, 1)
    if (
        trainer.dim() >= 1
        and trainer.shape[0] == b * trainer_width
        and _fits(first, trainer, 0, (b * width, b))
        and all(_fits(p, trainer, 0, (b,)) for p in decode)
    ):
        rows = [p.reshape(b, p.shape[0] // b, *p.shape[1:]) for p in pieces]
        return trainer.reshape(b, trainer_width, *trainer.shape[1:]), torch.cat(rows, 1)
    return None


def _aligned(
    trainer: torch.Tensor, pieces: list[torch.Tensor], batch: DoctorBatch
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]] | None:
    """The rollout's and the trainer's values of one record at every token both computed,
    ``[tokens, ...]`` each, with the ``(row, position)`` of each token."""
    if len(pieces) != batch.new_tokens:  # a prefill and new_tokens - 1 decode steps
        return None
    views = _token_major(trainer, pieces, batch)
    if views is None:
        return None
    trainer_rows, rollout_rows = views
    prefill = rollout_rows.shape[1] - (batch.new_tokens - 1)  # the width, or 1 where only the last logits are kept
    rows: list[int] = []
    rollout_cols: list[int] = []
    where: list[tuple[int, int]] = []
    for r, length in enumerate(batch.prompt_lengths):
        prompt_positions = range(length) if prefill == batch.width else range(length - 1, length)
        for j in prompt_positions:
            rows.append(r)
            rollout_cols.append(batch.width - length + j if prefill == batch.width else 0)
            where.append((r, j))
        for step in range(1, batch.new_tokens):
            rows.append(r)
            rollout_cols.append(prefill + step - 1)
            where.append((r, length + step - 1))
    index = torch.tensor(rows)
    trainer_cols = torch.tensor([j for _, j in where])
    return rollout_rows[index, torch.tensor(rollout_cols)], trainer_rows[index, trainer_cols], where


@dataclass
class _Compared:
    key: tuple[str, str, int]
    record: Record
    differs: bool
    divergence: Divergence | None


def _keyed(records: list[Record]) -> list[tuple[tuple[str, str, int], Record]]:
    seen: Counter = Counter()
    out = []
    for record in records:
        seen[record.name, record.phase] += 1
        out.append(((record.name, record.phase, seen[record.name, record.phase]), record))
    return out


def compare_paths(rollout: Recorder, trainer: Recorder, batch: DoctorBatch, numerics: str) -> DoctorReport:
    """Every record of both paths, token by token, in execution order (see the module docstring)."""
    if len(trainer.calls) != 1:
        raise RuntimeError(f"the trainer path made {len(trainer.calls)} forward calls, expected 1")
    trainer_keyed = _keyed(trainer.calls[0])
    rollout_calls = [dict(_keyed(call)) for call in rollout.calls]
    rollout_order = [key for key, _ in _keyed(rollout.calls[0])] if rollout.calls else []
    trainer_map = dict(trainer_keyed)
    trainer_order = [key for key, _ in trainer_keyed]

    merged: list[tuple[tuple[str, str, int], str]] = []  # (key, "both" | "trainer" | "rollout")
    matcher = difflib.SequenceMatcher(None, trainer_order, rollout_order, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            merged += [(k, "both") for k in trainer_order[i1:i2]]
        else:
            merged += [(k, "trainer") for k in trainer_order[i1:i2]]
            merged += [(k, "rollout") for k in rollout_order[j1:j2]]

    report = DoctorReport(numerics, batch.prompt_lengths, batch.new_tokens, batch.temperature, 0)
    differed: set[tuple[str, str, int]] = set()
    any_differed = False
    compared: list[_Compared] = []
    for key, where in merged:
        name, phase, _ = key
        if where != "both":
            record = trainer_map[key] if where == "trainer" else rollout_calls[0][key]
            side = "trainer" if where == "trainer" else "rollout"
            other = "rollout" if side == "trainer" else "trainer"
            cause = (
                f"runs on the {side} path only (fused into other code, or skipped, on the {other} path)"
                if phase == "output"
                else f"called on the {side} path only"
            )
            div = _divergence(record, "structure", cause, None, None, None, None, 0, any_differed)
            compared.append(_Compared(key, record, True, div))
            differed.add(key)
            any_differed = True
            continue
        record = trainer_map[key]
        pieces_lists = [call.get(key) for call in rollout_calls]
        if any(p is None for p in pieces_lists):
            report.unaligned.append(f"{name} ({phase}, not recorded in every rollout step)")
            continue
        for index, t in enumerate(record.tensors):
            pieces = [p.tensors[index] for p in pieces_lists if index < len(p.tensors)]
            aligned = _aligned(t, pieces, batch)
            if aligned is None:
                report.unaligned.append(f"{name} ({phase} #{index})")
                continue
            report.records_compared += 1
            div = _compare_tensor(record, phase, *aligned, key, differed, any_differed, trainer_map)
            if div is not None:
                compared.append(_Compared(key, record, True, div))
                differed.add(key)
                any_differed = True
                break

    # the first divergence, then the first one in each later layer / top-level module
    groups_seen: set = set()
    for item in compared:
        div = item.divergence
        group = div.layer if div.layer is not None else div.module
        if not report.divergences:
            report.divergences.append(div)
            groups_seen.add(group)
        elif group not in groups_seen and div.phase != "input":
            report.divergences.append(div)
            groups_seen.add(group)
    return report


def _compare_tensor(
    record, phase, rollout_t, trainer_t, where, key, differed, any_differed, recorded
) -> Divergence | None:
    name = record.name
    if rollout_t.dtype != trainer_t.dtype:
        inherited = _inherited(key, differed, any_differed, recorded)
        cause = f"dtype {rollout_t.dtype} on the rollout path, {trainer_t.dtype} on the trainer path"
        return _divergence(record, phase, cause, None, None, 0, 0, len(where), inherited)
    mask = _bits_differ(rollout_t, trainer_t)
    if not bool(mask.any()):
        return None
    ulps = ulp_distance(rollout_t, trainer_t)
    abs_diff = (rollout_t.double() - trainer_t.double()).abs()
    abs_diff = torch.where(mask, abs_diff, torch.zeros_like(abs_diff))
    tokens = mask.reshape(mask.shape[0], -1).any(1).nonzero().flatten()
    row, first = where[int(tokens[0])]
    inherited = _inherited(key, differed, any_differed, recorded)
    if phase == "input":
        parent = name.rsplit(".", 1)[0] if "." in name else "the model"
        cause = f"code between modules before it (a residual add or cast in {parent}'s forward)"
    else:
        cause = OWN_CODE.get(record.op, f"{record.cls}'s own code")
    max_abs = float(abs_diff.max())
    return _divergence(record, phase, cause, int(ulps.max()), max_abs, first, row, int(tokens.numel()), inherited)


def _inherited(key, differed, any_differed, recorded) -> bool:
    """Whether a differing record can be explained by an earlier difference feeding it."""
    name, phase, occurrence = key
    if phase == "output" and (name, "input", occurrence) in recorded:
        return (name, "input", occurrence) in differed or (any_differed and _children_differed(name, differed))
    return any_differed  # an input, or an output whose input was not recorded (e.g. token ids, logits)


def _children_differed(name: str, differed) -> bool:
    prefix = name + "."
    return any(other.startswith(prefix) for other, _, _ in differed)


def _divergence(record, phase, cause, max_ulp, max_abs, first, row, count, inherited) -> Divergence:
    layer, sub = layer_of(record.name)
    return Divergence(
        module=record.name,
        layer=layer,
        submodule=sub,
        op=record.op,
        module_class=record.cls,
        phase=phase,
        cause=cause,
        max_ulp=max_ulp,
        max_abs_diff=max_abs,
        first_position=first,
        first_batch_row=row,
        differing_positions=count,
        inherited=inherited,
    )


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def diagnose(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_len: int,
    *,
    rollout_model: torch.nn.Module | None = None,
    numerics: str = "current",
    on_stage: Callable[[str], None] | None = None,
) -> DoctorReport:
    """:func:`diagnose_batch` over equal-length rows ``input_ids`` ``[batch, positions]``: the first
    ``prompt_len`` tokens of each are its prompt, the rest its completion."""
    return diagnose_batch(
        model,
        DoctorBatch.from_ids(input_ids, prompt_len),
        rollout_model=rollout_model,
        numerics=numerics,
        on_stage=on_stage,
    )


def diagnose_batch(
    model: torch.nn.Module,
    batch: DoctorBatch,
    *,
    rollout_model: torch.nn.Module | None = None,
    numerics: str = "current",
    on_stage: Callable[[str], None] | None = None,
) -> DoctorReport:
    """Run the rollout path (on ``rollout_model``, default ``model``) and the trainer path (on
    ``model``) over ``batch`` with whatever numerics are in effect, and compare every module's
    records token by token.

    ``rollout_model`` lets a test (or a user) give the rollout side a different copy of the model:
    a fault injected there shows up as the first divergence. ``on_stage`` is called with
    ``"rollout"`` and ``"trainer"`` as each path starts (a progress bar's hook).
    """
    if on_stage is not None:
        on_stage("rollout")
    rollout = record_rollout(rollout_model if rollout_model is not None else model, batch)
    if on_stage is not None:
        on_stage("trainer")
    trainer = record_trainer(model, batch)
    return compare_paths(rollout, trainer, batch, numerics)


__all__ = [
    "ATTENTION_OP",
    "LOGPROBS_OP",
    "ROTARY_OP",
    "Divergence",
    "DoctorBatch",
    "DoctorReport",
    "Recorder",
    "compare_paths",
    "diagnose",
    "diagnose_batch",
    "layer_of",
    "op_kind",
    "ulp_distance",
]
