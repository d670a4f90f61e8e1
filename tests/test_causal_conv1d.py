"""The causal depthwise conv1d of the Gated DeltaNet layers (samepath.kernels.causal_conv1d): one prefill
== chunked prefill split anywhere == packed == token-by-token decode with the state, bit for bit; close to
float64 ``F.conv1d`` + SiLU (Hugging Face's ``causal_conv1d_fn``); backward deterministic and close to
float64 autograd; replay == interpreter; bad inputs refused by name."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from samepath.kernels.causal_conv1d import causal_conv1d, next_state
from samepath.kernels.dispatch import cpu_executor


def _inputs(total, d, width, dtype, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, d, generator=gen).to(dtype)
    w = (torch.randn(d, width, generator=gen) * 0.7).to(dtype)
    b = torch.randn(d, generator=gen).to(dtype) if bias else None
    return x, w, b


def _reference64(x, w, b, lengths, activation):
    """Hugging Face's causal_conv1d_fn (F.conv1d with left padding, then SiLU), float64, each sequence alone."""
    outs, start = [], 0
    for n in lengths:
        seq = x[start : start + n].double().t()[None]
        y = F.conv1d(seq, w.double()[:, None, :], None if b is None else b.double(), padding=w.shape[1] - 1,
                     groups=x.shape[1])[0, :, :n].t()  # fmt: skip
        outs.append(F.silu(y) if activation == "silu" else y)
        start += n
    return torch.cat(outs)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)])


@pytest.mark.parametrize(
    ("dtype", "d", "width", "bias", "activation"),
    [(torch.float32, 70, 4, False, "silu"), (torch.bfloat16, 96, 4, True, "silu"), (torch.float16, 33, 3, True, None)],
)
def test_prefill_chunked_packed_and_decode_agree(dtype, d, width, bias, activation):
    lengths = [1, 9, 3, 20]
    x, w, b = _inputs(sum(lengths), d, width, dtype, seed=1, bias=bias)
    cu = _cu(lengths)
    full, full_state = causal_conv1d(x, w, b, cu, None, activation)
    # each sequence alone
    for (s0, s1), n in zip(itertools.pairwise(cu.tolist()), lengths, strict=True):
        alone, _ = causal_conv1d(x[s0:s1], w, b, torch.tensor([0, n]), None, activation)
        assert torch.equal(alone, full[s0:s1])
    # in pieces ending at each cut, every sequence at once per step (decode = pieces of one token)
    for cuts in ([2, 5], list(range(1, max(lengths)))):
        state, outs, prev = None, [[] for _ in lengths], 0
        for cut in [*cuts, max(lengths)]:
            pieces = [x[a + min(prev, n) : a + min(cut, n)] for a, n in zip(cu.tolist(), lengths, strict=False)]
            step_cu = _cu([p.shape[0] for p in pieces])
            out, state = causal_conv1d(torch.cat(pieces), w, b, step_cu, state, activation)
            for i, (a, z) in enumerate(itertools.pairwise(step_cu.tolist())):
                outs[i].append(out[a:z])
            prev = cut
        assert torch.equal(torch.cat([torch.cat(o) for o in outs]), full)
        assert torch.equal(state, full_state)
    want = _reference64(x, w, b, lengths, activation)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol)
    # negative control: a continuation that drops the state differs
    half = causal_conv1d(x[4:10], w, b, torch.tensor([0, 6]), None, activation)[0]
    assert not torch.equal(half, full[4:10])


def test_the_state_is_the_last_inputs():
    x, _, _ = _inputs(7, 5, 4, torch.float32, seed=2)
    old = torch.randn(3, 5, 3)
    state = next_state(x, _cu([1, 0, 6]), old, 4)
    assert torch.equal(state[0], torch.cat([old[0, :, 1:], x[0:1].t()], 1))
    assert torch.equal(state[1], old[1])
    assert torch.equal(state[2], x[4:7].t())


