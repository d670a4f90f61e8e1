"""The formula's device identities and the two attention backends against each other, on an Ascend NPU.

    python bench/npu_formula.py [--device npu] [--out formula.json] [--checks identities,masked_tile,backends]
    python bench/npu_formula.py --dry-run      # every step the CPU can run; lists the device steps skipped

The attention formula (``config.ATTENTION_FORMULA``) is bit-reproducible only if the device's instructions
keep a few identities, which the CPU interpreter cannot prove for a compiled kernel:

* ``identities``: Triton-Ascend's ``tl.exp2`` / ``tl.log2`` in a compiled kernel: ``exp2(0) == 1``
  (``alpha`` when the running max does not move), ``exp2(-inf) == 0`` (masked columns; the first tile's
  ``alpha``), ``exp2(x - max(x, -FLT_MAX)) == 0`` for ``x = -inf`` (a row that has seen nothing stays
  ``(-inf, 0, 0)``, no NaN), ``exp2(x - x) == 1`` for every finite ``x``, ``0 <= exp2(x) <= 1`` for
  ``x <= 0`` (``P`` never overflows), ``log2(1) == 0``. Through both attention backends (Triton-Ascend and
  the Ascend C kernel, ``exp2`` as ``Exp(x ln 2)``): a row that sees exactly one key returns that key's
  value row bit for bit and ``lse`` = its scaled score exactly (inputs whose dots are exact), which holds
  only with ``exp2(0) == 1``, ``log2(1) == 0`` and masked columns at exactly 0.
* ``masked_tile``: a fully masked tile leaves the online-softmax state ``(m, l, acc)`` bitwise unchanged —
  directly, the forward's tile update compiled by Triton-Ascend on fresh rows ``(-inf, 0, 0)`` and on rows
  with data (negative control: the update without the ``-inf`` guard turns fresh rows into NaN); and through
  both backends, rows whose query tile visits KV tiles wholly invisible to them (before a sliding window,
  past the causal diagonal) equal the same rows decoded alone, which visit none (the visits are counted).
* ``backends``: the Ascend C kernel against the Triton-Ascend kernels on every caller of the attention
  backend (``varlen_attention`` forward, its dQ / dK / dV, ``packed_attention``, ``paged_attention``
  prefill / chunked / decode): ``torch.equal`` per caller, recorded, with the largest difference. The Ascend
  C backend is its own numerics (``samepath.fingerprint()`` names it), so a difference is reported, not a
  failure; a difference beyond the dtype's rounding (against fp64) is a failure.

``--dry-run`` runs all of it on the CPU (the Triton kernels under the interpreter; the Ascend C kernel
replaced by its numpy replay, ``ascendc.replay``, with the Triton interpreter's operations) at small sizes,
and lists the device steps it skipped. Results go to ``--out`` after every check. Exit status 1 if a check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import triton.language as tl

from samepath.kernels.attention import backend, packed_attention, paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.forward import LOG2E
from samepath.kernels.config import attention_config
from samepath.kernels.dispatch import jit

CHECKS = ("identities", "masked_tile", "backends")
FLT_MAX = float(np.finfo(np.float32).max)
#: Device steps a dry run cannot take, by check.
DEVICE_STEPS = {
    "identities": [
        "tl.exp2 / tl.log2 compiled by Triton-Ascend (here: the interpreter's numpy)",
        "the one-key rows through the Ascend C kernel (here: its replay)",
    ],
    "masked_tile": [
        "the tile update compiled by Triton-Ascend (here: the interpreter)",
        "training == decode rows through the Ascend C kernel (here: its replay)",
    ],
    "backends": ["the Ascend C kernel on the NPU against compiled Triton-Ascend (here: replay against the CPU path)"],
}


@jit
def _identity_kernel(X, EXP2, LOG2, SAME, GUARDED, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(X + offs, mask=valid, other=1.0)
    tl.store(EXP2 + offs, tl.exp2(x), mask=valid)
    tl.store(LOG2 + offs, tl.log2(x), mask=valid)
    tl.store(SAME + offs, tl.exp2(x - x), mask=valid)
    tl.store(GUARDED + offs, tl.exp2(x - tl.maximum(x, -3.4028234663852886e38)), mask=valid)


@jit
def _masked_tile_kernel(M, L, ACC, S, V, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        GUARD: tl.constexpr):  # fmt: skip
    """One tile of ``forward._segment_state``'s update, on a given state and scores (-inf where masked)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.load(M + rows)
    l_i = tl.load(L + rows)
    acc = tl.load(ACC + rows[:, None] * BLOCK_D + offs_d[None, :])
    scores = tl.load(S + rows[:, None] * TILE_N + cols[None, :])
    v = tl.load(V + cols[:, None] * BLOCK_D + offs_d[None, :])
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if GUARD:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    tl.store(M + rows, m_new)
    tl.store(L + rows, l_i)
    tl.store(ACC + rows[:, None] * BLOCK_D + offs_d[None, :], acc)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, NaN included (``torch.equal`` of the integer views)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


