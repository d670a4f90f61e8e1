"""Batch-invariant matmul / linear: bit equality across batch sizes, split-K, backward, routing."""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
import triton

from samepath.kernels import config as config_module
from samepath.kernels import grid, routing
from samepath.kernels.compile_check import HOPPER, compile_launch, record_launches
from samepath.kernels.config import MatmulConfig, matmul_config
from samepath.kernels.matmul import (
    MATMUL_FORMULA,
    ROUTED_CALLS,
    MixedDtypeError,
    batch_invariant,
    batch_invariant_enabled,
    linear,
    matmul,
)

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

matmul_module = importlib.import_module("samepath.kernels.matmul")  # the package attribute is the function
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BATCH_SIZES = (1, 2, 3, 7, 16, 33, 128, 257)
#: max |ours - fp64| allowed, relative to the largest |reference| value.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _close_to(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    err = (ours.double() - reference).abs().max().item()
    bound = TOLERANCE[dtype] * reference.abs().max().item()
    assert err <= bound, f"max error {err} > {bound}"


# ----------------------------------------------------------------------------------------------
# Batch invariance of the forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype) -> None:
    k, n = 96, 48
    x = _randn(max(BATCH_SIZES), k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2, scale=0.1)
    b = _randn(n, dtype=dtype, seed=3)
    full = linear(x, w, b)
    for m in BATCH_SIZES:
        part = linear(x[:m], w, b)
        assert torch.equal(part, full[:m]), f"M={m}: rows changed with the batch size"
        # the last row of the batch, alone (it sits at another position of its [block_m] tile)
        assert torch.equal(linear(x[m - 1 : m], w, b)[0], full[m - 1]), f"row {m - 1} alone differs"
    # leading dimensions fold into rows; a 3-D batch gives the same rows
    assert torch.equal(linear(x[:128].view(4, 32, k), w, b).view(128, n), full[:128])
    # matmul on a strided (transposed) weight view equals linear, without a bias
    assert torch.equal(matmul(x[:7], w.t()), linear(x[:7], w))


def test_long_k_row_alone_equals_row_in_batch() -> None:
    k, n = 4096, 32
    x = _randn(20, k, dtype=torch.float32, seed=4)
    w = _randn(n, k, dtype=torch.float32, seed=5, scale=0.02)
    full = matmul(x, w.t())
    for m in (1, 3, 17):
        assert torch.equal(matmul(x[:m], w.t()), full[:m])
    assert torch.equal(matmul(x[11:12], w.t())[0], full[11])
    _close_to(full, x.double() @ w.double().t(), torch.float32)