def test_the_tap_order_is_fixed():
    """Negative control: the same taps summed in the opposite order give other fp32 bits somewhere, so
    the order is part of the formula (and the kernel's is ascending)."""
    x, w, _ = _inputs(400, 64, 4, torch.float32, seed=3)
    out, _ = causal_conv1d(x, w, None, _cu([400]), None, None)
    xs = torch.cat([torch.zeros(3, 64), x])
    ascending, descending = torch.zeros(400, 64), torch.zeros(400, 64)
    for j in range(4):
        ascending = ascending + w[:, j] * xs[j : j + 400]
        descending = descending + w[:, 3 - j] * xs[3 - j : 403 - j]
    assert torch.equal(out, ascending)
    assert not torch.equal(out, descending)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_deterministic_and_close_to_float64(dtype):
    lengths = [5, 12]
    x, w, b = _inputs(sum(lengths), 24, 4, dtype, seed=4, bias=True)
    state = torch.randn(2, 24, 3).to(dtype)
    grad = torch.randn(sum(lengths), 24).to(dtype)

    def run(xx, ww, bb):
        leaves = [t.detach().clone().requires_grad_() for t in (xx, ww, bb)]
        out, _ = causal_conv1d(*leaves, _cu(lengths), state, "silu")
        out.backward(grad)
        return [t.grad for t in leaves]

    first, second = run(x, w, b), run(x, w, b)
    assert all(torch.equal(a, c) for a, c in zip(first, second, strict=True))
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    s64, out64 = state.double(), []
    for (a, z), n in zip(itertools.pairwise(_cu(lengths).tolist()), lengths, strict=True):
        seq = torch.cat([s64[len(out64)].t(), leaves[0][a:z]]).t()[None]
        out64.append(F.silu(F.conv1d(seq, leaves[1][:, None, :], leaves[2], groups=24))[0].t()[-n:])
    torch.cat(out64).backward(grad.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(first, [t.grad for t in leaves], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("dtype", "bias", "state", "activation"),
    [(torch.float32, False, True, "silu"), (torch.bfloat16, True, True, "silu"), (torch.float16, True, False, None)],
)
def test_replay_equals_interpreter(dtype, bias, state, activation):
    """The forward and the three backward kernels: the CPU replay equals Triton's interpreter bit for bit."""
    lengths = [3, 1, 21]
    x, w, b = _inputs(sum(lengths), 80, 4, dtype, seed=5, bias=bias)
    s = torch.randn(3, 80, 3).to(dtype) if state else None
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    with cpu_executor("verify"):  # forward, the pre-activation gradient, dx and the weight / bias sums
        out, _ = causal_conv1d(x, w, b, _cu(lengths), s, activation)
        torch.autograd.grad(out, leaves, torch.randn(out.shape).to(dtype))


def test_bad_inputs_are_refused_by_name():
    x, w, _ = _inputs(6, 8, 4, torch.float32, seed=6)
    cu = _cu([6])
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, w[:4], None, cu)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, None, cu, activation="gelu")
    with pytest.raises(ValueError, match="state must"):
        causal_conv1d(x, w, None, cu, torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="state must have x's dtype"):
        causal_conv1d(x, w, None, cu, torch.zeros(1, 8, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, None, cu.float())
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, w, torch.zeros(3), cu)
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        causal_conv1d(x, w.double(), None, cu)
    with pytest.raises(ValueError, match="bias must have x's dtype"):
        causal_conv1d(x, w, torch.zeros(8, dtype=torch.bfloat16), cu)
    for bad in ([0, 7], [0, 5], [1, 6], [0, 4, 2, 6]):  # past T, short of T, not from 0, falling
        with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 6"):
            causal_conv1d(x, w, None, torch.tensor(bad))
    out, _ = causal_conv1d(x, w, None, cu, validate=False)  # trusted values: the same bits
    assert torch.equal(out, causal_conv1d(x, w, None, cu)[0])


@pytest.mark.interpreter
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.ascend") is None, reason="Triton-Ascend is not installed (nox -s ascend)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_kernels_lower_for_ascend(dtype):
    """The forward (both modes), dx and dw kernels, as launched, lower to Triton-Ascend's MLIR."""
    from samepath.kernels.compile_check import lower_for_ascend, record_launches

    x, w, b = _inputs(20, 80, 4, dtype, seed=7, bias=True)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    with record_launches() as launches:
        out, state = causal_conv1d(*leaves, _cu([7, 13]), None, "silu")
        out.sum().backward()
        causal_conv1d(x.detach()[:2], w.detach(), None, _cu([1, 1]), state, "silu")
    results = {}
    for launch in launches:
        results.setdefault(launch.name, lower_for_ascend(launch))
    assert set(results) == {"_causal_conv1d_kernel", "_causal_conv1d_dx_kernel", "_causal_conv1d_dw_kernel"}
    assert set(results.values()) <= {"mlir", "binary"}
