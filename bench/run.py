"""Run the benchmarks: ``python -m bench`` or ``python bench/run.py``.

    python -m bench [--device cpu|cuda] [--dtype bfloat16] [--quick] [--ops a,b] [--out DIR]

For every case the stock baselines and samepath run on the same inputs, in the same process, on
the same device: warm-up calls first (they include Triton's compilation), then the median of the
timed calls, each bracketed by device synchronization, cycling through several input sets so that
no set stays cache-resident between its calls. Writes ``<date>-<device>-<dtype>.csv``, ``.txt``
(the printed table) and ``.png`` (when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import cases as cases_module
from bench import report
from bench.timing import median_ms, rotation_count, tensor_bytes

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
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (default by device and mode)")
    parser.add_argument("--no-png", action="store_true", help="skip the plot")
    return parser.parse_args(argv)


def _measure(case, impl: str, fn, sets, device, warmup: int, repeats: int) -> tuple[float, str]:
    context = case.context(impl) if case.context else None
    try:
        if context is None:
            return median_ms(fn, sets, device, warmup, repeats), ""
        with context:
            return median_ms(fn, sets, device, warmup, repeats), ""
    except Exception as exc:  # a baseline that does not support this shape must not end the run
        message = f"{impl} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        print(f"  ! {message}", file=sys.stderr)
        return float("nan"), message


def run(argv: list[str] | None = None) -> dict:
    """Run the bench; returns the header, the rows and the paths written."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(cases_module.OPS))
    if unknown:
        raise SystemExit(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(cases_module.OPS)}")
    cpu = device.type == "cpu"
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1) if cpu else (3 if args.quick else 5)
    repeats = (
        args.repeats if args.repeats is not None else (1 if args.quick else 3) if cpu else (10 if args.quick else 30)
    )
    mode = ("quick" if args.quick else "full") + (" (CPU sizes)" if cpu else "")
    timing = f"{warmup} warm-up + median of {repeats} timed calls per measurement, input sets cycled, " + (
        "perf_counter" if cpu else "CUDA events, synchronized"
    )
    opt = cases_module.optional_baselines(device, dtype)
    notes = [*opt.notes]
    if cpu:
        notes.insert(0, f"{report.CPU_LABEL}: kernels run under Triton's interpreter, sizes are tiny")

    started = time.perf_counter()
    rows: list[dict] = []
    for case in cases_module.plan(ops, device, dtype, args.quick, opt):
        try:
            first = case.make(0)
            n_sets = rotation_count(tensor_bytes(first), device)
            sets = [first, *(case.make(seed) for seed in range(1, n_sets))]
        except Exception as exc:  # e.g. out of memory: report the case, go on with the next
            message = f"inputs failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            print(f"  ! {case.op} {case.config}: {message}", file=sys.stderr)
            nan = float("nan")
            for name in case.baselines:
                rows.append(
                    dict(
                        op=case.op,
                        config=case.config,
                        dtype=str(dtype).removeprefix("torch."),
                        baseline=name,
                        baseline_ms=nan,
                        samepath_ms=nan,
                        speedup=nan,
                        unit=case.unit,
                        baseline_rate=nan,
                        samepath_rate=nan,
                        note=message,
                    )
                )
            continue
        case_repeats = max(1, round(repeats * case.repeat_scale)) if not cpu else repeats
        case_warmup = max(1, round(warmup * case.repeat_scale)) if warmup and not cpu else warmup
        print(f"[{time.perf_counter() - started:7.1f}s] {case.op} {case.config} ({n_sets} input sets)", flush=True)
        ours_ms, ours_note = _measure(case, "samepath", case.samepath, sets, device, case_warmup, case_repeats)
        for name, fn in case.baselines.items():
            base_ms, base_note = _measure(case, name, fn, sets, device, case_warmup, case_repeats)
            unit, base_rate = case.rate(base_ms)
            _, ours_rate = case.rate(ours_ms)
            rows.append(
                {
                    "op": case.op,
                    "config": case.config,
                    "dtype": str(dtype).removeprefix("torch."),
                    "baseline": name,
                    "baseline_ms": base_ms,
                    "samepath_ms": ours_ms,
                    "speedup": base_ms / ours_ms if ours_ms and not math.isnan(ours_ms) else float("nan"),
                    "unit": unit,
                    "baseline_rate": base_rate,
                    "samepath_rate": ours_rate,
                    "note": "; ".join(n for n in (ours_note, base_note) if n),
                }
            )
        del sets, first, case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes += [n for n in opt.notes if n not in notes]
    head = report.header(device, dtype, mode, timing, notes)
    head["wall_s"] = f"{time.perf_counter() - started:.1f}"
    table = report.format_table(head, rows)
    print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = report.file_stem(device, dtype, args.quick)
    paths = {"csv": args.out / f"{stem}.csv", "txt": args.out / f"{stem}.txt"}
    report.write_csv(paths["csv"], head, rows)
    paths["txt"].write_text(table + "\n")
    if not args.no_png:
        png = args.out / f"{stem}.png"
        if report.write_png(png, head, rows):
            paths["png"] = png
        else:
            print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
    for path in paths.values():
        print(f"wrote {path}")
    return {"header": head, "rows": rows, "paths": paths, "table": table}


def main(argv: list[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
