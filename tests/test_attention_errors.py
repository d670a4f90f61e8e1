"""Bad input gets a ValueError that names the argument, never a silent wrong answer."""

from __future__ import annotations

import pytest
import torch

from samepath.kernels.attention import packed_attention, paged_attention, varlen_attention, write_kv_cache


def _qkv(tokens=8, heads=4, kv_heads=2, head_size=64, dtype=torch.float32):
    return (
        torch.randn(tokens, heads, head_size, dtype=dtype),
        torch.randn(tokens, kv_heads, head_size, dtype=dtype),
        torch.randn(tokens, kv_heads, head_size, dtype=dtype),
    )


CU = torch.tensor([0, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(heads=3, kv_heads=2), "not a multiple of the 2 KV heads"),
        (dict(head_size=72 + 1), r"query.shape\[-1\] = 73 is not a supported head size"),
        (dict(head_size=520), r"query.shape\[-1\] = 520 is not a supported"),  # wide heads: multiples of 64
        (dict(head_size=1088), r"query.shape\[-1\] = 1088 is not a supported"),
        (dict(dtype=torch.float64), "query.dtype must be one of"),
    ],
)
def test_varlen_rejects_bad_shapes_and_dtypes(kwargs, match) -> None:
    q, k, v = _qkv(**kwargs)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, k, v, CU)


