"""Paged decode against the block table's width: the time of one decode step's attention with a
tight block table and with one as wide as a long ``max_model_len`` (vLLM's), same sequences.

``python -m bench.decode_width`` (CPU: the kernels' replays; ``--device cuda`` on a GPU). Each
call is :func:`samepath.paged_attention` as vLLM's integration makes it (a ``LaunchPlan``,
``validate=False``) and, for reference, the public default (``validate=True``: one device-to-host
copy of the metadata, the block table's used pages included). The ratio wide / tight is the
issue-31 figure (129x before the split schedule's work list). ``--vllm`` adds one decode step's
attention through vLLM's patched backend (``CPUAttentionBackendImpl``; vllm must be installed):
the wall time of the step's layers on the host and the device-to-host reads counted, in the
default mode and with ``SAMEPATH_VLLM_VALIDATE=1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

from samepath.kernels import dispatch
from samepath.kernels.attention import LaunchPlan, paged_attention

FORWARD = "samepath.kernels.attention.forward._attention_fwd_kernel"


def _min_median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def decode_inputs(batch: int, context: int, width: int, heads: int, kv_heads: int, head: int, dtype, device):
    """A decode step over ``batch`` sequences of ``context`` cached positions (plus the new one),
    pages shuffled; a tight table and one ``width`` pages wide (its extra columns hold page ids
    inside the cache, as a padded table may)."""
    page = 16
    span = context + 1
    pages = -(-span // page)
    gen = torch.Generator().manual_seed(0)
    num_pages = batch * pages + 1
    order = torch.randperm(num_pages, generator=gen)[: batch * pages].view(batch, pages).to(torch.int32)
    wide = torch.randint(0, num_pages, (batch, width), generator=gen, dtype=torch.int32)
    wide[:, :pages] = order
    kc = torch.randn(num_pages, page, kv_heads, head, generator=gen).to(dtype)
    vc = torch.randn(num_pages, page, kv_heads, head, generator=gen).to(dtype)
    query = torch.randn(batch, heads, head, generator=gen).to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), span, dtype=torch.int32)
    moved = [t.to(device) for t in (query, kc, vc, order, wide, qsl, seq_lens)]
    return moved


def width_rows(args) -> list[str]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    query, kc, vc, tight, wide, qsl, seq_lens = decode_inputs(
        args.batch, args.context, args.width, args.heads, args.kv_heads, args.head, dtype, device
    )
    scale = args.head**-0.5
    launches: list[int] = []
    original = dispatch.replay_for(FORWARD)

    def counted(grid, **p):
        launches.append(grid[0])
        return original(grid, **p)

    rows = []
    results = {}
    for label, table in (("tight", tight), ("wide", wide)):
        for mode in ("integration", "public"):
            if mode == "integration":
                plan = LaunchPlan(qsl, args.batch)

                def call(table=table, plan=plan):
                    return paged_attention(query, kc, vc, table, qsl, seq_lens, scale, validate=False, plan=plan)

            else:

                def call(table=table):
                    return paged_attention(query, kc, vc, table, qsl, seq_lens, scale)

            results[label, mode] = _min_median_ms(call, device, args.repeats)
        with ExitStack() as stack:
            if device.type == "cpu":
                stack.enter_context(_wrapped_replay(counted))
            launches.clear()
            out = paged_attention(query, kc, vc, table, qsl, seq_lens, scale, validate=False)
        results[label, "out"] = out
        results[label, "grid"] = list(launches)
    same = torch.equal(results["tight", "out"], results["wide", "out"])
    rows.append(
        f"batch {args.batch}, context {args.context} (+1 new token), {args.heads} q / {args.kv_heads} KV heads, "
        f"head {args.head}, {args.dtype}, page 16; tight table {tight.shape[1]} pages, wide {args.width} pages"
    )
    executor = dispatch.current_cpu_executor() if device.type == "cpu" else "triton"
    rows.append(f"device: {_device_name(device)}; executor: {executor}")
    rows.append(f"{args.repeats} timed calls after a warm-up: min / median ms; wide/tight of the min / of the median")
    for mode, what in (("integration", "LaunchPlan, validate=False (vLLM's call)"), ("public", "validate=True")):
        (t_min, t_med), (w_min, w_med) = results["tight", mode], results["wide", mode]
        rows.append(
            f"{what:42s} tight {t_min:8.3f} / {t_med:8.3f}   wide {w_min:8.3f} / {w_med:8.3f}   "
            f"wide/tight {w_min / t_min:6.2f} / {w_med / t_med:6.2f}"
        )
    if device.type == "cpu":
        rows.append(f"forward grid (programs): tight {results['tight', 'grid']}  wide {results['wide', 'grid']}")
    rows.append(f"same bits (torch.equal): {same}")
    return rows


class _wrapped_replay:
    def __init__(self, replay) -> None:
        self.replay = replay

    def __enter__(self):
        self.saved = dispatch.replay_for(FORWARD)
        dispatch._replays[FORWARD] = self.replay
        return self

    def __exit__(self, *exc) -> None:
        dispatch._replays[FORWARD] = self.saved


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores visible)"


def vllm_rows(args) -> list[str]:
    """One decode step's attention layers through vLLM's patched CPU backend: host wall time and
    device-to-host reads per step, default mode against ``SAMEPATH_VLLM_VALIDATE=1``."""
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from host_counts import OpCounter

    found = SimpleNamespace(missing={})
    device = torch.device(args.device)
    case = vllm_decode_step_case(
        args.batch, args.context, args.width, args.layers, args.heads, args.kv_heads, args.head,
        getattr(torch, args.dtype), device, found,
    )  # fmt: skip
    if case is None:
        return [f"vLLM decode step: skipped ({found.missing})"]
    rows = [f"vLLM decode step: {case.config}; {case.what}"]
    for name, fn in (("default", case.samepath), *case.baselines.items()):
        with case.context("samepath" if name == "default" else name):
            timing = case.timer(fn, [None], device, 2, args.repeats)
            with OpCounter() as counter:
                fn(None)
        rows.append(f"  {name:36s} host {timing.median_ms:9.3f} ms per step   host reads per step {counter.reads}")
    return rows


def _host_step_timer(fn, sets, device, warmup: int, repeats: int):
    """Wall time of each call with no device synchronization: on a device, the host's time to
    issue the step's work (metadata checks and host syncs included)."""
    from bench.timing import Timing

    n = len(sets)
    for i in range(warmup):
        fn(sets[i % n])
    times = []
    for i in range(max(repeats, 1)):
        start = time.perf_counter()
        fn(sets[(warmup + i) % n])
        times.append((time.perf_counter() - start) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times.sort()
    return Timing(times[0], times[len(times) // 2], times[-1], len(times))


def vllm_decode_step_case(batch: int, context: int, width: int, layers: int, heads: int, kv_heads: int, head: int,
                          dtype, device, found):  # fmt: skip
    """The bench's ``vllm_decode_step`` case: one decode step's ``layers`` attention layers (KV
    write + attention) through vLLM's patched backend, host time per step, in the default mode
    (samepath) against ``SAMEPATH_VLLM_VALIDATE=1`` (the per-step debug checks); ``None`` (and the
    reason in ``found.missing``) where vLLM does not import."""
    from contextlib import contextmanager

    from bench.cases import Case

    try:
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata
    except Exception as error:
        found.missing["vLLM decode step"] = f"vLLM's attention backend does not import: {type(error).__name__}"
        return None
    from samepath.integrations import vllm as samepath_vllm

    block = 16
    query, _, _, _, wide, qsl, seq_lens = decode_inputs(batch, context, width, heads, kv_heads, head, dtype, device)
    num_pages = int(wide.max()) + 1
    last = (seq_lens - 1).long()
    slot_mapping = wide[torch.arange(batch, device=device), last // block].long() * block + last % block
    gen = torch.Generator().manual_seed(1)
    cache_shape = (num_pages, kv_heads, block, 2 * head)
    caches = [torch.randn(cache_shape, generator=gen).to(dtype).to(device) for _ in range(layers)]
    impls = []
    for _ in range(layers):
        impl = object.__new__(CPUAttentionBackendImpl)  # the patched forward is the same for every backend
        impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = heads, kv_heads, head, head**-0.5
        impl.sliding_window, impl.attn_type, impl.kv_cache_dtype = None, AttentionType.DECODER, "auto"
        impl.alibi_slopes, impl.sinks, impl.logits_soft_cap = None, None, None
        impls.append(impl)
    q2d = query.reshape(batch, heads * head)
    key = torch.randn(batch, kv_heads, head, generator=gen).to(dtype).to(device)
    output = torch.zeros(batch, heads * head, dtype=dtype, device=device)

    def step(_inputs):
        attn_metadata = CPUAttentionMetadata(
            num_actual_tokens=batch, max_query_len=1, query_start_loc=qsl, max_seq_len=context + 1,
            seq_lens=seq_lens, block_table=wide, slot_mapping=slot_mapping, scheduler_metadata=None,
        )  # fmt: skip
        for impl, kv_cache in zip(impls, caches, strict=True):
            impl.do_kv_cache_update(None, key, key, kv_cache, slot_mapping)
            impl.forward(None, q2d, key, key, kv_cache, attn_metadata, output)
        return output

    debug = "samepath, SAMEPATH_VLLM_VALIDATE=1"

    @contextmanager
    def mode(impl_name: str):
        saved = os.environ.pop("SAMEPATH_VLLM_VALIDATE", None)
        if impl_name == debug:
            os.environ["SAMEPATH_VLLM_VALIDATE"] = "1"
        samepath_vllm.install()
        try:
            yield
        finally:
            samepath_vllm.uninstall()
            os.environ.pop("SAMEPATH_VLLM_VALIDATE", None)
            if saved is not None:
                os.environ["SAMEPATH_VLLM_VALIDATE"] = saved

    return Case(
        op="vllm_decode_step",
        config=f"B={batch} ctx={context + 1} table={width} pages x16 L={layers} {heads}q/{kv_heads}kv d={head}",
        make=lambda seed: {"q": q2d},
        samepath=step,
        baselines={debug: step},
        context=mode,
        timer=_host_step_timer,
        what="host ms per decode step's attention layers (no device sync); samepath = the default mode",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_width", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=95, help="cached positions; the step adds one")
    parser.add_argument("--width", type=int, default=2048, help="pages of the wide table (2048: 32k at page 16)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="--vllm: attention layers per step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--vllm", action="store_true", help="add the vLLM decode step (needs vllm)")
    parser.add_argument("--out", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [f"python -m bench.decode_width {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip()]
    rows += width_rows(args)
    if args.vllm:
        rows += vllm_rows(args)
    text = "\n".join(rows) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