def test_strides_do_not_change_bits() -> None:
    a = _randn(40, 70, dtype=torch.bfloat16, seed=6)
    b = _randn(70, 50, dtype=torch.bfloat16, seed=7)
    reference = matmul(a, b)
    a_t = a.t().contiguous().t()  # column-major a
    b_wide = torch.zeros(70, 150, dtype=torch.bfloat16)
    b_wide[:, ::3] = b  # b with a column stride of 3
    assert torch.equal(matmul(a_t, b_wide[:, ::3]), reference)
    assert torch.equal(matmul(a[::2], b), reference[::2])  # row stride 2
    _close_to(reference, a.double() @ b.double(), torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Correctness and backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype) -> None:
    m, k, n = 37, 80, 40
    x = _randn(m, k, dtype=dtype, seed=10).requires_grad_()
    w = _randn(n, k, dtype=dtype, seed=11, scale=0.1).requires_grad_()
    b = _randn(n, dtype=dtype, seed=12).requires_grad_()
    dy = _randn(m, n, dtype=dtype, seed=13)
    out = linear(x, w, b)
    out.backward(dy)

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(x64, w64, b64)
    ref.backward(dy.double())
    assert out.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype and b.grad.dtype == dtype
    _close_to(out, ref, dtype)
    _close_to(x.grad, x64.grad, dtype)
    _close_to(w.grad, w64.grad, dtype)
    _close_to(b.grad, b64.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_input_gradient_row_is_batch_invariant(dtype: torch.dtype) -> None:
    k, n = 96, 48
    w = _randn(n, k, dtype=dtype, seed=21, scale=0.1)
    x = _randn(128, k, dtype=dtype, seed=20)
    dy = _randn(128, n, dtype=dtype, seed=22)

    def grad_x(rows: slice) -> torch.Tensor:
        xs = x[rows].clone().requires_grad_()
        linear(xs, w).backward(dy[rows])
        return xs.grad

    full = grad_x(slice(0, 128))
    for m in (1, 7, 33):
        assert torch.equal(grad_x(slice(0, m)), full[:m])
    assert torch.equal(grad_x(slice(90, 91))[0], full[90])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_and_bias_gradients_are_deterministic(dtype: torch.dtype) -> None:
    x = _randn(70, 64, dtype=dtype, seed=30)
    dy = _randn(70, 48, dtype=dtype, seed=31)

    def grads() -> tuple[torch.Tensor, torch.Tensor]:
        w = _randn(48, 64, dtype=dtype, seed=32).requires_grad_()
        b = _randn(48, dtype=dtype, seed=33).requires_grad_()
        linear(x, w, b).backward(dy)
        return w.grad, b.grad

    (w1, b1), (w2, b2) = grads(), grads()
    assert torch.equal(w1, w2) and torch.equal(b1, b2)


# ----------------------------------------------------------------------------------------------
# Split-K (tensor-parallel reproduction)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_equals_tensor_parallel_shards(dtype: torch.dtype) -> None:
    m, k, n, shards = 33, 256, 48, 4
    x = _randn(m, k, dtype=dtype, seed=40)
    w = _randn(n, k, dtype=dtype, seed=41, scale=0.1)
    b = _randn(n, dtype=dtype, seed=42)
    trainer = linear(x, w, b, k_slices=shards)

    # A row-parallel TP layer: rank r holds x[:, r-th K slice] and w[:, r-th K slice], computes
    # its fp32 partial with the same kernel; the reduction adds the partials in rank order in fp32,
    # then the bias, then one cast.
    width = k // shards
    partials = [
        matmul(x[:, r * width : (r + 1) * width], w[:, r * width : (r + 1) * width].t(), out_dtype=torch.float32)
        for r in range(shards)
    ]
    reduced = partials[0]
    for partial in partials[1:]:
        reduced = reduced + partial
    rollout = (reduced + b.float()).to(dtype)
    assert torch.equal(trainer, rollout)
    assert torch.equal(matmul(x, w.t(), b, k_slices=shards), rollout)
    # rows stay batch-invariant under split-K
    assert torch.equal(linear(x[5:6], w, b, k_slices=shards)[0], trainer[5])
    # negative control: the unsplit schedule adds in another order (seen in the fp32 accumulator;
    # a bf16 cast can hide a one-ulp fp32 difference)
    split = matmul(x, w.t(), k_slices=shards, out_dtype=torch.float32)
    assert torch.equal(split, reduced)
    assert not torch.equal(matmul(x, w.t(), out_dtype=torch.float32), split)
    # one slice is the plain schedule
    assert torch.equal(linear(x, w, b, k_slices=1), linear(x, w, b))


# ----------------------------------------------------------------------------------------------
# K pieces (k_split), parallel partials, GROUP_M, persistent grids
# ----------------------------------------------------------------------------------------------


def _split_config(dtype: torch.dtype, k_split: int = 4, **changes: int) -> MatmulConfig:
    """The CPU tiles with K in ``k_split`` pieces (the CUDA table's 4 by default), on the interpreter."""
    return dataclasses.replace(matmul_config(dtype, "cpu"), k_split=k_split, **changes)


#: Every tile boundary of block_m = 16 near 1, 2 and 16 tiles, and the switch from parallel
#: partials (fewer than 16 tiles on the CPU) to the serial form (M > 240 with one column of tiles).
SWEEP_M = (1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 65, 127, 129, 200, 240, 241, 255, 256, 257)


def _sweep(ms: tuple[int, ...] | range, dtype: torch.dtype) -> None:
    k, n = 200, 32  # K = 200: pieces of 64, 64, 64 and 8 columns
    x = _randn(257, k, dtype=dtype, seed=100)
    w = _randn(n, k, dtype=dtype, seed=101, scale=0.1)
    b = _randn(n, dtype=dtype, seed=102)
    cfg = _split_config(dtype)
    full = linear(x, w, b, config=cfg)
    for m in ms:
        assert torch.equal(linear(x[:m], w, b, config=cfg), full[:m]), f"M={m}: rows changed with the batch size"
    assert torch.equal(linear(x[100:101], w, b, config=cfg)[0], full[100])
    _close_to(full, F.linear(x.double(), w.double(), b.double()), dtype)
    # negative control: the unsplit K order gives other bits (seen in the fp32 accumulator)
    split = matmul(x, w.t(), config=cfg, out_dtype=torch.float32)
    assert not torch.equal(matmul(x, w.t(), config=_split_config(dtype, 1), out_dtype=torch.float32), split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_k_pieces_keep_rows_batch_invariant(dtype: torch.dtype) -> None:
    """K cut into the same 4 pieces for every M: rows alone equal rows in batches, across tile
    boundaries and the switch between parallel partials (small M) and the serial form."""
    _sweep(SWEEP_M, dtype)


@pytest.mark.slow
def test_k_pieces_keep_rows_batch_invariant_for_every_m_to_257() -> None:
    _sweep(range(1, 258), torch.float32)


@pytest.mark.parametrize("k_slices", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parallel_partials_equal_the_serial_pieces(dtype: torch.dtype, k_slices: int) -> None:
    """The two forms of the same sums (pieces as parallel programs + ordered reduction, or serially
    per tile) give the same bits, also with TP slices, a bias and addmm's alpha / beta; their
    grids differ."""
    m, k, n = 20, 256, 40
    a = _randn(m, k, dtype=dtype, seed=110)
    b = _randn(k, n, dtype=dtype, seed=111, scale=0.1)
    bias = _randn(m, n, dtype=dtype, seed=112)
    cfg = _split_config(dtype, 3)
    outs = {}
    # parallel partials; serial with the running sums in registers (CPU, Ascend) or in a scratch
    # tile between pieces (CUDA, where two live accumulators would spill)
    for partials, scratch in ((True, False), (False, False), (False, True)):
        out = torch.empty((1, m, n), dtype=torch.float32)
        with record_launches() as launches:
            matmul_module.launch(
                a[None], b[None], bias[None], out, k_slices=k_slices, alpha=0.5, beta=3.0, config=cfg,
                partials=partials, scratch=scratch,
            )  # fmt: skip
        outs[partials, scratch] = out
        names = [(launch.name, launch.kwargs.get("SCRATCH")) for launch in launches]
        expected = (
            [("_matmul_kernel", False), ("_matmul_reduce_kernel", None)] if partials else [("_matmul_kernel", scratch)]
        )
        assert names == expected
    assert torch.equal(outs[True, False], outs[False, False])
    assert torch.equal(outs[False, True], outs[False, False])
    outs[True] = outs[True, False]
    reference = 0.5 * (a.double() @ b.double()) + 3.0 * bias.double()
    _close_to(outs[True], reference, dtype)
    # negative control: the same comparison sees another piece count
    other = torch.empty((1, m, n), dtype=torch.float32)
    matmul_module.launch(
        a[None], b[None], bias[None], other, k_slices=k_slices, alpha=0.5, beta=3.0, config=_split_config(dtype, 1)
    )
    assert not torch.equal(other, outs[True])


def test_k_pieces_equal_tensor_parallel_shards() -> None:
    """TP slices and K pieces nest: each rank's fp32 partial (its slice in pieces), summed in rank
    order, equals the one-process k_slices=S schedule with the same pieces."""
    m, k, n, shards = 9, 384, 40, 2
    x = _randn(m, k, dtype=torch.bfloat16, seed=120)
    w = _randn(n, k, dtype=torch.bfloat16, seed=121, scale=0.1)
    b = _randn(n, dtype=torch.bfloat16, seed=122)
    cfg = _split_config(torch.bfloat16, 4)
    width = k // shards
    partials = [
        matmul(
            x[:, r * width : (r + 1) * width],
            w[:, r * width : (r + 1) * width].t(),
            out_dtype=torch.float32,
            config=cfg,
        )
        for r in range(shards)
    ]
    rollout = (partials[0] + partials[1] + b.float()).to(torch.bfloat16)
    assert torch.equal(linear(x, w, b, k_slices=shards, config=cfg), rollout)
    assert not torch.equal(
        matmul(x, w.t(), k_slices=shards, config=cfg, out_dtype=torch.float32),
        matmul(x, w.t(), config=cfg, out_dtype=torch.float32),
    )


def test_group_m_and_program_count_are_neutral(monkeypatch: pytest.MonkeyPatch) -> None:
    """GROUP_M only orders the tiles; a persistent grid of any size computes each tile once."""
    x = _randn(150, 96, dtype=torch.bfloat16, seed=130)
    w = _randn(100, 96, dtype=torch.bfloat16, seed=131, scale=0.1)
    reference = linear(x, w, config=_split_config(torch.bfloat16, 2, group_m=1))
    for group_m in (2, 8):
        assert torch.equal(linear(x, w, config=_split_config(torch.bfloat16, 2, group_m=group_m)), reference)
    original = grid.num_programs
    monkeypatch.setattr(grid, "num_programs", lambda work, device, **kw: min(original(work, device, **kw), 5))
    assert torch.equal(linear(x, w, config=_split_config(torch.bfloat16, 2, group_m=3)), reference)


def test_persistent_grid_is_bound_to_the_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grid, "cuda_sm_count", lambda index: 132)
    assert grid.num_programs(1024, "cuda", uses_dot=True, persistent=True) == 132
    assert grid.num_programs(40, "cuda:0", uses_dot=True, persistent=True) == 40
    assert grid.num_programs(1024, "cuda", uses_dot=True) == 1024  # not persistent: one tile per program
    assert grid.num_programs(1024, "cpu", persistent=True) == 1024
    assert grid.concurrent_programs("cuda") == 132
    # decode-shaped GEMMs on the CUDA table: one row of 128-wide tiles, so the K pieces run in parallel
    cuda = matmul_config(torch.bfloat16, "cuda")
    assert cuda.k_split > 1
    tiles = triton.cdiv(4096, cuda.block_n)
    assert matmul_module.uses_partials(tiles, cuda.k_split, torch.device("cuda"))
    assert not matmul_module.uses_partials(tiles * 32, cuda.k_split, torch.device("cuda"))
    assert not matmul_module.uses_partials(1, 1, torch.device("cuda"))


def test_piece_length() -> None:
    assert matmul_module.piece_length(4096, 4, 64) == 1024
    assert matmul_module.piece_length(200, 4, 32) == 64  # 64 + 64 + 64 + 8
    assert matmul_module.piece_length(64, 4, 64) == 64  # pieces 1..3 empty
    assert matmul_module.piece_length(100, 1, 32) == 128


# ----------------------------------------------------------------------------------------------
# Negative controls
# ----------------------------------------------------------------------------------------------


def test_negative_control_a_batch_dependent_block_k_is_detected() -> None:
    """The harness can fail: a schedule that picks its K block from the number of rows (as a
    gemv-for-one-row BLAS does) computes a lone row differently from the same row in a batch."""
    x = _randn(16, 256, dtype=torch.float32, seed=50)
    w = _randn(48, 256, dtype=torch.float32, seed=51)
    frozen = matmul_config(torch.float32, "cpu")
    lone_row = MatmulConfig(block_m=frozen.block_m, block_n=frozen.block_n, block_k=frozen.block_k // 2)
    assert not torch.equal(linear(x[:1], w, config=lone_row)[0], linear(x, w)[0])
    assert torch.equal(linear(x[:1], w)[0], linear(x, w)[0])


def test_a_different_block_k_changes_bits() -> None:
    x = _randn(33, 96, dtype=torch.float32, seed=52)
    w = _randn(48, 96, dtype=torch.float32, seed=53)
    frozen = matmul_config(torch.float32, "cpu")
    other = MatmulConfig(block_m=frozen.block_m, block_n=frozen.block_n, block_k=frozen.block_k // 2)
    assert torch.equal(linear(x, w, config=frozen), linear(x, w))
    assert not torch.equal(linear(x, w, config=other), linear(x, w))


# ----------------------------------------------------------------------------------------------
# Errors and formula
# ----------------------------------------------------------------------------------------------

_A = torch.ones(4, 8) * 0.5
_B = torch.ones(8, 3) * 0.25
_W = torch.ones(3, 8) * 0.25


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: matmul(_A, _B[:7]), "a .* and b .* cannot be multiplied"),
        (lambda: matmul(_A[0], _B), "a must be 2-D"),
        (lambda: matmul(_A, _B[None]), "b must be 2-D"),
        (lambda: matmul(_A, _B.double()), "b.dtype must be one of"),
        (lambda: matmul(_A.double(), _B.double()), "a.dtype must be one of"),
        (lambda: matmul(_A, _B.half()), "b dtype .* differs"),
        (lambda: matmul(_A, _B, torch.ones(4, 3, dtype=torch.float16)), "bias dtype"),
        (lambda: matmul(_A, _B, torch.ones(5)), "bias of shape"),
        (lambda: matmul(_A, _B, k_slices=3), "k_slices = 3 must divide K = 8"),
        (lambda: matmul(_A, _B, k_slices=0), "k_slices must be a positive int"),
        (lambda: matmul(_A, _B, out_dtype=torch.float16), "out_dtype"),
        (lambda: matmul(_A, _B, config=MatmulConfig(16, 32, 24)), "config.block_k"),
        (lambda: matmul(_A, _B, config=MatmulConfig(16, 32, 32, k_split=0)), "config.k_split"),
        (lambda: matmul(_A, _B.to("meta")), "b is on meta"),
        (lambda: linear(_A, _W[:, :7]), "weight has K = 7"),
        (lambda: linear(_A, _W[0]), "weight must be"),
        (lambda: linear(_A, _W, torch.ones(4)), "bias must be"),
        (lambda: linear(_A.int(), _W), "x.dtype must be one of"),
        (lambda: linear(_A, _W.bfloat16()), "weight dtype"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_k_gives_the_bias_as_torch_does() -> None:
    """K = 0: every product is empty, so the output is the bias (or zeros), forward and backward."""
    x = _randn(2, 3, 0, dtype=torch.float32, seed=80).requires_grad_()
    w = _randn(4, 0, dtype=torch.float32, seed=81).requires_grad_()
    b = _randn(4, dtype=torch.float32, seed=82).requires_grad_()
    out = linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b)) and out.shape == (2, 3, 4)
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert torch.equal(b.grad, torch.full((4,), 6.0))
    assert torch.equal(linear(x.detach(), w.detach()), torch.zeros(2, 3, 4))


def test_formula_is_registered_in_the_fingerprint() -> None:
    assert config_module.OP_FORMULAS["matmul"] == MATMUL_FORMULA
    assert "split_k" in MATMUL_FORMULA and "bias" in MATMUL_FORMULA


# ----------------------------------------------------------------------------------------------
# Routing torch's own ops
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "call", "named"),
    [
        ("mm", lambda: torch.mm(_A, _B.bfloat16()), "self torch.float32, mat2 torch.bfloat16"),
        ("mm", lambda: _A.half() @ _B, "self torch.float16, mat2 torch.float32"),
        ("bmm", lambda: torch.bmm(_A[None], _B[None].bfloat16()), "self torch.float32, mat2 torch.bfloat16"),
        ("addmm", lambda: torch.addmm(torch.ones(3), _A.bfloat16(), _B.bfloat16()), "self torch.float32, mat1"),
        ("addmm", lambda: F.linear(_A.bfloat16(), _W.bfloat16(), torch.ones(3)), "self torch.float32, mat1"),
    ],
)
def test_batch_invariant_names_mixed_dtypes(op: str, call, named: str) -> None:
    """Operands of different dtypes, which torch refuses too: samepath's error naming each dtype
    (torch's own, or for bmm one about the ``out`` tensor, before), a RuntimeError as torch's is."""
    with pytest.raises(RuntimeError):
        call()  # torch's own refusal outside the block
    message = rf"aten::{op} got operands of different dtypes \({named}.*cast one operand"
    with batch_invariant(), pytest.raises(MixedDtypeError, match=message):
        call()
    bias = torch.ones(3, dtype=torch.bfloat16)
    with batch_invariant():  # one dtype, or a shape error: unchanged
        assert torch.addmm(bias, _A.bfloat16(), _B.bfloat16()).dtype == torch.bfloat16
        assert torch.mm(_A.double(), _B.double()).dtype == torch.float64
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.mm(_A, _A)


