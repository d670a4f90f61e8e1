"""Tuning numerics-neutral launch parameters, each candidate proven bitwise before it is accepted.

The frozen table (:mod:`samepath.kernels.config`) fixes every constant that changes bits. Some
launch parameters only change how fast a kernel runs — ``num_warps`` and ``num_stages`` are the
candidates (:data:`NEUTRAL_PARAMS`) — but on a compiled device even those can change a reduction
tree (``tl.sum`` across warps), so none is taken on faith:

1. for each (op, device kind, dtype, padded head size) the sweep runs the op's probe — every
   caller of the kernel, forward and backward, on shapes that span several tiles — with the
   frozen reference config, twice (the reference must be deterministic);
2. a **negative control** (a different ``tile_n`` / ``block_k`` / ``vocab_chunk``) must come out
   different, proving that the probe can fail;
3. each candidate runs the same probe on the same inputs and is **rejected unless every output is
   ``torch.equal``** to the reference's; only then is it timed;
4. the fastest accepted candidate is written to a JSON file (``write_tuned``) holding only neutral
   parameters and the fingerprint it was verified against. :func:`load_tuned` refuses anything
   else, and loading it changes no fingerprint: the frozen table is not touched.

Verification on probe inputs is evidence, not a proof for every shape; what makes it safe for
logdiff is that both sides load the same file (so a surviving difference would still be the same
on both sides) and that the frozen reference stays the one the fingerprint names.

No ``@triton.autotune`` is involved: the default path launches exactly one config.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from samepath.kernels import config as config_module
from samepath.kernels.config import (
    ATTENTION_TABLE,
    MATMUL_TABLE,
    NEUTRAL_PARAMS,
    ROW_REDUCE_TABLE,
    SUPPORTED_DTYPES,
    AttentionConfig,
    MatmulConfig,
    RowReduceConfig,
    fingerprint,
)
from samepath.kernels.dispatch import SUPPORTED_DEVICE_TYPES, device_kind

# NEUTRAL_PARAMS (config.py): what a tuned file may set, per op. Everything else is
# numerics-relevant and frozen; BLOCK_M stays in the fingerprinted table until proven neutral.

TUNED_FORMAT = "samepath-tuned/1"

#: Candidate values swept per device kind (the CPU interpreter ignores them: a tiny sweep).
DEFAULT_GRID: dict[str, dict[str, tuple[int, ...]]] = {
    "cpu": {"num_warps": (4, 8), "num_stages": (2,)},
    "cuda": {"num_warps": (4, 8), "num_stages": (2, 3, 4)},  # widen with --num-warps / --num-stages
    "npu": {"num_warps": (1,), "num_stages": (1,)},
}

Config = AttentionConfig | MatmulConfig | RowReduceConfig


@dataclass(frozen=True)
class TuneKey:
    """What one tuned entry applies to: the frozen table row it overrides."""

    op: str  # "attention", "matmul" or "row_reduce"
    device_kind: str
    dtype: str | None = None  # None for row_reduce (its table is per device kind)
    head_size: int | None = None  # padded head size, attention only

    def __post_init__(self) -> None:
        if self.op not in NEUTRAL_PARAMS:
            raise ValueError(f"unknown op {self.op!r}; tunable ops are {', '.join(NEUTRAL_PARAMS)}")
        if self.device_kind not in SUPPORTED_DEVICE_TYPES:
            raise ValueError(f"unknown device kind {self.device_kind!r}")
        if self.table_key() not in _table(self.op):
            raise ValueError(f"no frozen config for {self.label()}")

    def table_key(self) -> tuple:
        if self.op == "attention":
            return (self.device_kind, self.dtype, self.head_size)
        if self.op == "matmul":
            return (self.device_kind, self.dtype)
        return self.device_kind

    def override_key(self) -> tuple:
        """The key ``config.set_tuned_overrides`` takes: ``(op, *table key)``."""
        key = self.table_key()
        return (self.op, *(key if isinstance(key, tuple) else (key,)))

    def reference(self) -> Config:
        return _table(self.op)[self.table_key()]

    def label(self) -> str:
        parts = [self.op, self.device_kind]
        if self.dtype:
            parts.append(self.dtype)
        if self.head_size:
            parts.append(f"D{self.head_size}")
        return "/".join(parts)

    def to_json(self) -> dict:
        return {"op": self.op, "device_kind": self.device_kind, "dtype": self.dtype, "head_size": self.head_size}


def _table(op: str) -> dict:
    return {"attention": ATTENTION_TABLE, "matmul": MATMUL_TABLE, "row_reduce": ROW_REDUCE_TABLE}[op]


def keys_for(device: torch.device | str, dtypes: Sequence[torch.dtype], head_sizes: Sequence[int]) -> list[TuneKey]:
    """Every tunable table row for these dtypes and head sizes on this device kind."""
    kind = device_kind(device)
    keys = []
    for dtype in dtypes:
        name = SUPPORTED_DTYPES[dtype]
        keys += [TuneKey("attention", kind, name, config_module.padded_head_size(d)) for d in head_sizes]
        keys.append(TuneKey("matmul", kind, name))
    keys.append(TuneKey("row_reduce", kind))
    return list(dict.fromkeys(keys))


def neutral_params(key: TuneKey, cfg: Config) -> dict[str, int]:
    return {name: getattr(cfg, name) for name in NEUTRAL_PARAMS[key.op]}


def neutral_candidates(key: TuneKey, grid: dict[str, Sequence[int]] | None = None) -> list[Config]:
    """The reference config first, then every combination of the grid's neutral values."""
    grid = grid or DEFAULT_GRID[key.device_kind]
    ref = key.reference()
    names = NEUTRAL_PARAMS[key.op]
    out = [ref]
    for values in itertools.product(*(grid.get(n, (getattr(ref, n),)) for n in names)):
        cand = dataclasses.replace(ref, **dict(zip(names, values, strict=True)))
        if cand not in out:
            out.append(cand)
    return out