class Runner:
    """Runs the checks on ``device`` (``cpu`` in a dry run), collecting results and skipped device steps."""

    def __init__(self, device: str, dry_run: bool, out: Path | None) -> None:
        self.device, self.dry_run, self.out = torch.device(device), dry_run, out
        self.results: dict[str, dict] = {}
        self.skipped: list[str] = []
        self.failed = False

    def save(self) -> None:
        if self.out is not None:
            payload = {"device": str(self.device), "dry_run": self.dry_run, "checks": self.results,
                       "skipped_device_steps": self.skipped}  # fmt: skip
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(payload, indent=1, default=str))

    def record(self, check: str, name: str, ok: bool, **detail) -> None:
        self.results.setdefault(check, {})[name] = {"ok": bool(ok), **detail}
        self.failed |= not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {check}: {name} {json.dumps(detail, default=str) if detail else ''}")

    # -- identities ------------------------------------------------------------------------------------
    def identities(self) -> None:
        sweep = [0.0, -0.0, float("-inf"), -FLT_MAX, 1.0, -1.0, -126.0, -149.0, -150.0, -1e-30, 2.5, -1000.0]
        gen = torch.Generator().manual_seed(0)
        x = torch.tensor(sweep + (torch.randn(180, generator=gen) * 60).tolist(), dtype=torch.float32)
        x = x.to(self.device)
        exp2, log2, same, guarded = (torch.empty_like(x) for _ in range(4))
        _identity_kernel[(1,)](x, exp2, log2, same, guarded, x.numel(), BLOCK=256)
        x, exp2, log2, same, guarded = (t.cpu() for t in (x, exp2, log2, same, guarded))
        nonpos = x <= 0
        finite = torch.isfinite(x)
        self.record("identities", "exp2(0) == 1", bool((exp2[x == 0] == 1).all()))
        self.record("identities", "exp2(-inf) == 0", bool((exp2[x == float("-inf")] == 0).all()))
        self.record("identities", "exp2(-inf - max(-inf, -FLT_MAX)) == 0", bool(guarded[0 + 2] == 0))
        self.record("identities", "exp2(x - x) == 1 for finite x", bool((same[finite] == 1).all()))
        bounded = (exp2[nonpos] >= 0) & (exp2[nonpos] <= 1)
        self.record("identities", "0 <= exp2(x) <= 1 for x <= 0", bool(bounded.all()))
        self.record("identities", "log2(1) == 0", bool(log2[x == 1] == 0))
        self.one_key_rows()

    def _exact_inputs(self, lens: list[int], heads: int, kv_heads: int, head: int, dtype: torch.dtype):
        """Inputs in {-1, 0, 1}: every dot is an exact small integer in fp32."""
        gen = torch.Generator().manual_seed(1)
        total = sum(lens)
        q, k, v = (torch.randint(-1, 2, (total, h, head), generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
        return q, k, v, cu

    def _forward_rows(self, which: str, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of a training batch through ``which`` backend (the replay in a dry run for ascendc)."""
        if which == "ascendc" and self.dry_run:
            from samepath.kernels.attention.ascendc import replay

            return replay.simulate_forward(batch)
        moved = dataclasses.replace(
            batch, **{f: getattr(batch, f).to(self.device) for f in ("query", "key", "value", "query_start_loc",
                                                                       "kv_start_loc", "seq_lens")}
        )  # fmt: skip
        out = torch.empty_like(moved.query)
        with _backend(which):
            lse = backend.run_forward(moved, out, store_lse=True)
        return out.cpu(), lse.cpu()

    def one_key_rows(self) -> None:
        heads, kv_heads, head, dtype = 4, 2, 128, torch.bfloat16
        q, k, v, cu = self._exact_inputs([19, 1, 40], heads, kv_heads, head, dtype)
        scale = head**-0.5
        batch = AttentionBatch(q, k, v, cu, cu, cu[1:] - cu[:-1], None, scale, True, None,
                               attention_config(head, dtype, torch.device("cpu")))  # fmt: skip
        firsts = cu[:-1].long()
        group = heads // kv_heads
        k_rows = k[firsts].repeat_interleave(group, 1).float()
        scores = (q[firsts].float() * k_rows).sum(-1)  # exact: small integers
        expected_lse = (scores * torch.tensor(scale * LOG2E, dtype=torch.float32)).float()
        for which in ("triton", "ascendc"):
            out, lse = self._forward_rows(which, batch)
            value_ok = torch.equal(out[firsts], v[firsts].repeat_interleave(group, 1))
            lse_ok = torch.equal(lse[firsts], expected_lse)
            name = f"{which}: a row seeing one key returns its value, lse its score"
            self.record("identities", name, value_ok and lse_ok, value=value_ok, lse=lse_ok, rows=len(firsts))

    # -- masked_tile -----------------------------------------------------------------------------------
    def masked_tile(self) -> None:
        m, n, d = 16, 16, 64
        gen = torch.Generator().manual_seed(2)
        fresh = torch.arange(m) % 2 == 0  # even rows: (-inf, 0, 0); odd rows: data
        m0 = torch.where(fresh, torch.tensor(float("-inf")), torch.randn(m, generator=gen) * 4)
        l0 = torch.where(fresh, torch.tensor(0.0), torch.rand(m, generator=gen) * 5 + 1)
        acc0 = torch.where(fresh[:, None], torch.tensor(0.0), torch.randn(m, d, generator=gen))
        scores = torch.randn(m, n, generator=gen)
        masked = torch.arange(m) % 4 < 2  # rows 0, 1, 4, 5, ...: the whole tile masked (fresh and with data)
        scores[masked] = float("-inf")
        v = torch.randn(n, d, generator=gen).to(torch.bfloat16)
        for guard in (True, False):
            state = [t.clone().to(self.device) for t in (m0, l0, acc0)]
            _masked_tile_kernel[(1,)](*state, scores.to(self.device), v.to(self.device), BLOCK_M=m, TILE_N=n,
                                      BLOCK_D=d, GUARD=guard)  # fmt: skip
            after = [t.cpu() for t in state]
            unchanged = all(_bits_equal(a[masked], b[masked]) for a, b in zip(after, (m0, l0, acc0), strict=True))
            if guard:
                self.record("masked_tile", "the compiled tile update leaves a fully masked row's state unchanged",
                            unchanged, rows=int(masked.sum()))  # fmt: skip
            else:  # negative control: without the guard a fresh masked row becomes NaN
                nan = bool(torch.isnan(after[1][masked & fresh]).all())
                self.record("masked_tile", "negative control: no -inf guard turns fresh masked rows into NaN",
                            nan and not unchanged)  # fmt: skip
        self.masked_tiles_end_to_end()

    def masked_tiles_end_to_end(self) -> None:
        """Training rows (whose query tile visits KV tiles invisible to them) == the rows decoded alone."""
        from samepath.kernels.attention.ascendc import tiling

        heads, kv_heads, head, dtype, window = 2, 2, 64, torch.bfloat16, 20
        lens = [70, 33]
        gen = torch.Generator().manual_seed(3)
        total = sum(lens)
        q, k, v = (torch.randn(total, h, head, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
        config = dataclasses.replace(attention_config(head, dtype, torch.device("cpu")), block_m=32, tile_n=16, seg=32)
        train = AttentionBatch(q, k, v, cu, cu, cu[1:] - cu[:-1], None, head**-0.5, True, window, config)
        # Decode: one query per sequence position, each over its own keys (kv_start_loc the sequence's start).
        starts = [int(cu[s]) for s in range(len(lens)) for _ in range(lens[s])]
        positions = [p for length in lens for p in range(length)]
        dq_cu = torch.arange(total + 1, dtype=torch.int32)
        decode = AttentionBatch(q, k, v, dq_cu, torch.tensor([*starts, total], dtype=torch.int32),
                                torch.tensor([p + 1 for p in positions], dtype=torch.int32), None, head**-0.5, True,
                                window, config)  # fmt: skip
        # Fully masked (row, tile) visits in the training launch, counted from the kernels' own tiling: before
        # the row's window (state still fresh) and past its causal diagonal (state holding data).
        visits = {"fresh": 0, "with_data": 0}
        block_q = config.block_m // tiling.head_chunk(heads // kv_heads, config.block_m)
        for length in lens:
            for block in range(-(-length // block_q)):
                first, kv_end = tiling.kv_tiles(0, length, length, block, block_q, config.tile_n, True, window)
                for pos in range(block * block_q, min(length, (block + 1) * block_q)):
                    for tile in range(first, kv_end, config.tile_n):
                        bits = tiling.masked_columns(pos, tile, config.tile_n, length, True, window)
                        if bits == (1 << config.tile_n) - 1:
                            visits["with_data" if tile > pos else "fresh"] += 1
        for which in ("triton", "ascendc"):
            t_out, _ = self._forward_rows(which, train)
            d_out, _ = self._forward_rows(which, decode)
            # No fully masked visit would prove nothing: the case must have some.
            ok = torch.equal(t_out, d_out) and min(visits.values()) > 0
            self.record("masked_tile", f"{which}: training rows == rows decoded alone", ok, fully_masked_visits=visits)

    # -- backends --------------------------------------------------------------------------------------
    def backends(self) -> None:
        heads, kv_heads, head, dtype = 8, 2, 128, torch.bfloat16
        lens = [77, 1, 130] if not self.dry_run else [37, 1, 20]
        gen = torch.Generator().manual_seed(4)
        total = sum(lens)
        q, k, v, grad = (
            torch.randn(total, h, head, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads)
        )
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
        scale = head**-0.5
        results = {}
        for which in ("triton", "ascendc"):
            results[which] = self._callers(which, q, k, v, grad, cu, lens, scale)
        reference = self._reference(q, k, v, grad, cu, lens, scale)
        for caller, triton_values in results["triton"].items():
            ascendc_values = results["ascendc"][caller]
            equal = all(torch.equal(a, b) for a, b in zip(triton_values, ascendc_values, strict=True))
            diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(triton_values, ascendc_values,
                                                                                 strict=True))  # fmt: skip
            want = reference[caller]
            err = max(float((a.double() - r).abs().max()) for a, r in zip(ascendc_values, want, strict=True))
            self.record("backends", f"ascendc vs triton: {caller}", err < 5e-2, bitwise_equal=equal, max_diff=diff,
                        ascendc_vs_fp64=err)  # fmt: skip

    def _callers(self, which, q, k, v, grad, cu, lens, scale) -> dict[str, list[torch.Tensor]]:
        if which == "ascendc" and self.dry_run:
            return self._replayed_callers(q, k, v, grad, cu, lens, scale)
        dev = self.device
        qd, kd, vd, gd, cud = (t.to(dev) for t in (q, k, v, grad, cu))
        got: dict[str, list[torch.Tensor]] = {}
        with _backend(which):
            got["varlen_attention"] = [varlen_attention(qd, kd, vd, cud, scale).cpu()]
            inputs = [t.clone().requires_grad_() for t in (qd, kd, vd)]
            varlen_attention(*inputs, cud, scale).backward(gd)
            got["varlen_attention backward"] = [t.grad.cpu() for t in inputs]
            got["packed_attention"] = [packed_attention(qd, kd, vd, cud, cud, scale).cpu()]
            page = 16
            pages = sum(-(-n // page) for n in lens)
            order = torch.randperm(pages, generator=torch.Generator().manual_seed(5))
            table = torch.zeros(len(lens), max(-(-n // page) for n in lens), dtype=torch.int32)
            slots, used = [], 0
            for s, n in enumerate(lens):
                count = -(-n // page)
                table[s, :count] = order[used : used + count].int()
                used += count
                slots += [int(table[s, p // page]) * page + p % page for p in range(n)]
            kc = torch.zeros(pages, page, k.shape[1], k.shape[2], dtype=k.dtype, device=dev)
            vc = torch.zeros_like(kc)
            write_kv_cache(kd, vd, kc, vc, torch.tensor(slots, device=dev))
            lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            got["paged_attention prefill"] = [paged_attention(qd, kc, vc, table.to(dev), cud, lens_t, scale).cpu()]
            # Chunked: the last 5 (or fewer) tokens of each sequence as the new chunk; decode: the last one.
            for name, new in (("chunked", 5), ("decode", 1)):
                take = [min(new, n) for n in lens]
                idx = torch.cat([torch.arange(int(cu[s + 1]) - t, int(cu[s + 1])) for s, t in enumerate(take)])
                qcu = torch.tensor([0, *np.cumsum(take).tolist()], dtype=torch.int32, device=dev)
                rows = paged_attention(qd[idx.to(dev)], kc, vc, table.to(dev), qcu, lens_t, scale)
                got[f"paged_attention {name}"] = [rows.cpu()]
        return got

    def _replayed_callers(self, q, k, v, grad, cu, lens, scale) -> dict[str, list[torch.Tensor]]:
        """The Ascend C kernel's replay in place of the kernel (dry run): training forward and backward;
        the paged / chunked / decode callers are the forward replay's rows of the same tokens."""
        from samepath.kernels.attention.ascendc import replay

        config = attention_config(q.shape[-1], q.dtype, torch.device("cpu"))
        batch = AttentionBatch(q, k, v, cu, cu, cu[1:] - cu[:-1], None, scale, True, None, config)
        out, lse = replay.simulate_forward(batch)
        grads = replay.simulate_backward(batch, out, lse, grad)
        got = {"varlen_attention": [out], "varlen_attention backward": list(grads), "packed_attention": [out],
               "paged_attention prefill": [out]}  # fmt: skip
        for name, new in (("chunked", 5), ("decode", 1)):
            take = [min(new, n) for n in lens]
            idx = torch.cat([torch.arange(int(cu[s + 1]) - t, int(cu[s + 1])) for s, t in enumerate(take)])
            got[f"paged_attention {name}"] = [out[idx]]
        return got

    def _reference(self, q, k, v, grad, cu, lens, scale) -> dict[str, list[torch.Tensor]]:
        """fp64 attention (and its gradients) of the same callers."""
        group = q.shape[1] // k.shape[1]
        inputs = [t.double().requires_grad_() for t in (q, k, v)]
        outs = []
        for s in range(len(lens)):
            a, b = int(cu[s]), int(cu[s + 1])
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in inputs)
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            scores = (qs @ ks.transpose(1, 2)) * scale
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        out = torch.cat(outs)
        out.backward(grad.double())
        ref = {"varlen_attention": [out.detach()], "packed_attention": [out.detach()],
               "paged_attention prefill": [out.detach()],
               "varlen_attention backward": [t.grad for t in inputs]}  # fmt: skip
        for name, new in (("chunked", 5), ("decode", 1)):
            take = [min(new, n) for n in lens]
            idx = torch.cat([torch.arange(int(cu[s + 1]) - t, int(cu[s + 1])) for s, t in enumerate(take)])
            ref[f"paged_attention {name}"] = [out.detach()[idx]]
        return ref


@contextlib.contextmanager
def _backend(name: str):
    previous = os.environ.get(backend.BACKEND_ENV)
    os.environ[backend.BACKEND_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(backend.BACKEND_ENV, None)
        else:
            os.environ[backend.BACKEND_ENV] = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="npu")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--dry-run", action="store_true", help="run every step the CPU can; list the device steps")
    args = parser.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {unknown}; choose from {list(CHECKS)}")
    device = "cpu" if args.dry_run else args.device
    if not args.dry_run and device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    runner = Runner(device, args.dry_run, args.out)
    for check in checks:
        t0 = time.perf_counter()
        print(f"== {check}{' (dry run: CPU)' if args.dry_run else ''}")
        try:
            getattr(runner, check)()
        except Exception as error:  # a check that raises fails; the others still run
            runner.record(check, "raised", False, error=f"{type(error).__name__}: {error}")
            traceback.print_exc()
        if args.dry_run:
            runner.skipped += [f"{check}: {step}" for step in DEVICE_STEPS[check]]
        runner.results.setdefault(check, {})["seconds"] = {"ok": True, "value": round(time.perf_counter() - t0, 2)}
        runner.save()
    for step in runner.skipped:
        print(f"  skipped (needs the NPU): {step}")
    print(f"{'FAILED' if runner.failed else 'passed'}: {', '.join(checks)}")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