def test_batch_invariant_routes_torch_ops_and_restores_them() -> None:
    x = _randn(3, 20, 64, dtype=torch.float32, seed=60)
    w = _randn(48, 64, dtype=torch.float32, seed=61)
    b = _randn(48, dtype=torch.float32, seed=62)
    rows = x.view(60, 64)
    stock_before = (F.linear(rows[:1], w, b), F.linear(x, w), rows @ w.t(), torch.bmm(x, w.t().expand(3, 64, 48)))

    ROUTED_CALLS.clear()
    with batch_invariant():
        assert batch_invariant_enabled()
        linear_3d = F.linear(x, w, b)  # aten::addmm on the folded rows
        linear_row = F.linear(rows[:1], w, b)  # aten::addmm, M = 1
        with batch_invariant():  # nesting is safe
            mm_3d = x @ w.t()  # aten::mm on the folded rows
        mm_row = torch.mm(rows[7:8], w.t())
        bmm = torch.bmm(x, w.t().expand(3, 64, 48))  # aten::bmm
        scaled = torch.addmm(b, rows, w.t(), beta=0.5, alpha=2.0)
        fp64 = torch.mm(rows.double(), w.t().double())  # not covered: torch's own kernel
    assert not batch_invariant_enabled()
    assert ROUTED_CALLS["addmm"] == 3 and ROUTED_CALLS["mm"] == 2 and ROUTED_CALLS["bmm"] == 1
    assert ROUTED_CALLS["mm:fallback"] == 1

    # inside: the samepath kernel, so rows alone equal rows in the batch
    assert torch.equal(linear_3d, linear(x, w, b))
    assert torch.equal(linear_row[0], linear_3d[0, 0])
    assert torch.equal(mm_row[0], mm_3d.view(60, 48)[7])
    assert torch.equal(bmm, mm_3d)
    _close_to(scaled, 0.5 * b.double() + 2.0 * (rows.double() @ w.double().t()), torch.float32)
    assert torch.equal(fp64, rows.double() @ w.t().double())

    # outside: torch's kernels again, bit for bit, and nothing routed
    ROUTED_CALLS.clear()
    stock_after = (F.linear(rows[:1], w, b), F.linear(x, w), rows @ w.t(), torch.bmm(x, w.t().expand(3, 64, 48)))
    assert not ROUTED_CALLS
    for before, after in zip(stock_before, stock_after, strict=True):
        assert torch.equal(before, after)


