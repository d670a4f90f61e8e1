"""Attention benchmark: samepath's kernels against stock PyTorch SDPA, measured in the same run.

    python bench/bench_attention.py [--device cpu|cuda] [--out bench/results]

Prints a table (config | baseline ms | samepath ms | speedup) and writes it as CSV with the
device, versions and numerics fingerprint. On the CPU the kernels run under Triton's interpreter:
those numbers only show that the bench runs and are labelled so; they say nothing about a GPU/NPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import samepath
from samepath.kernels.attention import paged_attention, varlen_attention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _varlen_case(lens: list[int], heads: int, kv_heads: int, head_size: int, dtype, device):
    total = sum(lens)
    q = torch.randn(total, heads, head_size, dtype=dtype, device=device)
    k = torch.randn(total, kv_heads, head_size, dtype=dtype, device=device)
    v = torch.randn_like(k)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    starts = cu.tolist()

    def ours():
        return varlen_attention(q, k, v, cu, validate=False)

    def baseline():
        for s, e in itertools.pairwise(starts):
            F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )

    return ours, baseline


def _decode_case(batch: int, context: int, heads: int, kv_heads: int, head_size: int, dtype, device):
    page = 16
    pages_per_seq = (context + page - 1) // page
    k_cache = torch.randn(batch * pages_per_seq, page, kv_heads, head_size, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, pages_per_seq)
    q = torch.randn(batch, heads, head_size, dtype=dtype, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_dense = k_cache.view(batch, -1, kv_heads, head_size)[:, :context].transpose(1, 2)
    v_dense = v_cache.view(batch, -1, kv_heads, head_size)[:, :context].transpose(1, 2)

    def ours():
        return paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, head_size**-0.5, validate=False)

    def baseline():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)

    return ours, baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    interpreted = device.type == "cpu"
    if interpreted:
        cases = {
            "varlen fwd lens=[100,37] H=8/2 D=128": _varlen_case([100, 37], 8, 2, 128, dtype, device),
            "paged decode B=4 ctx=128 H=8/2 D=128": _decode_case(4, 128, 8, 2, 128, dtype, device),
        }
        warmup, repeats = 1, 3
    else:
        cases = {
            "varlen fwd 8x1024 H=32/8 D=128": _varlen_case([1024] * 8, 32, 8, 128, dtype, device),
            "varlen fwd 4x4093 H=32/8 D=128": _varlen_case([4093] * 4, 32, 8, 128, dtype, device),
            **{
                f"paged decode B={b} ctx={c} H=32/8 D=128": _decode_case(b, c, 32, 8, 128, dtype, device)
                for b in (1, 32, 128)
                for c in (1024, 8192)
            },
        }
        warmup, repeats = 10, 50

    label = "CPU (Triton interpreter; NOT device numbers)" if interpreted else torch.cuda.get_device_name(device)
    rows = []
    for name, (ours, baseline) in cases.items():
        base_ms = median_ms(baseline, device, warmup, repeats)
        ours_ms = median_ms(ours, device, warmup, repeats)
        rows.append(
            {
                "config": name,
                "baseline": "torch SDPA",
                "baseline_ms": f"{base_ms:.3f}",
                "samepath_ms": f"{ours_ms:.3f}",
                "speedup": f"{base_ms / ours_ms:.3f}",
            }
        )

    print(
        f"device: {label} | dtype {args.dtype} | torch {torch.__version__} | triton {triton.__version__} | "
        f"samepath {samepath.__version__} | fingerprint {samepath.fingerprint()}"
    )
    width = max(len(r["config"]) for r in rows)
    print(f"{'config':<{width}} | baseline ms | samepath ms | speedup")
    for r in rows:
        print(f"{r['config']:<{width}} | {r['baseline_ms']:>11} | {r['samepath_ms']:>11} | {r['speedup']:>7}")

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path = args.out / f"{stamp}-attention-{device.type}-{args.dtype}.csv"
    with path.open("w", newline="") as f:
        f.write(
            f"# device: {label}; torch {torch.__version__}; triton {triton.__version__}; "
            f"fingerprint {samepath.fingerprint()}\n"
        )
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