def negative_control(key: TuneKey) -> Config:
    """A config that changes numerics (must be rejected): half the KV tile / K block / vocab chunk."""
    ref = key.reference()
    if key.op == "attention":
        return dataclasses.replace(ref, tile_n=ref.tile_n // 2 if ref.tile_n > 16 else ref.tile_n * 2)
    if key.op == "matmul":
        return dataclasses.replace(ref, block_k=ref.block_k // 2 if ref.block_k > 16 else ref.block_k * 2)
    return dataclasses.replace(ref, vocab_chunk=ref.vocab_chunk // 2)


def changed_fields(key: TuneKey, cfg: Config) -> list[str]:
    ref = dataclasses.asdict(key.reference())
    return sorted(name for name, value in dataclasses.asdict(cfg).items() if ref[name] != value)


def is_neutral(key: TuneKey, cfg: Config) -> bool:
    """Whether ``cfg`` differs from the frozen row only in :data:`NEUTRAL_PARAMS`."""
    return set(changed_fields(key, cfg)) <= set(NEUTRAL_PARAMS[key.op])


# ----------------------------------------------------------------------------------------------
# Probes: every caller of an op's kernels, forward and backward, on shapes spanning several tiles
# ----------------------------------------------------------------------------------------------


def _rand(gen: torch.Generator, shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def probe_inputs(key: TuneKey, device: torch.device, size: str = "small", seed: int = 0) -> dict:
    """Seeded inputs for :func:`run_probe`. ``size``: ``"small"`` (CPU, tests), ``"device"``
    (verification on a GPU/NPU) or ``"timing"`` (the workload candidates are timed on)."""
    gen = torch.Generator().manual_seed(seed)
    ref = key.reference()
    if key.op == "attention":
        dtype = getattr(torch, key.dtype)
        head = key.head_size
        tile = ref.tile_n
        if size == "small":
            heads, kv_heads, lens = 2, 1, [2 * tile + 5, tile // 2 + 1, 1]
        elif size == "device":
            heads, kv_heads, lens = 8, 2, [1000, 333, 1, 2 * tile + 3, 4 * ref.block_m + 1]
        else:
            heads, kv_heads, lens = 32, 8, [2048, 2048, 1500, 500]
        total = sum(lens)
        d = {
            "q": _rand(gen, (total, heads, head), dtype, device),
            "k": _rand(gen, (total, kv_heads, head), dtype, device),
            "v": _rand(gen, (total, kv_heads, head), dtype, device),
            "g": _rand(gen, (total, heads, head), dtype, device),
            "lens": lens,
        }
        d["cu"] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        # The rollout side: the last few tokens of each sequence (chunk or decode) over a cache
        # with shuffled pages of 16.
        page = 16
        pages = [(n + page - 1) // page for n in lens]
        order = list(range(sum(pages)))
        random.Random(seed).shuffle(order)
        width = max(pages)
        table = torch.zeros(len(lens), width, dtype=torch.int32)
        k_cache = torch.zeros(sum(pages), page, kv_heads, head, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        taken, q_rows = 0, []
        starts = d["cu"].tolist()
        for seq, n in enumerate(lens):
            ids = order[taken : taken + pages[seq]]
            taken += pages[seq]
            table[seq, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            for p in range(n):
                k_cache[ids[p // page], p % page] = d["k"][starts[seq] + p]
                v_cache[ids[p // page], p % page] = d["v"][starts[seq] + p]
            q_rows += list(range(starts[seq] + n - min(n, 5), starts[seq] + n))
        chunks = [min(n, 5) for n in lens]
        d.update(
            k_cache=k_cache,
            v_cache=v_cache,
            table=table.to(device),
            q_new=d["q"][torch.tensor(q_rows, device=device)],
            qsl=torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        )
        return d
    if key.op == "matmul":
        dtype = getattr(torch, key.dtype)
        if size == "small":
            m, k, n = 37, 3 * ref.block_k + 5, 2 * ref.block_n + 3
        elif size == "device":
            m, k, n = 300, 1024 + 40, 512 + 3
        else:
            m, k, n = 4096, 4096, 4096
        return {
            "a": _rand(gen, (m, k), dtype, device),
            "w": _rand(gen, (n, k), dtype, device) * k**-0.5,
            "bias": _rand(gen, (n,), dtype, device),
            "g": _rand(gen, (m, n), dtype, device),
        }
    # row_reduce: token logprobs / entropy / log-softmax over the vocabulary, and RMSNorm
    if size == "small":
        rows, vocab, norm_rows, hidden, dtypes = 3, 2 * ref.vocab_chunk + 37, 5, 257, (torch.float32, torch.bfloat16)
    elif size == "device":
        rows, vocab, norm_rows, hidden, dtypes = 9, 151936, 33, 4096, tuple(SUPPORTED_DTYPES)
    else:
        rows, vocab, norm_rows, hidden, dtypes = 1024, 151936, 4096, 4096, (torch.bfloat16,)
    d = {"dtypes": []}
    for dtype in dtypes:
        d["dtypes"].append(
            {
                "logits": _rand(gen, (rows, vocab), dtype, device) * 4,
                "labels": torch.randint(0, vocab, (rows,), generator=gen).to(device),
                "w_lp": _rand(gen, (rows,), torch.float32, device),
                "w_ent": _rand(gen, (rows,), torch.float32, device),
                "x": _rand(gen, (norm_rows, hidden), dtype, device),
                "nw": _rand(gen, (hidden,), dtype, device),
                "gy": _rand(gen, (norm_rows, hidden), dtype, device),
            }
        )
    return d


@contextmanager
def _rms_norm_config(cfg: RowReduceConfig) -> Iterator[None]:
    # rms_norm takes no config= argument; its launcher reads row_reduce_config() from its module.
    rms_module = importlib.import_module("samepath.kernels.rms_norm")  # the package exports the function
    original = rms_module.row_reduce_config
    rms_module.row_reduce_config = lambda device: cfg
    try:
        yield
    finally:
        rms_module.row_reduce_config = original


def run_probe(key: TuneKey, cfg: Config, inputs: dict, *, backward: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Run every caller of ``key.op``'s kernels with ``cfg``; returns named outputs to compare."""
    from samepath.kernels.attention import paged_attention, varlen_attention
    from samepath.kernels.logprobs import log_softmax, token_logprobs
    from samepath.kernels.matmul import linear, matmul
    from samepath.kernels.rms_norm import rms_norm

    out: list[tuple[str, torch.Tensor]] = []
    if key.op == "attention":
        d = inputs
        q, k, v = (d[n].detach().requires_grad_(backward) for n in ("q", "k", "v"))
        with torch.set_grad_enabled(backward):
            o = varlen_attention(q, k, v, d["cu"], config=cfg, validate=False)
        out.append(("varlen_attention", o.detach()))
        if backward:
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), d["g"])
            out += [("varlen_attention.dq", dq), ("varlen_attention.dk", dk), ("varlen_attention.dv", dv)]
        scale = q.shape[-1] ** -0.5
        paged = paged_attention(
            d["q_new"],
            d["k_cache"],
            d["v_cache"],
            d["table"],
            d["qsl"],
            d["seq_lens"],
            scale,
            config=cfg,
            validate=False,
        )
        out.append(("paged_attention", paged))
        return out
    if key.op == "matmul":
        d = inputs
        out.append(("matmul", matmul(d["a"], d["w"].t(), d["bias"], config=cfg)))
        out.append(("matmul[M=1]", matmul(d["a"][:1], d["w"].t(), d["bias"], config=cfg)))
        x, w, b = (d[n].detach().requires_grad_(backward) for n in ("a", "w", "bias"))
        with torch.set_grad_enabled(backward):
            y = linear(x, w, b, config=cfg)
        out.append(("linear", y.detach()))
        if backward:
            dx, dw, db = torch.autograd.grad(y, (x, w, b), d["g"])
            out += [("linear.dx", dx), ("linear.dw", dw), ("linear.db", db)]
        return out
    for d in inputs["dtypes"]:
        tag = str(d["logits"].dtype).removeprefix("torch.")
        logits = d["logits"].detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            lp, ent = token_logprobs(logits, d["labels"], 0.7, return_entropy=True, config=cfg, validate=False)
        out += [(f"token_logprobs[{tag}]", lp.detach()), (f"entropy[{tag}]", ent.detach())]
        if backward:
            (grad,) = torch.autograd.grad((lp, ent), (logits,), (d["w_lp"], d["w_ent"]))
            out.append((f"token_logprobs.grad[{tag}]", grad))
        if backward:
            logits = d["logits"].detach().requires_grad_(True)
            ls = log_softmax(logits, 0.7, config=cfg)
            (grad,) = torch.autograd.grad(ls, (logits,), torch.ones_like(ls))
            out += [(f"log_softmax[{tag}]", ls.detach()), (f"log_softmax.grad[{tag}]", grad)]
        else:
            out.append((f"log_softmax[{tag}]", log_softmax(d["logits"], 0.7, config=cfg)))
        x, nw = d["x"].detach().requires_grad_(backward), d["nw"].detach().requires_grad_(backward)
        with _rms_norm_config(cfg), torch.set_grad_enabled(backward):
            y = rms_norm(x, nw, 1e-6)
            out.append((f"rms_norm[{tag}]", y.detach()))
            if backward:
                dx, dnw = torch.autograd.grad(y, (x, nw), d["gy"])
                out += [(f"rms_norm.dx[{tag}]", dx), (f"rms_norm.dw[{tag}]", dnw)]
    return out


@dataclass
class Verdict:
    accepted: bool
    mismatches: list[str] = field(default_factory=list)

    def reason(self) -> str:
        return "bitwise equal to the reference" if self.accepted else "differs: " + ", ".join(self.mismatches)


def compare(reference: list[tuple[str, torch.Tensor]], candidate: list[tuple[str, torch.Tensor]]) -> Verdict:
    """``torch.equal`` output by output (shape, dtype and every bit; NaN counts as a mismatch)."""
    mismatches = [
        name
        for (name, expected), (other, actual) in zip(reference, candidate, strict=True)
        if name != other or not torch.equal(expected, actual)
    ]
    return Verdict(not mismatches, mismatches)


def verify_candidate(
    key: TuneKey,
    candidate: Config,
    device: torch.device | str,
    *,
    size: str = "small",
    inputs: dict | None = None,
    reference_outputs: list[tuple[str, torch.Tensor]] | None = None,
) -> Verdict:
    """Accept ``candidate`` only if every probe output is bit-identical to the frozen reference's."""
    device = torch.device(device)
    inputs = inputs if inputs is not None else probe_inputs(key, device, size)
    if reference_outputs is None:
        reference_outputs = run_probe(key, key.reference(), inputs)
    try:
        outputs = run_probe(key, candidate, inputs)
    except Exception as exc:  # a candidate that does not launch (shared memory, ...) is rejected
        return Verdict(False, [f"launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"])
    return compare(reference_outputs, outputs)


# ----------------------------------------------------------------------------------------------
# Timing and the sweep
# ----------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass
class TuneResult:
    key: TuneKey
    reference: dict[str, int]
    reference_ms: float
    winner: dict[str, int]
    winner_ms: float
    accepted: list[tuple[dict[str, int], float]] = field(default_factory=list)
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    negative_control: str = ""

    def to_json(self) -> dict:
        return {
            **self.key.to_json(),
            "params": self.winner,
            "ms": round(self.winner_ms, 6),
            "reference": self.reference,
            "reference_ms": round(self.reference_ms, 6),
            "accepted": [{"params": p, "ms": round(ms, 6)} for p, ms in self.accepted],
            "rejected": [{"params": p, "reason": r} for p, r in self.rejected],
            "negative_control": self.negative_control,
        }


def tune_key(
    key: TuneKey,
    device: torch.device | str,
    *,
    candidates: Sequence[Config] | None = None,
    size: str = "small",
    timing_size: str | None = None,
    warmup: int = 1,
    repeats: int = 3,
    min_gain: float = 0.03,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Verify every candidate bitwise against the frozen reference, then time the accepted ones.

    ``candidates`` defaults to :func:`neutral_candidates`; any candidate that is not neutral is
    verified (and reported) but never becomes the winner. The reference stays the winner unless a
    candidate is faster by more than ``min_gain`` (timing noise must not churn the file).
    """
    device = torch.device(device)
    if device_kind(device) != key.device_kind:
        raise ValueError(f"{key.label()} must be tuned on a {key.device_kind} device, not {device}")
    ref = key.reference()
    candidates = list(candidates) if candidates is not None else neutral_candidates(key)
    if ref not in candidates:
        candidates.insert(0, ref)
    inputs = probe_inputs(key, device, size)
    reference_outputs = run_probe(key, ref, inputs)
    again = compare(reference_outputs, run_probe(key, ref, inputs))
    if not again.accepted:
        raise RuntimeError(f"{key.label()}: the reference config is not deterministic ({again.reason()})")
    control = negative_control(key)
    verdict = verify_candidate(key, control, device, inputs=inputs, reference_outputs=reference_outputs)
    if verdict.accepted:
        raise RuntimeError(
            f"{key.label()}: the negative control ({', '.join(changed_fields(key, control))} changed) passed the "
            "probe; the probe is too weak to prove anything"
        )
    control_note = (
        f"{', '.join(f'{n}={getattr(control, n)}' for n in changed_fields(key, control))}: {verdict.reason()}"
    )
    log(f"{key.label()}: negative control rejected ({control_note})")

    timing_inputs = inputs if timing_size in (None, size) else probe_inputs(key, device, timing_size, seed=1)
    accepted: list[tuple[Config, float]] = []
    rejected: list[tuple[dict[str, Any], str]] = []
    for cand in candidates:
        described = {n: getattr(cand, n) for n in changed_fields(key, cand)} or neutral_params(key, cand)
        verdict = verify_candidate(key, cand, device, inputs=inputs, reference_outputs=reference_outputs)
        if verdict.accepted and not is_neutral(key, cand):
            rejected.append((described, "not numerics-neutral: changes " + ", ".join(changed_fields(key, cand))))
            log(f"{key.label()}: {described} verified equal but is not a neutral change — not a winner")
            continue
        if not verdict.accepted:
            rejected.append((described, verdict.reason()))
            log(f"{key.label()}: rejected {described}: {verdict.reason()}")
            continue
        ms = median_ms(lambda c=cand: run_probe(key, c, timing_inputs), device, warmup, repeats)
        accepted.append((cand, ms))
        log(f"{key.label()}: accepted {neutral_params(key, cand)}: {ms:.3f} ms")
    ref_ms = next(ms for cand, ms in accepted if cand == ref)
    best, best_ms = min(accepted, key=lambda item: item[1])
    if best_ms > ref_ms * (1 - min_gain):
        best, best_ms = ref, ref_ms
    return TuneResult(
        key=key,
        reference=neutral_params(key, ref),
        reference_ms=ref_ms,
        winner=neutral_params(key, best),
        winner_ms=best_ms,
        accepted=[(neutral_params(key, c), ms) for c, ms in accepted],
        rejected=rejected,
        negative_control=control_note,
    )


def sweep(keys: Sequence[TuneKey], device: torch.device | str, **kwargs: Any) -> list[TuneResult]:
    """:func:`tune_key` for each key."""
    return [tune_key(key, device, **kwargs) for key in keys]


# ----------------------------------------------------------------------------------------------
# The tuned file
# ----------------------------------------------------------------------------------------------


def write_tuned(path: str | Path, results: Sequence[TuneResult], device: torch.device | str) -> dict:
    """Write the winners (neutral parameters only) with the fingerprint they were verified against."""
    import triton

    device = torch.device(device)
    entries = []
    for result in results:
        extra = set(result.winner) - set(NEUTRAL_PARAMS[result.key.op])
        if extra:  # pragma: no cover - tune_key never produces one
            raise ValueError(f"{result.key.label()}: refusing to write non-neutral parameters {sorted(extra)}")
        entries.append(result.to_json())
    payload = {
        "format": TUNED_FORMAT,
        "fingerprint": fingerprint(),
        "device_kind": device_kind(device),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "neutral_params": {op: list(names) for op, names in NEUTRAL_PARAMS.items()},
        "entries": entries,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


@dataclass(frozen=True)
class TunedTable:
    """Neutral launch parameters loaded from a tuned file, keyed like the frozen table."""

    params: dict[TuneKey, dict[str, int]]
    fingerprint: str
    device_kind: str
    source: str = ""

    def config(self, key: TuneKey) -> Config:
        """The frozen row for ``key`` with the tuned neutral parameters applied."""
        tuned = self.params.get(key)
        return dataclasses.replace(key.reference(), **tuned) if tuned else key.reference()

    def attention_config(self, head_size: int, dtype: torch.dtype, device: torch.device | str) -> AttentionConfig:
        config_module.check_head_size(head_size)
        key = TuneKey(
            "attention", device_kind(device), config_module.dtype_name(dtype), config_module.padded_head_size(head_size)
        )
        return self.config(key)

    def matmul_config(self, dtype: torch.dtype, device: torch.device | str) -> MatmulConfig:
        return self.config(TuneKey("matmul", device_kind(device), config_module.dtype_name(dtype)))

    def row_reduce_config(self, device: torch.device | str) -> RowReduceConfig:
        return self.config(TuneKey("row_reduce", device_kind(device)))

    def overrides(self) -> dict[tuple, dict[str, int]]:
        """``{(op, *table key): {param: value}}``, what ``config.set_tuned_overrides`` takes."""
        return {key.override_key(): dict(values) for key, values in self.params.items()}


def _check_params(key: TuneKey, params: Any) -> dict[str, int]:
    if not isinstance(params, dict):
        raise ValueError(f"{key.label()}: params must be an object, got {params!r}")
    extra = sorted(set(params) - set(NEUTRAL_PARAMS[key.op]))
    if extra:
        raise ValueError(
            f"{key.label()}: the tuned file sets {', '.join(extra)}, which change numerics; a tuned file may only "
            f"set {', '.join(NEUTRAL_PARAMS[key.op])} (change the frozen table and the fingerprint instead)"
        )
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key.label()}: {name} must be a positive int, got {value!r}")
        if name == "num_warps" and (value & (value - 1) or value > 32):
            raise ValueError(f"{key.label()}: num_warps must be a power of two <= 32, got {value}")
    return dict(params)


def load_tuned(path: str | Path, *, check_fingerprint: bool = True) -> TunedTable:
    """Read and validate a tuned file. Refuses numerics-relevant parameters, unknown keys, and
    (by default) a file verified against another numerics fingerprint than this process's."""
    path = Path(path)
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or payload.get("format") != TUNED_FORMAT:
        raise ValueError(f"{path} is not a samepath tuned file (format {TUNED_FORMAT!r})")
    file_fingerprint = payload.get("fingerprint")
    if check_fingerprint and file_fingerprint != fingerprint():
        raise ValueError(
            f"{path} was verified against numerics fingerprint {file_fingerprint}, this process runs "
            f"{fingerprint()}: its candidates were never compared with this table; re-run bench/tune.py"
        )
    kind = payload.get("device_kind")
    params: dict[TuneKey, dict[str, int]] = {}
    for entry in payload.get("entries", []):
        key = TuneKey(entry["op"], entry["device_kind"], entry.get("dtype"), entry.get("head_size"))
        if key.device_kind != kind:
            raise ValueError(f"{path}: entry {key.label()} is not for the file's device kind {kind}")
        if key in params:
            raise ValueError(f"{path}: {key.label()} appears twice")
        params[key] = _check_params(key, entry.get("params"))
    return TunedTable(params=params, fingerprint=file_fingerprint, device_kind=kind, source=str(path))


def install_tuned(table: TunedTable) -> None:
    """Make the default launch path use ``table`` (both trainer and rollout must call this).

    Needs the ``set_tuned_overrides`` hook in :mod:`samepath.kernels.config`; until it exists,
    pass ``table.attention_config(...)`` etc. as ``config=`` explicitly.
    """
    hook = getattr(config_module, "set_tuned_overrides", None)
    if hook is None:
        raise RuntimeError(
            "samepath.kernels.config has no set_tuned_overrides() hook yet: the tuned parameters cannot be "
            "installed on the default path; pass TunedTable.attention_config(...) / matmul_config(...) as config="
        )
    hook(table.overrides())


__all__ = [
    "DEFAULT_GRID",
    "NEUTRAL_PARAMS",
    "TUNED_FORMAT",
    "TuneKey",
    "TuneResult",
    "TunedTable",
    "Verdict",
    "compare",
    "install_tuned",
    "is_neutral",
    "keys_for",
    "load_tuned",
    "negative_control",
    "neutral_candidates",
    "probe_inputs",
    "run_probe",
    "sweep",
    "tune_key",
    "verify_candidate",
    "write_tuned",
]