def test_batch_invariant_autograd_runs_the_kernel() -> None:
    x = _randn(24, 64, dtype=torch.bfloat16, seed=70)
    w = _randn(32, 64, dtype=torch.bfloat16, seed=71).requires_grad_()
    dy = _randn(24, 32, dtype=torch.bfloat16, seed=72)
    xs = x.clone().requires_grad_()
    ours = linear(xs, w)
    ours.backward(dy)
    ours_grads = (xs.grad, w.grad)

    w.grad = None
    xt = x.clone().requires_grad_()
    ROUTED_CALLS.clear()
    with batch_invariant():
        stock = F.linear(xt, w)
        stock.backward(dy)
    assert ROUTED_CALLS["mm"] == 3  # forward, dX, dW
    assert torch.equal(stock, ours)
    assert torch.equal(xt.grad, ours_grads[0]) and torch.equal(w.grad, ours_grads[1])


def test_extra_overrides_and_private_use1_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other ops' modules hook in through register_override; an NPU backend adds PrivateUse1."""
    others = [(name, fn) for name, fn in routing.OVERRIDES if name != "_log_softmax"]
    monkeypatch.setattr(routing, "OVERRIDES", others)
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    calls = []

    def log_softmax(x, dim, half_to_float):
        calls.append(x.shape)
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=torch.empty(0, dtype=x.dtype))

    routing.register_override("aten::_log_softmax", log_softmax)
    routing.register_override("_log_softmax", log_softmax)  # idempotent
    with pytest.raises(ValueError, match="already has"):
        routing.register_override("_log_softmax", lambda *args: None)
    assert routing.dispatch_keys() == ["CPU", "CUDA", "PrivateUse1"]
    x = _randn(4, 10, dtype=torch.float32, seed=90)
    stock = torch.log_softmax(x, -1)
    with batch_invariant():
        routed = torch.log_softmax(x, -1)
    assert calls == [x.shape] and torch.equal(routed, stock)
    torch.log_softmax(x, -1)
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------
# Compiled mode
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_matmul_kernel_compiles_for_hopper() -> None:
    """The kernel as launched (bias, split-K, alpha/beta; parallel K pieces and the serial form)
    compiles for sm_90 with the CUDA tiles."""
    x = _randn(5, 64, dtype=torch.bfloat16, seed=80)
    w = _randn(16, 64, dtype=torch.bfloat16, seed=81)
    b = _randn(16, dtype=torch.bfloat16, seed=82)
    cuda = matmul_config(torch.bfloat16, "cuda")
    with record_launches() as launches:
        linear(x, w, b, k_slices=2, config=cuda)
        matmul(x, w.t(), config=cuda)
        linear(x.repeat(300, 1), w.repeat(32, 1), config=cuda)  # 12 x 4 tiles: the serial form
        out = torch.empty((1, 5, 16), dtype=torch.bfloat16)
        matmul_module.launch(x[None], w.t()[None], None, out, config=cuda, partials=False, scratch=True)
    forms = {(launch.kwargs["PARTIALS"], launch.kwargs["SCRATCH"]) for launch in launches if "SCRATCH" in launch.kwargs}
    assert forms == {(True, False), (False, False), (False, True)}
    assert {launch.name for launch in launches} == {"_matmul_kernel", "_matmul_reduce_kernel"}
    for launch in launches:
        assert compile_launch(launch).asm["cubin"]


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_tma_kernel_compiles_for_hopper_with_tma_loads() -> None:
    """With the CUDA table (launchers run dry), bf16 linear forward (B K-contiguous), dX (B
    N-contiguous) and dW (A M-contiguous) take the tensor-descriptor kernel; each compiles for
    sm_90 with TMA copies (``cp.async.bulk.tensor``) and wgmma, without spills. A row stride that
    is not 16-byte aligned keeps the pointer kernel."""
    from samepath.kernels.compile_check import compile_specialized, dry_launches, ptxas_usage, uses_tma

    x = torch.empty(200, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(96, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.enable_grad(), dry_launches() as launches:
        y = linear(x, w)
        torch.autograd.grad(y, (x, w), torch.empty_like(y))
        linear(torch.empty(3, 63, dtype=torch.bfloat16), torch.empty(16, 63, dtype=torch.bfloat16))
    *tma, pointer = [launch for launch in launches if launch.name != "_matmul_reduce_kernel"]
    assert [launch.name for launch in tma] == ["_matmul_tma_kernel"] * 3 and pointer.name == "_matmul_kernel"
    assert [(launch.kwargs["A_T"], launch.kwargs["B_T"]) for launch in tma] == [
        (False, True),
        (False, False),
        (True, False),
    ]
    for launch in tma:
        ptx = compile_specialized(launch).asm["ptx"]
        assert uses_tma(ptx) and "wgmma.mma_async" in ptx
        usage = ptxas_usage(ptx, HOPPER)
        assert usage["spill_stores"] == usage["spill_loads"] == 0