def test_varlen_rejects_mixed_dtypes_devices_and_metadata() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key dtype"):
        varlen_attention(q, k.half(), v, CU)
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        varlen_attention(q, k, v, CU.to("meta"))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 7"):
        varlen_attention(q, k, v, torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32/int64 torch\.Tensor, got list"):
        varlen_attention(q, q, q, [0, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32/int64"):
        varlen_attention(q, k, v, CU.float())
    with pytest.raises(ValueError, match="query must be"):
        varlen_attention(q[None], k, v, CU)
    with pytest.raises(ValueError, match="sliding_window is only defined for causal"):
        varlen_attention(q, k, v, CU, causal=False, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        varlen_attention(q, k, v, CU, sliding_window=0)
    with pytest.raises(ValueError, match="scale must be"):
        varlen_attention(q, k, v, CU, scale=float("nan"))
    with pytest.raises(ValueError, match="samepath kernels run on"):
        varlen_attention(*(t.to("meta") for t in (q, k, v)), CU.to("meta"))


def _paged_inputs(page_size=16, pages=4):
    q = torch.randn(3, 4, 64)
    cache = torch.randn(pages, page_size, 2, 64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32)
    return q, cache, cache.clone(), table, qsl, seq_lens


def test_paged_rejects_bad_metadata() -> None:
    q, kc, vc, table, qsl, seq_lens = _paged_inputs()
    out = paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125)
    assert out.shape == q.shape and torch.isfinite(out).all()

    with pytest.raises(ValueError, match="block_table is too short"):
        paged_attention(q, kc, vc, table[:, :1], qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 sequences"):
        paged_attention(q, kc, vc, table[:1], qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="page ids outside"):
        paged_attention(q, kc, vc, table + 2, qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="seq_lens must be at least"):
        paged_attention(q, kc, vc, table, qsl, torch.tensor([1, 30], dtype=torch.int32), 0.125)
    with pytest.raises(ValueError, match="seq_lens must have 2 entries"):
        paged_attention(q, kc, vc, table, qsl, seq_lens[:1], 0.125)
    with pytest.raises(ValueError, match="key_cache must be"):
        paged_attention(q, kc[0], vc, table, qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="value_cache dtype"):
        paged_attention(q, kc, vc.half(), table, qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="not a multiple of the 3 KV heads"):
        big = torch.randn(4, 16, 3, 64)
        paged_attention(q, big, big, table, qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="key_cache head size 32"):
        small = torch.randn(4, 16, 2, 32)
        paged_attention(q, small, small, table, qsl, seq_lens, 0.125)
    with pytest.raises(ValueError, match="out must match"):
        paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125, out=torch.empty(3, 4, 32))


def test_write_kv_cache_rejects_bad_input_and_skips_padding() -> None:
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kc, vc = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)
    write_kv_cache(key, value, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[0, 0], value[2])
    assert torch.count_nonzero(kc.flatten(0, 1).abs().sum((-1, -2))) == 2
    with pytest.raises(ValueError, match="slot_mapping must have 3 entries"):
        write_kv_cache(key, value, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="key_cache dtype"):
        write_kv_cache(key, value, kc.half(), vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"value_cache must be \[num_blocks, block_size, 2, 64\]"):
        write_kv_cache(key, value, kc, vc[..., :32], torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_write_kv_cache_rejects_unsupported_dtypes(dtype: torch.dtype) -> None:
    key = torch.randn(3, 2, 64).to(dtype)
    kc, vc = torch.zeros(2, 4, 2, 64, dtype=dtype), torch.zeros(2, 4, 2, 64, dtype=dtype)
    with pytest.raises(ValueError, match=r"key\.dtype must be one of"):
        write_kv_cache(key, key.clone(), kc, vc, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("past", [8, 9, 1000])
def test_write_kv_cache_never_writes_past_the_caches(past: int) -> None:
    """A slot at or past num_blocks * block_size (8 here) is refused; unvalidated, it is skipped."""
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([2, past, 7])
    # The caches are views into a larger buffer, so a write past them would land in the guard.
    buffer = torch.zeros(2 * 2, 4, 2, 64)
    kc, vc = buffer[:2], torch.zeros(2, 4, 2, 64)
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {past}, past the caches' 2 blocks x 4 = 8 slots"):
        write_kv_cache(key, value, kc, vc, slots)
    assert torch.count_nonzero(buffer) == 0 and torch.count_nonzero(vc) == 0
    write_kv_cache(key, value, kc, vc, slots, validate=False)
    assert torch.equal(kc[0, 2], key[0]) and torch.equal(vc[1, 3], value[2])
    assert torch.count_nonzero(buffer[2:]) == 0, "an out-of-range slot was written past the cache"
    assert torch.count_nonzero(kc.flatten(0, 1).abs().sum((-1, -2))) == 2


def _guarded(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, guard: int = 64) -> torch.Tensor:
    """Fresh random values in a view whose storage continues with NaN rows: a read past the view
    turns the output NaN, and a write past it shows up in the guard."""
    buffer = torch.full((shape[0] + guard, *shape[1:]), float("nan"), dtype=dtype)
    buffer[: shape[0]] = torch.randn(shape, dtype=dtype)
    return buffer[: shape[0]]


def _guard_of(view: torch.Tensor, guard: int = 64) -> torch.Tensor:
    return torch.as_strided(view, (view.shape[0] + guard, *view.shape[1:]), view.stride())[view.shape[0] :]


@pytest.mark.parametrize(
    "cu",
    [[0, 5, 8 + 20], [0, 5, 10**6], [0, 6, 3], [3, 5, 8], [0, -4, 8]],
    ids=["past-T", "far-past-T", "decreasing", "not-from-0", "negative"],
)
def test_varlen_unvalidated_metadata_stays_inside_the_buffers(cu: list[int]) -> None:
    """``validate=False`` trusts cu_seqlens for the results only: whatever it holds, the kernel
    reads no row outside query/key/value (the NaN guards stay out of the output)."""
    q, k, v = _guarded((8, 4, 64)), _guarded((8, 2, 64)), _guarded((8, 2, 64))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, cu_seqlens)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu_seqlens, validate=False)
    assert out.shape == q.shape
    if cu[1] >= 0 and cu == sorted(cu) and cu[0] == 0:
        # The rows of the sequence that fits are exact; the rest are finite garbage.
        first = varlen_attention(q[: cu[1]], k[: cu[1]], v[: cu[1]], torch.tensor(cu[:2], dtype=torch.int32))
        assert torch.equal(out[: cu[1]], first)
        assert torch.isfinite(out).all()
    for view in (q, k, v):
        assert torch.isnan(_guard_of(view)).all()


@pytest.mark.parametrize("split_kv", [False, True], ids=["serial", "split"])
@pytest.mark.parametrize(
    "bad",
    ["page-past-cache", "negative-page", "seq-past-table", "query-past-T"],
)
def test_paged_unvalidated_metadata_stays_inside_the_buffers(bad: str, split_kv: bool) -> None:
    """``validate=False`` trusts the block table, seq_lens and query_start_loc for the results
    only: a page id outside the caches, a length past the table or query rows past the query are
    neither read nor written, so the output is finite and nothing past it changes."""
    page_size, pages = 16, 4
    q = _guarded((3, 4, 64))
    kc, vc = _guarded((pages, page_size, 2, 64)), _guarded((pages, page_size, 2, 64))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32)
    good = paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125, split_kv=split_kv)
    if bad == "page-past-cache":
        table[1, 1] = 1000
    elif bad == "negative-page":
        table[1, 1] = -7
    elif bad == "seq-past-table":
        seq_lens[1] = 10**6
    else:
        qsl[2] = 40
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125)
    out = _guarded((3, 4, 64))
    paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125, out=out, validate=False, split_kv=split_kv)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:2], good[:2]), "the untouched sequence changed"
    assert torch.isnan(_guard_of(out)).all(), "a row past the output was written"
    for view in (q, kc, vc):
        assert torch.isnan(_guard_of(view)).all()


