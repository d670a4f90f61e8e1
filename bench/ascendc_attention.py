"""The Ascend C attention on an NPU — training forward, paged decode and backward — timed against
the Triton-Ascend kernels and the stock NPU kernels, with bitwise determinism of each timed call.

    python bench/ascendc_attention.py --device npu [--out ascendc_attention.json] [--repeats 5]
    python bench/ascendc_attention.py --passes decode --device npu
    python bench/ascendc_attention.py --dry-run      # list the passes and cases and exit (no device needed)

Implementations per pass, each called the way samepath's integrations call it:

* ``ascendc``: ``SAMEPATH_ATTENTION_BACKEND=ascendc`` — ``samepath.varlen_attention`` (training forward),
  ``samepath.paged_attention`` (decode over vLLM-style paged caches, block size 128, vllm-ascend's) and
  the backward of ``samepath.kernels.attention.run_backward`` (``csrc/flash_attention_bwd.cpp``, the one-pass
  schedule ``ascendc.replay.simulate_backward`` replays, delta computed in the Ascend C kernel);
* ``triton``: the same calls on the Triton backend (Triton-Ascend);
* ``torch_npu``: ``npu_fusion_attention`` (forward: TND, causal ``sparse_mode=3``),
  ``npu_fused_infer_attention_score`` (decode: TND over the paged caches, as vllm-ascend's decode calls
  it) and ``npu_fusion_attention_grad`` (backward), where torch_npu has them;
* ``flash_attn_npu``: ``flash_attn_npu_v3.flash_attn_with_kvcache`` with ``num_splits=1`` (decode; the
  consistent FlashAttention vllm-ascend's ``AscendFAImpl`` runs), where it imports.

Each implementation's outputs must be bitwise equal across its timed calls (``deterministic``); the
implementations are not expected to be bitwise equal to each other (different instructions:
docs/backends.md), only close (``max_abs_diff_vs_triton``). Every row carries its median time and,
when the stock kernel ran in the same run, ``stock_over_this`` (the stock median over this one's:
above 1 means faster than stock). Speed is reported, never asserted. A stock kernel that fails is
recorded with its error; only samepath's own rows (an error, or a nondeterministic one) make the exit
status non-zero. Results go to ``--out`` after every case.
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

PASSES = ("forward", "decode", "backward")
#: The implementations samepath owns (their failures fail the run) and the stock baselines.
SAMEPATH_IMPLS = ("triton", "ascendc")
STOCK_IMPLS = ("torch_npu", "flash_attn_npu")

#: Training (forward and backward): (name, dtype, num_heads, num_kv_heads, head_size, sequence lengths)
CASES = (
    ("bf16_h128_gqa4_2x2048", torch.bfloat16, 32, 8, 128, (2048, 2048)),
    ("bf16_h128_gqa4_varlen", torch.bfloat16, 32, 8, 128, (3000, 700, 300, 97)),
    ("fp16_h64_gqa2_4x1024", torch.float16, 16, 8, 64, (1024,) * 4),
)
#: Decode (one new query per sequence): (name, dtype, num_heads, num_kv_heads, head_size, KV lengths)
DECODE_CASES = (
    ("bf16_h128_gqa4_decode_32x4096", torch.bfloat16, 32, 8, 128, (4096,) * 32),
    ("bf16_h128_gqa8_decode_varlen", torch.bfloat16, 64, 8, 128, (8191, 2048, 1000, 513, 129, 64, 17, 3)),
)
SMALL_CASES = (("bf16_h64_gqa2_small", torch.bfloat16, 4, 2, 64, (40, 9)),)
SMALL_DECODE_CASES = (("bf16_h64_gqa2_decode_small", torch.bfloat16, 4, 2, 64, (40, 9, 130)),)
#: vllm-ascend's KV block size.
BLOCK_SIZE = 128
#: The causal mask npu_fusion_attention's sparse_mode=3 takes (vllm-ascend's 2048 x 2048).
MASK_SIZE = 2048

Run = Callable[[object], list[torch.Tensor]]


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    from samepath.kernels.attention import BACKEND_ENV

    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


def _training_inputs(case, device: torch.device) -> dict:
    from samepath.kernels.attention import AttentionBatch, run_forward
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
    batch = AttentionBatch(q, k, v, cu, cu, cu[1:] - cu[:-1], None, scale, True, None, config)
    with _backend("triton"):
        lse = run_forward(batch, out, store_lse=True)
    return dict(q=q, k=k, v=v, g=g, out=out, lse=lse, cu=cu, scale=scale, config=config, batch=batch)


def _decode_inputs(case, device: torch.device) -> dict:
    """One new query per sequence over paged caches ``[num_blocks, BLOCK_SIZE, kv_heads, head]``
    whose pages are shuffled (a block table as a long-running engine has it)."""
    _, dtype, heads, kv_heads, head, kv_lens = case
    gen = torch.Generator().manual_seed(23)
    pages = [-(-n // BLOCK_SIZE) for n in kv_lens]
    num_blocks = sum(pages) + 1
    key_cache, value_cache = (
        torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head, generator=gen).to(device, dtype) for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    start = 0
    for row, n in enumerate(pages):
        block_table[row, :n] = order[start : start + n]
        start += n
    q = torch.randn(len(kv_lens), heads, head, generator=gen).to(device, dtype)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        query_start_loc=torch.arange(len(kv_lens) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        scale=head**-0.5,
    )


def _samepath(pass_name: str, backend: str, x: dict) -> Run:
    import samepath
    from samepath.kernels.attention import run_backward

    def run(_):
        with _backend(backend), torch.no_grad():
            if pass_name == "forward":
                return [samepath.varlen_attention(x["q"], x["k"], x["v"], x["cu"], x["scale"], True)]
            if pass_name == "decode":
                args = ("q", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens", "scale")
                return [samepath.paged_attention(*(x[name] for name in args))]
            return list(run_backward(x["batch"], x["out"], x["lse"], x["g"]))

    return run


def _torch_npu(pass_name: str, x: dict) -> tuple[Run | None, str]:
    try:
        import torch_npu
    except Exception as exc:  # torch_npu raises plain Exceptions when CANN does not load
        return None, f"torch_npu not importable: {type(exc).__name__}: {exc}"
    needed = {"forward": "npu_fusion_attention", "decode": "npu_fused_infer_attention_score"}
    needed["backward"] = "npu_fusion_attention_grad"
    if not hasattr(torch_npu, needed[pass_name]):
        return None, f"torch_npu has no {needed[pass_name]}"
    if pass_name == "decode":
        num_blocks, block_size, kv_heads, head = x["key_cache"].shape
        key, value = (x[name].view(num_blocks, block_size, kv_heads * head) for name in ("key_cache", "value_cache"))
        query_ends, kv_lens = x["query_start_loc"][1:].tolist(), x["seq_lens"].tolist()

        def decode(_):
            out, _ = torch_npu.npu_fused_infer_attention_score(
                query=x["q"], key=key, value=value, block_table=x["block_table"], input_layout="TND",
                block_size=block_size, actual_seq_lengths=query_ends, actual_seq_lengths_kv=kv_lens,
                num_key_value_heads=kv_heads, num_heads=x["q"].shape[1], scale=x["scale"], sparse_mode=0,
            )  # fmt: skip
            return [out]

        return decode, "TND over the paged caches, sparse_mode=0 (one query per sequence), as vllm-ascend decodes"
    q, k, v, scale = x["q"], x["k"], x["v"], x["scale"]
    heads, seq = q.shape[1], x["cu"][1:].tolist()
    mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=q.device), diagonal=1)

    def forward(_):
        return list(
            torch_npu.npu_fusion_attention(
                q, k, v, heads, "TND", atten_mask=mask, scale=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq,
                sparse_mode=3,
            )[:1]
        )  # fmt: skip

    if pass_name == "forward":
        return forward, "TND, sparse_mode=3 (causal)"
    stats = torch_npu.npu_fusion_attention(
        q, k, v, heads, "TND", atten_mask=mask, scale=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq, sparse_mode=3
    )

    def backward(_):
        grads = torch_npu.npu_fusion_attention_grad(
            q, k, v, x["g"], heads, "TND", atten_mask=mask, softmax_max=stats[1], softmax_sum=stats[2],
            attention_in=stats[0], scale_value=scale, actual_seq_qlen=seq, actual_seq_kvlen=seq, sparse_mode=3,
        )  # fmt: skip
        return list(grads[:3])

    return backward, "TND, sparse_mode=3 (causal), softmax statistics from npu_fusion_attention"


def _flash_attn_npu(pass_name: str, x: dict) -> tuple[Run | None, str]:
    if pass_name != "decode":
        return None, "not applicable: flash_attn_with_kvcache reads a paged cache (the decode pass)"
    try:
        from flash_attn_npu_v3 import flash_attn_with_kvcache
    except Exception as exc:
        return None, f"flash_attn_npu_v3 not importable: {type(exc).__name__}: {exc}"

    def decode(_):
        return [
            flash_attn_with_kvcache(
                x["q"], x["key_cache"], x["value_cache"], cache_seqlens=x["seq_lens"], page_table=x["block_table"],
                cu_seqlens_q=x["query_start_loc"], max_seqlen_q=1, causal=False, window_size=[-1, -1],
                num_splits=1,
            )
        ]  # fmt: skip

    return decode, "flash_attn_with_kvcache, num_splits=1 (split-free: batch-invariant)"


def _guarded(build: Callable[[], tuple[Run | None, str]]) -> tuple[Run | None, str]:
    try:
        return build()
    except Exception as exc:
        return None, f"setup failed: {type(exc).__name__}: {exc}"


def bench_case(pass_name: str, case, device: torch.device, warmup: int, repeats: int) -> list[dict]:
    x = _decode_inputs(case, device) if pass_name == "decode" else _training_inputs(case, device)
    impls: list[tuple[str, Run | None, str]] = [
        ("triton", _samepath(pass_name, "triton", x), "Triton (Triton-Ascend on an NPU)"),
        ("ascendc", _samepath(pass_name, "ascendc", x), "SAMEPATH_ATTENTION_BACKEND=ascendc"),
        ("torch_npu", *_guarded(lambda: _torch_npu(pass_name, x))),
        ("flash_attn_npu", *_guarded(lambda: _flash_attn_npu(pass_name, x))),
    ]
    rows, reference = [], None
    for impl, fn, note in impls:
        row = dict({"pass": pass_name}, case=case[0], impl=impl, note=note)
        rows.append(row)
        if fn is None:
            row["skipped"] = note
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
    stock = next((r["median_ms"] for r in rows if r["impl"] == "torch_npu" and "median_ms" in r), None)
    for row in rows:
        if stock is not None and "median_ms" in row:
            row["stock_over_this"] = stock / row["median_ms"]
    return rows


def _summary(row: dict) -> str:
    if "error" in row or "skipped" in row:
        return row.get("error") or row["skipped"]
    ratio = f", stock/this {row['stock_over_this']:.2f}x" if "stock_over_this" in row else ""
    return f"median {row['median_ms']:.3f} ms, deterministic {row['deterministic']}{ratio}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="npu")
    parser.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated, of {', '.join(PASSES)}")
    parser.add_argument("--out", type=Path, default=None, help="JSON results, rewritten after every case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny cases: smoke-test the script")
    parser.add_argument("--dry-run", action="store_true", help="list the passes and cases and exit (no device needed)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    unknown = sorted(set(args.passes) - set(PASSES))
    if unknown or not args.passes:
        parser.error(f"--passes takes {', '.join(PASSES)}; got {unknown or 'nothing'}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = [
        (name, case)
        for name in args.passes
        for case in (
            (SMALL_DECODE_CASES if args.small else DECODE_CASES)
            if name == "decode"
            else (SMALL_CASES if args.small else CASES)
        )
    ]
    if args.dry_run:
        cases = ",".join(f"{name}:{case[0]}" for name, case in plan)
        passes, impls = ",".join(args.passes), ",".join(SAMEPATH_IMPLS + STOCK_IMPLS)
        print(f"ascendc_attention dry run: device={args.device} passes={passes} impls={impls} cases={cases}")
        return 0
    device = device_for(args.device)
    summary: dict = {"device": str(device), "results": [], "failed": 0}
    for pass_name, case in plan:
        started = time.perf_counter()
        try:
            rows = bench_case(pass_name, case, device, args.warmup, args.repeats)
        except Exception as exc:
            rows = [{"pass": pass_name, "case": case[0], "error": f"{type(exc).__name__}: {exc}"}]
            rows[0]["trace"] = traceback.format_exc()
        for row in rows:
            if row.get("impl", "triton") in SAMEPATH_IMPLS and ("error" in row or row.get("deterministic") is False):
                summary["failed"] += 1
            print(f"{pass_name} {row['case']} {row.get('impl', '-')}: {_summary(row)}", flush=True)
        summary["results"] += rows
        print(f"{pass_name} {case[0]}: {time.perf_counter() - started:.1f}s", flush=True)
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
