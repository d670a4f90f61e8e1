"""Run the benchmarks: ``python -m bench`` or ``python bench/run.py``.

    python -m bench [--device cpu|cuda] [--dtype bfloat16] [--quick] [--ops a,b] [--out DIR]

For every case the baselines and samepath run on the same inputs, in the same process, on the
same device, one after the other: warm-up calls first (they include Triton's compilation), then
several timed calls, each bracketed by device synchronization, reported as min / median / max;
the speedup is the ratio of the medians. The timed calls cycle through input sets totalling more
than twice the L2 (64-256 MiB on a device), so no set is still cached when it comes round again.
Baselines that do not import or do not suit the device and dtype are listed with the reason.
Writes ``<date>-<device>-<dtype>.csv``, ``.txt`` (the printed table) and ``.png`` (when
matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import baselines as baselines_module
from bench import cases as cases_module
from bench import report
from bench.timing import Timing, device_for, l2_bytes, measure, rotation_for, rotation_target_bytes, tensor_bytes

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on a device, float32 on the CPU (interpreter)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases, fewer repeats")
    parser.add_argument(
        "--ops", default=",".join(cases_module.OPS), help="comma-separated subset of " + ", ".join(cases_module.OPS)
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--warmup", type=int, help="warm-up calls per measurement (default by device and mode)")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement, at least 2 (default by mode)")
    parser.add_argument("--no-png", action="store_true", help="skip the plot")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the arguments and list the ops, then exit (no device needed)"
    )
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(args.ops) - set(cases_module.OPS))
    if unknown:
        raise SystemExit(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(cases_module.OPS)}")
    if args.repeats is not None and args.repeats < 2:
        parser.error("--repeats must be at least 2 (min / median / max of one call say nothing)")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def _measure(case, impl: str, fn, sets, device, warmup: int, repeats: int) -> tuple[Timing, str]:
    context = case.context(impl) if case.context else None
    timer = case.timer or measure
    try:
        with context if context is not None else contextlib.nullcontext():
            return timer(fn, sets, device, warmup, repeats), ""
    except Exception as exc:  # a baseline that does not support this shape must not end the run
        message = f"{impl} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        print(f"  ! {message}", file=sys.stderr)
        return Timing.failed(), message


def _row(case, dtype, name: str, base: Timing, ours: Timing, rotation: str, note: str) -> dict:
    unit, base_rate = case.rate(base.median_ms)
    _, ours_rate = case.rate(ours.median_ms)
    ok = ours.median_ms and not math.isnan(ours.median_ms)
    return {
        "op": case.op,
        "config": case.config,
        "dtype": str(dtype).removeprefix("torch."),
        "baseline": name,
        "baseline_min_ms": base.min_ms,
        "baseline_ms": base.median_ms,
        "baseline_max_ms": base.max_ms,
        "samepath_min_ms": ours.min_ms,
        "samepath_ms": ours.median_ms,
        "samepath_max_ms": ours.max_ms,
        "speedup": base.median_ms / ours.median_ms if ok else float("nan"),
        "calls": min(base.n, ours.n),
        "unit": unit,
        "baseline_rate": base_rate,
        "samepath_rate": ours_rate,
        "measures": case.what or "wall ms per call",
        "rotation": rotation,
        "note": note,
    }


def _write_partial(out: Path, device, dtype, quick: bool, rows: list[dict], mode, timing, notes, found) -> None:
    """The CSV and table of the cases done so far, so that a run cut short keeps its results."""
    out.mkdir(parents=True, exist_ok=True)
    head = report.header(device, dtype, mode + " (partial: run in progress)", timing, notes)
    head["samepath_calls"] = cases_module.SAMEPATH_CALLS
    head["baselines_missing"] = found.missing_line().partition(": ")[2]
    stem = report.file_stem(device, dtype, quick)
    report.write_csv(out / f"{stem}.csv", head, rows)
    (out / f"{stem}.txt").write_text(report.format_table(head, rows) + "\n")


def defaults(device: torch.device, quick: bool) -> tuple[int, int]:
    """Warm-up calls and timed calls per measurement for a device and mode (timed calls >= 3)."""
    if device.type == "cpu":
        return 1, 3
    return (3, 10) if quick else (5, 30)


def run(argv: list[str] | None = None) -> dict:
    """Run the bench; returns the header, the rows and the paths written."""
    args = parse_args(argv)
    ops = args.ops
    if args.dry_run:
        print(f"bench dry run: device={args.device} quick={args.quick} ops={','.join(ops)} out={args.out}")
        return {"header": {}, "rows": [], "paths": {}, "table": ""}
    device = device_for(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    cpu = device.type == "cpu"
    warmup, repeats = defaults(device, args.quick)
    warmup = args.warmup if args.warmup is not None else warmup
    repeats = args.repeats if args.repeats is not None else repeats
    mode = ("quick" if args.quick else "full") + (" (CPU sizes)" if cpu else "")
    l2 = l2_bytes(device)
    timing = (
        f"{warmup} warm-up + {repeats} timed calls per measurement (min / median / max; speedup = ratio of "
        f"medians, every baseline in the same run), "
        + ("perf_counter around each synchronized call" if cpu else "CUDA events around each call, synchronized")
        + f"; inputs rotated over >= {rotation_target_bytes(device, l2) / 2**20:.0f} MiB "
        f"(2x the {l2 / 2**20:.3g} MiB L2{'' if cpu else ', 64-256 MiB'}) where the set count allows"
    )
    found = baselines_module.find(device, dtype)
    notes = []
    if cpu:
        notes.append(f"{report.CPU_LABEL}: kernels run under Triton's interpreter, sizes are tiny")

    started = time.perf_counter()
    rows: list[dict] = []
    timed_baselines: list[str] = []
    for case in cases_module.plan(ops, device, dtype, args.quick, found):
        try:
            first = case.make(0)
            rotation = rotation_for(tensor_bytes(first), device, l2)
            sets = [first, *(case.make(seed) for seed in range(1, rotation.sets))]
        except Exception as exc:  # e.g. out of memory: report the case, go on with the next
            message = f"inputs failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            print(f"  ! {case.op} {case.config}: {message}", file=sys.stderr)
            for name in case.baselines:
                rows.append(_row(case, dtype, name, Timing.failed(), Timing.failed(), "", message))
            continue
        scale = case.repeat_scale
        case_repeats = repeats if cpu else max(3, round(repeats * scale))
        case_warmup = warmup if cpu else max(1, round(warmup * scale)) if warmup else 0
        print(
            f"[{time.perf_counter() - started:7.1f}s] {case.op} {case.config} ({rotation.label()})",
            flush=True,
        )
        ours, ours_note = _measure(case, "samepath", case.samepath, sets, device, case_warmup, case_repeats)
        for name, fn in case.baselines.items():
            base, base_note = _measure(case, name, fn, sets, device, case_warmup, case_repeats)
            note = "; ".join(n for n in (ours_note, base_note) if n)
            rows.append(_row(case, dtype, name, base, ours, rotation.label(), note))
            if name not in timed_baselines:
                timed_baselines.append(name)
        del sets, first, case
        _write_partial(args.out, device, dtype, args.quick, rows, mode, timing, notes, found)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    missing = found.missing_line()
    head = report.header(device, dtype, mode, timing, notes)
    head["samepath_calls"] = cases_module.SAMEPATH_CALLS
    head["baselines_timed"] = ", ".join(timed_baselines) or "none"
    head["baselines_missing"] = missing.partition(": ")[2]
    head["wall_s"] = f"{time.perf_counter() - started:.1f}"
    table = report.format_table(head, rows)
    print(table)
    print(missing)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = report.file_stem(device, dtype, args.quick)
    paths = {"csv": args.out / f"{stem}.csv", "txt": args.out / f"{stem}.txt"}
    report.write_csv(paths["csv"], head, rows)
    paths["txt"].write_text(table + "\n" + missing + "\n")
    if not args.no_png:
        png = args.out / f"{stem}.png"
        if report.write_png(png, head, rows):
            paths["png"] = png
        else:
            print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
    for path in paths.values():
        print(f"wrote {path}")
    return {"header": head, "rows": rows, "paths": paths, "table": table, "missing": missing}


def main(argv: list[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
