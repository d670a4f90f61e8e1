"""softmax / sum / mean under samepath.batch_invariant(): rows batch-invariant, close to fp64,
every uncovered form handed to torch unchanged."""

from __future__ import annotations

import pytest
import torch

import samepath
from samepath.kernels import reductions
from samepath.kernels.config import RowReduceConfig, row_reduce_config

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [7, 300, 1027]  # one chunk, several, an unaligned tail


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 3).to(dtype)


OPS = {
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "softmax_fp32": lambda x: torch.nn.functional.softmax(x, dim=-1, dtype=torch.float32),
    "sum": lambda x: x.sum(dim=-1),
    "mean_keepdim": lambda x: x.mean(dim=-1, keepdim=True),
    "mean_fp32": lambda x: torch.mean(x, dim=(-1,), dtype=torch.float32),
}
REFERENCE = {
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "softmax_fp32": lambda x: torch.softmax(x, dim=-1),
    "sum": lambda x: x.sum(dim=-1),
    "mean_keepdim": lambda x: x.mean(dim=-1, keepdim=True),
    "mean_fp32": lambda x: x.mean(dim=-1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("op", list(OPS))
def test_rows_do_not_depend_on_the_batch(op: str, width: int, dtype: torch.dtype) -> None:
    x = _rows(9, width, dtype, seed=width)
    with samepath.batch_invariant():
        full = OPS[op](x)
        alone = [OPS[op](x[i : i + 1]) for i in (0, 4, 8)]
        strided = OPS[op](x[::4])
    for got, i in zip(alone, (0, 4, 8), strict=True):
        assert torch.equal(got, full[i : i + 1]), f"row {i} alone differs from row {i} of the batch"
    assert torch.equal(strided, full[::4]), "strided rows (no copy) differ"
    want = REFERENCE[op](x.double())
    assert full.shape == want.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[full.dtype]
    torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_results_and_dtypes_follow_torch() -> None:
    x = _rows(3, 40, torch.bfloat16, seed=1)
    with samepath.batch_invariant():
        assert torch.softmax(x, -1).dtype == torch.bfloat16
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float32
        assert x.sum(-1).dtype == torch.bfloat16 and x.sum(-1, dtype=torch.float32).dtype == torch.float32
        assert x.mean(-1, keepdim=True).shape == (3, 1)
        three_d = _rows(2 * 3, 40, torch.float32, seed=2).reshape(2, 3, 40)
        assert torch.equal(three_d.sum(-1)[1], three_d[1].sum(-1)), "leading dims are rows too"


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.double().sum(-1),
        lambda x: x.double().mean(-1),
        lambda x: x.sum(-1, dtype=torch.float64),
        lambda x: (x > 0).sum(-1),
        lambda x: torch.arange(12).reshape(3, 4).sum(-1),
        lambda x: x[:, :0].sum(-1),
        lambda x: x[:0].softmax(-1),
        lambda x: torch.tensor(2.0).softmax(0),
        lambda x: x.int().sum(0),
    ],
)
def test_uncovered_forms_are_torchs_own(call) -> None:
    x = _rows(5, 33, torch.float32, seed=3)
    want = call(x)
    with samepath.batch_invariant():
        got = call(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    ("shape", "call", "kept"),
    [
        ((9, 40), lambda x: torch.softmax(x, 0), 1),
        ((4, 9, 16), lambda x: torch.softmax(x, 1), 0),
        ((4, 9, 16), lambda x: torch.softmax(x, -2), 2),
        ((9, 40), lambda x: x.mean(0, keepdim=True), 1),
        ((4, 9, 16), lambda x: x.sum(1), 0),
        ((4, 9, 16), lambda x: x.mean((-1, 1)), 0),
        ((4, 9, 16), lambda x: x.sum((1, 2), keepdim=True), 0),
        ((4, 9, 16), lambda x: x.sum(), None),
        ((4, 9, 16), lambda x: torch.mean(x, dim=[]), None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_dimensions_are_rows_too(shape, call, kept: int | None, dtype: torch.dtype) -> None:
    """Any reduced dimension(s): close to torch's result in fp64, the same shape, a contiguous
    softmax; the result for one index of a kept dimension does not depend on the others."""
    x = _rows(shape[0], int(torch.tensor(shape[1:]).prod()), dtype, seed=len(shape)).reshape(shape)
    with samepath.batch_invariant():
        got = call(x)
        part = call(x.narrow(kept, 1, 1)) if kept is not None else None
    want = call(x.double())
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
    if part is not None:
        assert torch.equal(part, got.narrow(kept, 1, 1)), "one slice alone differs from that slice of the batch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half_to_float(dtype: torch.dtype) -> None:
    x = _rows(6, 500, dtype, seed=6)
    with samepath.batch_invariant():
        got = torch.ops.aten._softmax(x, -1, True)
        alone = torch.ops.aten._softmax(x[3:4], -1, True)
    assert got.dtype == torch.float32 and torch.equal(alone, got[3:4])
    torch.testing.assert_close(got.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-6)


def test_long_vocabulary_rows() -> None:
    """A 151936-wide vocabulary (Qwen's): rows invariant, close to fp64."""
    x = _rows(3, 151936, torch.bfloat16, seed=7)
    with samepath.batch_invariant():
        full = torch.softmax(x, -1, dtype=torch.float32)
        alone = torch.softmax(x[1:2], -1, dtype=torch.float32)
    assert torch.equal(alone, full[1:2])
    torch.testing.assert_close(full.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-9)


def test_backward_is_torchs_formula() -> None:
    x = _rows(4, 50, torch.float32, seed=4).requires_grad_()
    with samepath.batch_invariant():
        (torch.softmax(x, -1)[:, 3].sum() + x.mean(-1).sum()).backward()
    ref = x.detach().clone().requires_grad_()
    (torch.softmax(ref, -1)[:, 3].sum() + ref.mean(-1).sum()).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", [lambda x: x.sum(2), lambda x: x.mean((0, 0)), lambda x: torch.softmax(x, -3)])
def test_invalid_dimensions_raise_torchs_error(call) -> None:
    x = _rows(2, 8, torch.float32, seed=8)
    with samepath.batch_invariant(), pytest.raises((IndexError, RuntimeError)):
        call(x)


def test_negative_control_another_chunk_changes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: the same rows folded in 16-column chunks instead of the frozen chunk."""
    x = _rows(6, 1027, torch.float32, seed=5)
    with samepath.batch_invariant():
        frozen = (x.sum(-1), torch.softmax(x, -1))
    chunk = row_reduce_config(x.device)
    assert chunk.vocab_chunk != 16
    monkeypatch.setattr(reductions, "row_reduce_config", lambda device: RowReduceConfig(vocab_chunk=16))
    with samepath.batch_invariant():
        other = (x.sum(-1), torch.softmax(x, -1))
    assert not torch.equal(frozen[0], other[0]), "a different chunk must change some row sum"
    assert not torch.equal(frozen[1], other[1]), "a different chunk must change some softmax"


def test_formula_is_in_the_fingerprint() -> None:
    from samepath.kernels.config import OP_FORMULAS

    assert OP_FORMULAS["reductions"] == reductions.REDUCTIONS_FORMULA


def test_column_reduction_does_not_depend_on_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """sum / mean over a non-last dimension: the same bits for a column-major copy of the same
    values, for one column alone; another reduced-row tile changes them (negative control)."""
    x = _rows(300, 70, torch.float32, seed=9)
    column_major = x.t().contiguous().t()
    with samepath.batch_invariant():
        got = x.sum(0)
        assert torch.equal(column_major.sum(0), got)
        assert torch.equal(x[:, 33:34].sum(0), got[33:34])
        assert torch.equal(x.mean(0), column_major.mean(0))
    monkeypatch.setattr(reductions, "COLUMN_TILE_R", 32)
    with samepath.batch_invariant():
        assert not torch.equal(x.sum(0), got), "a different reduced-row tile must change some column"


# ----------------------------------------------------------------------------------------------
# var / std / var_mean / std_mean / vector norm
# ----------------------------------------------------------------------------------------------

STAT_OPS = {
    "var": lambda x, d: (x.var(d),),
    "var_biased_keepdim": lambda x, d: (torch.var(x, d, correction=0, keepdim=True),),
    "std": lambda x, d: (x.std(d),),
    "var_mean": lambda x, d: torch.var_mean(x, d),
    "std_mean_correction2": lambda x, d: torch.std_mean(x, d, correction=2),
    "norm": lambda x, d: (x.norm(dim=d),),
    "vector_norm_ord1_keepdim": lambda x, d: (torch.linalg.vector_norm(x, 1, dim=d, keepdim=True),),
    "normalize": lambda x, d: (torch.nn.functional.normalize(x, dim=d),),
}


def _stat_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values with an offset from 0 (a one-pass variance would lose digits to it)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 3 + 5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("op", list(STAT_OPS))
def test_statistics_rows_do_not_depend_on_the_batch_and_are_close_to_fp64(op: str, width: int, dtype) -> None:
    x = _stat_rows(9, width, dtype, seed=width + 1)
    with samepath.batch_invariant():
        full = STAT_OPS[op](x, -1)
        alone = [STAT_OPS[op](x[i : i + 1], -1) for i in (0, 4, 8)]
        strided = STAT_OPS[op](x[::4], -1)
    want = STAT_OPS[op](x.double(), -1)
    for got, ref in zip(full, want, strict=True):
        assert got.shape == ref.shape and got.dtype == dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    for i, got in zip((0, 4, 8), alone, strict=True):
        for part, whole in zip(got, full, strict=True):
            assert torch.equal(part, whole[i : i + 1]), f"{op}: row {i} alone differs from row {i} of the batch"
    for part, whole in zip(strided, full, strict=True):
        assert torch.equal(part, whole[::4]), f"{op}: strided rows differ"


@pytest.mark.parametrize(
    ("shape", "call", "kept"),
    [
        ((9, 40), lambda x: x.var(0, keepdim=True), 1),
        ((4, 9, 16), lambda x: torch.var_mean(x, 1, keepdim=True), 0),
        ((4, 9, 16), lambda x: x.std((-1, 1)), 0),
        ((4, 9, 16), lambda x: x.norm(dim=(0, 2), keepdim=True), 1),
        ((4, 9, 16), lambda x: x.var(), None),
        ((4, 9, 16), lambda x: torch.linalg.vector_norm(x), None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_statistics_over_other_dimensions(shape, call, kept: int | None, dtype: torch.dtype) -> None:
    x = _stat_rows(shape[0], int(torch.tensor(shape[1:]).prod()), dtype, seed=len(shape)).reshape(shape)
    with samepath.batch_invariant():
        got = call(x)
        part = call(x.narrow(kept, 1, 1)) if kept is not None else None
    want = call(x.double())
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    part = part if isinstance(part, tuple) or part is None else (part,)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)
        if part is not None:
            assert torch.equal(part[i], g.narrow(kept, 1, 1)), "one slice alone differs from that slice"


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (through fp64: exact for fp32 inputs), not whatever
    torch's CPU kernel rounds to."""
    return x.double().sqrt().float()


def test_statistics_do_not_depend_on_the_layout_and_agree_with_each_other() -> None:
    """A column-major copy gives the same bits; var_mean's mean is mean's, its var is var's; in fp32
    std is the correctly rounded square root of var and norm that of the sum of squares."""
    x = _stat_rows(300, 70, torch.float32, seed=10)
    column_major = x.t().contiguous().t()
    with samepath.batch_invariant():
        for call in (
            lambda t: t.var(0),
            lambda t: t.std(-1),
            lambda t: t.norm(dim=0),
            lambda t: torch.var_mean(t, 0)[1],
        ):
            assert torch.equal(call(x), call(column_major))
        var, mean = torch.var_mean(x, -1)
        assert torch.equal(mean, x.mean(-1)) and torch.equal(var, x.var(-1))
        assert torch.equal(x.std(-1), _sqrt_rn(var))
        assert torch.equal(x.norm(dim=-1), _sqrt_rn((x * x).sum(-1)))
        assert torch.equal(torch.linalg.vector_norm(x, 1, -1), x.abs().sum(-1))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.double().var(-1),
        lambda x: x.double().norm(dim=-1),
        lambda x: x.double().std(0, correction=0),
        lambda x: x.norm(dim=-1, dtype=torch.float64),
        lambda x: torch.linalg.vector_norm(x, 3, -1),
        lambda x: torch.linalg.vector_norm(x, float("inf"), -1),
        lambda x: torch.linalg.vector_norm(x, 0, -1),
        lambda x: x[:, :0].var(-1),
        lambda x: torch.tensor(2.0).std(),
    ],
)
def test_uncovered_statistics_are_torchs_own(call) -> None:
    x = _stat_rows(5, 33, torch.float32, seed=11)
    want = call(x)
    with samepath.batch_invariant():
        got = call(x)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.var(2),
        lambda x: x.std((0, 0)),
        lambda x: torch.var_mean(x, -3),
        lambda x: x.norm(dim=5),
        lambda x: x.int().var(-1),
        lambda x: torch.linalg.vector_norm(x.int(), dim=-1),
    ],
)
def test_invalid_statistics_raise_torchs_error(call) -> None:
    x = _rows(2, 8, torch.float32, seed=12)
    with pytest.raises((IndexError, RuntimeError)) as stock:
        call(x)
    with samepath.batch_invariant(), pytest.raises(stock.type):
        call(x)


