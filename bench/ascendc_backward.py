"""The Ascend C attention backward on an NPU: time against the Triton-Ascend backward and
``torch_npu.npu_fusion_attention_grad``, and bitwise determinism of each timed call.

    python bench/ascendc_backward.py --device npu [--out ascendc_backward.json] [--repeats 5]
    python bench/ascendc_backward.py --dry-run      # list the cases and exit (no device needed)

Per case (packed causal training batch, GQA), from one forward's ``out`` and ``lse``:

* ``ascendc``: ``loader.attention_backward`` (``csrc/flash_attention_bwd.cpp``, the one-pass schedule
  ``simulate.simulate_backward`` replays), delta by samepath's row-sum kernel included;
* ``triton``: ``samepath.kernels.attention._attention_backward`` with the Triton backend (Triton-Ascend);
* ``torch_npu``: ``torch_npu.npu_fusion_attention_grad`` (TND layout, ``sparse_mode=3`` causal mask,
  softmax statistics from ``npu_fusion_attention``), where importable; otherwise the row says why.

Each implementation's gradients must be bitwise equal across its timed calls (``deterministic``);
the Ascend C and Triton gradients are not expected to be bitwise equal to each other (different
instructions: docs/backends.md), only close (``max_abs_diff_vs_triton``). Speed is reported, never
asserted. Results go to ``--out`` after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.timing import device_for, measure

#: (name, dtype, num_heads, num_kv_heads, head_size, sequence lengths)
CASES = (
    ("bf16_h128_gqa4_2x2048", torch.bfloat16, 32, 8, 128, (2048, 2048)),
    ("bf16_h128_gqa4_varlen", torch.bfloat16, 32, 8, 128, (3000, 700, 300, 97)),
    ("fp16_h64_gqa2_4x1024", torch.float16, 16, 8, 64, (1024,) * 4),
)
SMALL_CASES = (("bf16_h64_gqa2_small", torch.bfloat16, 4, 2, 64, (40, 9)),)


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    from samepath.ascendc_fallback import loader

    before = os.environ.get(loader.BACKEND_ENV)
    os.environ[loader.BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(loader.BACKEND_ENV, None)
        else:
            os.environ[loader.BACKEND_ENV] = before


def _inputs(case, device: torch.device):
    from samepath.kernels.attention import _launch_forward
    from samepath.kernels.config import attention_config

    _, dtype, heads, kv_heads, head, lens = case
    gen = torch.Generator().manual_seed(17)
    total = sum(lens)
    q, k, v, g = (
        torch.randn(total, h, head, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    config = attention_config(head, dtype, device)
    scale = head**-0.5
    out = torch.empty_like(q)
    with _backend("triton"):
        lse = _launch_forward(q, k, v, cu, cu, cu[1:] - cu[:-1], None, scale, True, None, config, True, out)
    return q, k, v, g, out, lse, cu, scale, config


def _samepath_backward(backend: str, inputs) -> Callable[[object], list[torch.Tensor]]:
    from samepath.ascendc_fallback import loader
    from samepath.kernels.attention import _attention_backward

    q, k, v, g, out, lse, cu, scale, config = inputs

    def run(_):
        with _backend(backend):
            if backend == "ascendc":
                return list(loader.attention_backward(q, k, v, out, lse, g, cu, scale, True, None, config))
            return list(_attention_backward(q, k, v, out, lse, g, cu, scale, True, None, config))

    return run


def _torch_npu_backward(inputs) -> tuple[Callable[[object], list[torch.Tensor]] | None, str]:
    try:
        import torch_npu
    except Exception as exc:  # torch_npu raises plain Exceptions when CANN does not load
        return None, f"torch_npu not importable: {type(exc).__name__}: {exc}"
    if not hasattr(torch_npu, "npu_fusion_attention_grad"):
        return None, "torch_npu has no npu_fusion_attention_grad"
    q, k, v, g, _, _, cu, scale, _ = inputs
    heads = q.shape[1]
    seq = cu[1:].tolist()
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1)
    forward = torch_npu.npu_fusion_attention(
        q, k, v, heads, "TND", atten_mask=mask, scale=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq, sparse_mode=3
    )
    attention_out, softmax_max, softmax_sum = forward[0], forward[1], forward[2]

    def run(_):
        grads = torch_npu.npu_fusion_attention_grad(
            q, k, v, g, heads, "TND", atten_mask=mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
            attention_in=attention_out, scale_value=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq, sparse_mode=3,
        )  # fmt: skip
        return list(grads[:3])

    return run, "TND, sparse_mode=3 (causal), softmax statistics from npu_fusion_attention"


def bench_case(case, device: torch.device, warmup: int, repeats: int) -> list[dict]:
    inputs = _inputs(case, device)
    rows, reference = [], None
    impls: list[tuple[str, Callable | None, str]] = [
        ("triton", _samepath_backward("triton", inputs), "Triton backward (Triton-Ascend on an NPU)"),
        ("ascendc", _samepath_backward("ascendc", inputs), "csrc/flash_attention_bwd.cpp, one launch"),
    ]
    try:
        fn, note = _torch_npu_backward(inputs)
    except Exception as exc:
        fn, note = None, f"npu_fusion_attention failed: {type(exc).__name__}: {exc}"
    impls.append(("torch_npu", fn, note))
    for impl, fn, note in impls:
        row = dict(case=case[0], impl=impl, note=note)
        if fn is None:
            row["skipped"] = note
            rows.append(row)
            continue
        try:
            first = fn(None)
            timing = measure(fn, [None], device, warmup, repeats)
            again = fn(None)
            row.update(min_ms=timing.min_ms, median_ms=timing.median_ms, max_ms=timing.max_ms, n=timing.n)
            row["deterministic"] = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
            if impl == "triton":
                reference = first
            elif reference is not None:
                row["max_abs_diff_vs_triton"] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(first, reference, strict=True)
                )
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["trace"] = traceback.format_exc()
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="npu")
    parser.add_argument("--out", type=Path, default=None, help="JSON results, rewritten after every case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="one tiny case: smoke-test the script")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit (no device needed)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = SMALL_CASES if args.small else CASES
    if args.dry_run:
        names = ",".join(c[0] for c in cases)
        print(f"ascendc_backward dry run: device={args.device} cases={names} impls=triton,ascendc,torch_npu")
        return 0
    device = device_for(args.device)
    summary: dict = {"device": str(device), "results": []}
    failed = 0
    for case in cases:
        started = time.perf_counter()
        try:
            rows = bench_case(case, device, args.warmup, args.repeats)
        except Exception as exc:
            rows = [dict(case=case[0], error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())]
        for row in rows:
            if "error" in row or row.get("deterministic") is False:
                failed += 1
            detail = (
                row.get("error")
                or row.get("skipped")
                or (f"median {row['median_ms']:.3f} ms, deterministic {row['deterministic']}")
            )
            print(f"{row['case']} {row.get('impl', '-')}: {detail}", flush=True)
        summary["results"] += rows
        summary["failed"] = failed
        print(f"{case[0]}: {time.perf_counter() - started:.1f}s", flush=True)
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
