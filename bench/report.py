"""The bench's outputs: a printed table, a CSV and a PNG, each headed by device, versions and the
numerics fingerprint. CPU runs are labelled as interpreter numbers on every output."""

from __future__ import annotations

import csv
import datetime
import math
import platform
import re
from pathlib import Path

import torch
import triton

import samepath

#: Columns of the CSV, in order. ``baseline_ms`` / ``samepath_ms`` are medians of ``calls`` timed
#: calls, with their min and max; ``speedup = baseline_ms / samepath_ms`` (> 1: samepath faster).
FIELDS = [
    "op",
    "config",
    "dtype",
    "baseline",
    "baseline_min_ms",
    "baseline_ms",
    "baseline_max_ms",
    "samepath_min_ms",
    "samepath_ms",
    "samepath_max_ms",
    "speedup",
    "calls",
    "unit",
    "baseline_rate",
    "samepath_rate",
    "measures",
    "rotation",
    "note",
]

CPU_LABEL = "CPU (Triton interpreter) — not device numbers"


def device_label(device: torch.device) -> str:
    if device.type == "cpu":
        return CPU_LABEL
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    return str(device)


def header(device: torch.device, dtype: torch.dtype, mode: str, timing: str, notes: list[str]) -> dict[str, str]:
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    out = {
        "device": device_label(device),
        "device_kind": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": hf,
        "python": platform.python_version(),
        "samepath": samepath.__version__,
        "fingerprint": samepath.fingerprint(),
        "mode": mode,
        "timing": timing,
        "speedup": "median baseline ms / median samepath ms (> 1: samepath faster; the bar is >= 0.91, within 10 %)",
    }
    if device.type == "cuda":
        out["cuda"] = str(torch.version.cuda)
    for i, note in enumerate(notes):
        out[f"note{i + 1}"] = note
    return out


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 0.01 or value == 0:
            return f"{value:.3f}"
        return f"{value:.3g}"
    return str(value)


def format_table(head: dict[str, str], rows: list[dict]) -> str:
    """FlashInfer-style table: config | baseline | min / median / max ms of each side | speedup |
    timed calls | rates. Times are wall ms per call unless the config says otherwise (host time)."""
    lines = [f"# {key}: {value}" for key, value in head.items()]
    cols = [
        ("op", "op"),
        ("config", "config"),
        ("baseline", "baseline"),
        ("baseline_min_ms", "base min"),
        ("baseline_ms", "base median"),
        ("baseline_max_ms", "base max"),
        ("samepath_min_ms", "samepath min"),
        ("samepath_ms", "samepath median"),
        ("samepath_max_ms", "samepath max"),
        ("speedup", "speedup"),
        ("calls", "calls"),
        ("samepath_rate", "samepath rate"),
        ("baseline_rate", "baseline rate"),
    ]
    cells = []
    for row in rows:
        cell = {key: _fmt(row[key]) for key, _ in cols}
        for key in ("samepath_rate", "baseline_rate"):
            if cell[key] != "—" and row["unit"]:
                cell[key] = f"{cell[key]} {row['unit']}"
        if row.get("note"):
            cell["baseline"] += f"  [{row['note']}]"
        cells.append(cell)
    widths = {key: max(len(title), *(len(c[key]) for c in cells)) if cells else len(title) for key, title in cols}
    numeric = {key for key, _ in cols[3:]}

    def line(values: dict[str, str]) -> str:
        return " | ".join(
            values[key].rjust(widths[key]) if key in numeric else values[key].ljust(widths[key]) for key, _ in cols
        )

    lines.append(line({key: title for key, title in cols}))
    lines.append("-|-".join("-" * widths[key] for key, _ in cols))
    lines += [line(c) for c in cells]
    if head.get("device_kind") == "cpu":
        lines.append(f"({CPU_LABEL}: these timings only show that the bench runs.)")
    return "\n".join(lines)


def file_stem(device: torch.device, dtype: torch.dtype, quick: bool) -> str:
    if device.type == "cpu":
        where = "cpu-interpreter"
    elif device.type == "cuda":
        where = "cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-")
    else:
        where = device.type
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{datetime.date.today().isoformat()}-{where}-{dtype_name}{'-quick' if quick else ''}"


def write_csv(path: Path, head: dict[str, str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        for key, value in head.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _csv_value(row[key]) for key in FIELDS})


def _csv_value(value: object) -> object:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def read_csv(path: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The header (``# key: value`` lines) and rows of a CSV written by :func:`write_csv`."""
    head: dict[str, str] = {}
    lines = path.read_text().splitlines()
    body = []
    for text in lines:
        if text.startswith("# ") and not body:
            key, _, value = text[2:].partition(": ")
            head[key] = value
        else:
            body.append(text)
    return head, list(csv.DictReader(body))


def write_png(path: Path, head: dict[str, str], rows: list[dict]) -> bool:
    """A bar chart of the speedups; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [r for r in rows if not math.isnan(r["speedup"])]
    labels = [f"{r['op']} {r['config']}\nvs {r['baseline']}" for r in shown]
    values = [r["speedup"] for r in shown]
    # the spread of the timed calls: slowest baseline / fastest samepath call and the reverse
    low = [max(v - r["baseline_min_ms"] / r["samepath_max_ms"], 0.0) for v, r in zip(values, shown, strict=True)]
    high = [max(r["baseline_max_ms"] / r["samepath_min_ms"] - v, 0.0) for v, r in zip(values, shown, strict=True)]
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.42 * len(shown) + 1.6)))
    colors = ["tab:green" if v >= 0.91 else "tab:red" for v in values]
    ax.barh(range(len(shown)), values, color=colors, xerr=[low, high], error_kw={"elinewidth": 0.7, "capsize": 2})
    ax.set_yticks(range(len(shown)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(0.91, color="gray", linestyle="--", linewidth=0.8, label="within 10 %")
    ax.set_xscale("log")
    ax.set_xlabel(
        "speedup = median baseline ms / median samepath ms (log scale; > 1: samepath faster; bars: min-max)", fontsize=8
    )
    title = f"samepath vs baselines — {head['device']}, {head['dtype']}\n"
    title += f"torch {head['torch']}, triton {head['triton']}, fingerprint {head['fingerprint']}, {head['date']}"
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