@pytest.mark.parametrize("op", [torch.var_mean, torch.std_mean])
def test_uncovered_var_mean_is_torchs_var_and_mean(op) -> None:
    """torch has no separate var_mean kernel to hand an uncovered call to (its .out overload calls
    var_mean again): fp64 gets torch's var (or std) and torch's mean, each from its own kernel;
    integers raise torch's var error."""
    x = _stat_rows(5, 33, torch.float32, seed=16).double()
    with samepath.batch_invariant():
        spread, mean = op(x, 0, keepdim=True)
    assert torch.equal(mean, x.mean(0, keepdim=True))
    assert torch.equal(spread, (x.var if op is torch.var_mean else x.std)(0, keepdim=True))
    with samepath.batch_invariant(), pytest.raises(RuntimeError, match="only support floating point"):
        op(x.int(), -1)


def test_statistics_edge_cases_follow_torch() -> None:
    """One element with the default correction is NaN, a zero divisor gives inf, fp16/bf16 with a
    wider ``dtype=`` norm is computed on the widened values (torch casts the input first)."""
    x = _stat_rows(3, 2, torch.float32, seed=13)
    with samepath.batch_invariant():
        assert x[:, :1].var(-1).isnan().all()
        assert torch.var(x, -1, correction=2).isinf().all()
        half = x.to(torch.float16)
        wide = half.norm(dim=-1, dtype=torch.float32)
        assert wide.dtype == torch.float32 and torch.equal(wide, half.float().norm(dim=-1))


def test_statistics_backward_is_torchs_formula() -> None:
    x = _stat_rows(4, 50, torch.float32, seed=14).requires_grad_()
    ref = x.detach().clone().requires_grad_()

    def loss(t: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(t, -1)
        return (var * 0.3 + mean).sum() + t.std(0).sum() + t.norm(dim=-1).sum()

    with samepath.batch_invariant():
        loss(x).backward()
    loss(ref).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_negative_control_statistics_with_another_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: 16-column chunks instead of the frozen chunk change var and norm bits."""
    x = _stat_rows(6, 1027, torch.float32, seed=15)
    with samepath.batch_invariant():
        frozen = (x.var(-1), x.norm(dim=-1))
    monkeypatch.setattr(reductions, "row_reduce_config", lambda device: RowReduceConfig(vocab_chunk=16))
    with samepath.batch_invariant():
        other = (x.var(-1), x.norm(dim=-1))
    assert not torch.equal(frozen[0], other[0]), "a different chunk must change some variance"
    assert not torch.equal(frozen[1], other[1]), "a different chunk must change some norm"