def test_packed_unvalidated_kv_lengths_stay_inside_the_keys() -> None:
    """packed_attention (Hugging Face generate's path): a cu_seqlens_kv running past the keys reads
    nothing past them under validate=False; the sequence that fits keeps its exact rows."""
    q = _guarded((4, 4, 64))
    k, v = _guarded((10, 2, 64)), _guarded((10, 2, 64))
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    good = packed_attention(q, k, v, cu_q, torch.tensor([0, 5, 10], dtype=torch.int32), 0.125)
    bad = torch.tensor([0, 5, 10 + 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        packed_attention(q, k, v, cu_q, bad, 0.125)
    out = packed_attention(q, k, v, cu_q, bad, 0.125, validate=False)
    assert torch.isfinite(out).all() and torch.equal(out[:2], good[:2])
    for view in (q, k, v):
        assert torch.isnan(_guard_of(view)).all()


#: (cu_seqlens, causal, sliding_window) for 8 tokens: each one made the backward write out of
#: bounds, crash or spin on a dQ counter forever before it ran on clamped metadata.
BACKWARD_CASES = {
    "past-T": ([0, 5, 8 + 20], True, None),
    "far-past-T-noncausal": ([0, 5, 10**6], False, None),
    "decreasing": ([0, 6, 3], True, None),
    "decreasing-window": ([0, 6, 2, 8], True, 3),
    "not-from-0": ([3, 5, 8], False, None),
    "negative": ([0, -4, 8], True, None),
    "short": ([0, 3], False, None),
    "int32-extremes": ([0, 2**31 - 2, 2**31 - 1], True, None),
}


def _guarded_backward(q, k, v, grad_out, cu_seqlens, causal, window, problems: list[str]) -> tuple:
    """The forward (with the log-sum-exp) and backward launchers on unchecked ``cu_seqlens``, every
    tensor a guarded view; a changed guard is added to ``problems``."""
    from samepath.kernels.attention import AttentionBatch, run_backward, run_forward
    from samepath.kernels.config import attention_config

    cfg = attention_config(64, torch.float32, torch.device("cpu"))
    out = _guarded(q.shape)
    batch = AttentionBatch(
        q, k, v, cu_seqlens, cu_seqlens, cu_seqlens[1:] - cu_seqlens[:-1], None, 0.125, causal, window, cfg
    )
    lse = run_forward(batch, out, store_lse=True)
    lse_view = _guarded(lse.shape).copy_(lse)
    grads = tuple(_guarded(t.shape) for t in (q, k, v))
    run_backward(batch, out, lse_view, grad_out, grads=grads)
    for what, view in (("out", out), ("lse", lse_view), ("grad_out", grad_out), ("q", q), ("k", k), ("v", v)):
        if not torch.isnan(_guard_of(view)).all():
            problems.append(f"{what}'s guard changed")
    for what, view in zip(("dq", "dk", "dv"), grads, strict=True):
        if not torch.isnan(_guard_of(view)).all():
            problems.append(f"{what}: a row past the buffer was written")
    return grads


def _backward_garbage_report(names: list[str]) -> dict[str, list[str]]:
    """Runs each case's forward and backward (``validate=False``'s path) on guarded views; returns
    the problems found per case. Called in a subprocess, so a hang or a crash fails the test."""
    from samepath.kernels.attention import LaunchPlan, clamp_cu_seqlens

    torch.manual_seed(0)
    report = {}
    for name in names:
        cu, causal, window = BACKWARD_CASES[name]
        problems: list[str] = []
        q, k, v, grad_out = _guarded((8, 4, 64)), _guarded((8, 2, 64)), _guarded((8, 2, 64)), _guarded((8, 4, 64))
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        got = _guarded_backward(q, k, v, grad_out, cu_seqlens, causal, window, problems)
        clamped = clamp_cu_seqlens(cu_seqlens, 8).tolist()
        rows = slice(clamped[0], clamped[-1])
        for what, grad in zip(("dq", "dk", "dv"), got, strict=True):
            if not torch.isfinite(grad[rows]).all():
                problems.append(f"{what} not finite in the clamped sequences' rows {clamped}")
        # The public path, with a LaunchPlan of the bad metadata (its backward maps come from the plan).
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(
            *leaves, cu_seqlens, 0.125, causal, sliding_window=window, validate=False, plan=LaunchPlan(cu_seqlens, 8)
        )
        out.backward(grad_out)
        for what, a, leaf in zip(("dq", "dk", "dv"), got, leaves, strict=True):
            if not torch.equal(a[rows], leaf.grad[rows]):
                problems.append(f"{what} through varlen_attention(plan=...) differs from the launcher's")
        if cu[0] == 0 and 0 < cu[1] <= 8 and min(cu[1:]) == cu[1]:  # no later sequence overwrites its rows
            n = cu[1]
            parts = [_guarded(t[:n].shape).copy_(t[:n]) for t in (q, k, v, grad_out)]
            alone = _guarded_backward(*parts, torch.tensor([0, n], dtype=torch.int32), causal, window, problems)
            for what, a, b in zip(("dq", "dk", "dv"), got, alone, strict=True):
                if not torch.equal(a[:n], b):
                    problems.append(f"{what} of the first sequence (rows < {n}) differs from it alone")
        report[name] = problems
    return report


@pytest.fixture(scope="module")
def backward_garbage_report() -> dict[str, list[str]]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = (
        f"import json, sys; sys.path[:0] = [{str(tests.parent)!r}, {str(tests)!r}]\n"
        "from test_attention_errors import BACKWARD_CASES, _backward_garbage_report\n"
        "print('REPORT', json.dumps(_backward_garbage_report(list(BACKWARD_CASES))))"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the attention backward did not finish on unchecked metadata within 300 s (a counter wait hung)")
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    if result.returncode != 0 or not lines:
        pytest.fail(f"the backward subprocess died (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_varlen_backward_unvalidated_metadata_stays_inside_the_buffers(case: str, backward_garbage_report) -> None:
    """The backward under ``validate=False``: whatever cu_seqlens holds (past the tokens, decreasing,
    negative, near the int32 limits) it finishes, reads and writes no row outside its tensors (NaN
    guards), gives finite gradients in the rows of the clamped sequences, the sequence that fits keeps
    the exact gradients it has alone, and ``varlen_attention(plan=...)`` gives the launcher's bits."""
    assert backward_garbage_report[case] == []


@pytest.mark.parametrize(
    "cu", [[0, 8], [0, 3, 3, 8], [0, 0, 8, 8], [0], [0, 1, 2, 3, 4, 5, 6, 7, 8]], ids=lambda cu: str(len(cu))
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_clamping_keeps_consistent_metadata(cu: list[int], dtype: torch.dtype) -> None:
    """The backward's clamp returns consistent metadata unchanged (so the backward's bits are those
    of the unclamped launch); inconsistent metadata is changed (negative control)."""
    from samepath.kernels.attention import clamp_cu_seqlens

    tokens = cu[-1]
    metadata = torch.tensor(cu, dtype=dtype)
    clamped = clamp_cu_seqlens(metadata, tokens)
    assert clamped.dtype == dtype and torch.equal(clamped, metadata)
    assert clamp_cu_seqlens(torch.tensor([0, 6, 3, 20], dtype=dtype), 8).tolist() == [0, 6, 6, 8]
