"""The CPU replays of the matmul and grouped expert GEMM kernels are bit-identical to the interpreter.

Every launch below runs under the ``"verify"`` executor: the interpreter on copies of the
arguments, the replay on the arguments, every tensor argument (outputs, fp32 partials, scratch
tiles) compared bit for bit. The launches come from the public API the integrations call
(``matmul``, ``linear`` and its backward, ``batch_invariant``'s mm / addmm / bmm, the grouped
expert layer forward and backward) plus the launcher's forced forms (parallel partials, scratch,
K pieces, persistent grids). A negative control proves the harness catches a replay with another
K order.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from samepath.kernels import grid
from samepath.kernels.config import matmul_config
from samepath.kernels.dispatch import ReplayMismatch, current_cpu_executor, replay_for
from samepath.kernels.grouped_matmul import (
    GroupedExpertsFunction,
    expert_plan,
    grouped_linear,
    grouped_weight_grad,
)
from samepath.kernels.matmul import batch_invariant, linear, matmul

matmul_module = importlib.import_module("samepath.kernels.matmul")
grouped_module = importlib.import_module("samepath.kernels.grouped_matmul")
replay_matmul = importlib.import_module("samepath.kernels.replay.matmul")
replay_grouped = importlib.import_module("samepath.kernels.replay.grouped_matmul")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (M, K, N): unaligned everything, M = 1 (decode), exact tiles, K shorter than a tile.
SHAPES = [(1, 40, 33), (37, 100, 70), (16, 64, 32), (5, 7, 3)]


@pytest.fixture(autouse=True)
def _verify(monkeypatch: pytest.MonkeyPatch):
    """The environment variable, so autograd's backward (any thread) runs under verify too."""
    monkeypatch.setenv("SAMEPATH_CPU_EXECUTOR", "verify")


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _config(dtype: torch.dtype, **changes: int):
    return dataclasses.replace(matmul_config(dtype, "cpu"), **changes)


def test_every_kernel_has_a_replay() -> None:
    assert current_cpu_executor() == "verify"
    tma_kernel = importlib.import_module("samepath.kernels.matmul_tma")._matmul_tma_kernel
    for kernel in (matmul_module._matmul_kernel, matmul_module._matmul_reduce_kernel, tma_kernel):
        assert replay_for(kernel) is not None
    for kernel in (grouped_module._grouped_matmul_kernel, grouped_module._grouped_weight_grad_kernel):
        assert replay_for(kernel) is not None


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    seed = m * 1000 + k
    a = _randn(m, k, dtype=dtype, seed=seed)
    w = _randn(n, k, dtype=dtype, seed=seed + 1, scale=0.2)
    bias = _randn(n, dtype=dtype, seed=seed + 2)
    matmul(a, w.t(), bias)  # the weight's transpose, no copy: B strides (1, K)
    matmul(a.clone().requires_grad_(), w.t())  # not differentiable, but takes leaves that require grad
    matmul(a, w.t().contiguous(), out_dtype=torch.float32)
    matmul(a, w.t(), _randn(m, n, dtype=dtype, seed=seed + 3))  # a full [M, N] bias
    if k % 2 == 0:
        matmul(a, w.t(), bias, k_slices=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_forward_and_backward(dtype: torch.dtype) -> None:
    """Forward (optionally TP-sliced), dX, dW and db all launch the kernel; a 3-D input too."""
    x = _randn(3, 7, 48, dtype=dtype, seed=1).requires_grad_()
    w = _randn(40, 48, dtype=dtype, seed=2, scale=0.2).requires_grad_()
    b = _randn(40, dtype=dtype, seed=3).requires_grad_()
    for k_slices in (1, 3):
        out = linear(x, w, b, k_slices=k_slices)
        out.backward(_randn(*out.shape, dtype=dtype, seed=4 + k_slices))
    decode = linear(x[0, :1].detach(), w.detach())
    assert decode.shape == (1, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariant_routing(dtype: torch.dtype) -> None:
    """Stock torch calls routed to the kernel: mm, addmm with alpha / beta (and beta = 0), bmm,
    F.linear and its autograd backward, strided and broadcast operands."""
    a = _randn(19, 50, dtype=dtype, seed=10)
    b = _randn(50, 35, dtype=dtype, seed=11, scale=0.2)
    bias = _randn(35, dtype=dtype, seed=12)
    batched_a = _randn(3, 9, 20, dtype=dtype, seed=13)
    batched_b = _randn(3, 20, 17, dtype=dtype, seed=14, scale=0.3)
    x = _randn(2, 5, 50, dtype=dtype, seed=15).requires_grad_()
    w = _randn(35, 50, dtype=dtype, seed=16, scale=0.2).requires_grad_()
    with batch_invariant():
        torch.mm(a, b)
        torch.mm(a[::2, 1:], b[1:, ::3])  # strided views
        torch.addmm(bias, a, b)
        torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
        torch.addmm(bias, a, b, beta=0.0)
        torch.bmm(batched_a, batched_b)
        torch.bmm(batched_a, batched_b[:1].expand(3, -1, -1))  # batch stride 0
        torch.bmm(batched_a.transpose(1, 2).contiguous().transpose(1, 2), batched_b)
        out = F.linear(x, w, bias)
        out.backward(_randn(*out.shape, dtype=dtype, seed=17))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k_slices", [1, 2])
def test_launcher_forms(dtype: torch.dtype, k_slices: int) -> None:
    """K pieces as parallel partials + the reduction, serially, or serially through a scratch tile;
    alpha, beta and a bias; K pieces not aligned to the slices (K = 150: slices of 75 columns)."""
    m, k, n = 20, 150, 40
    a = _randn(m, k, dtype=dtype, seed=20)
    b = _randn(k, n, dtype=dtype, seed=21, scale=0.1)
    bias = _randn(m, n, dtype=dtype, seed=22)
    for k_split in (1, 3):
        for partials, scratch in ((True, False), (False, False), (False, True)):
            out = torch.empty((1, m, n), dtype=dtype)
            matmul_module.launch(
                a[None], b[None], bias[None], out, k_slices=k_slices, alpha=0.5, beta=3.0,
                config=_config(dtype, k_split=k_split, group_m=3), partials=partials, scratch=scratch,
            )  # fmt: skip


def _aligned(rows: int, cols: int, dtype: torch.dtype, seed: int, transposed: bool = False) -> torch.Tensor:
    """``[rows, cols]`` with an unaligned size inside a buffer whose row stride is 16-byte aligned
    (what a tensor descriptor needs); ``transposed``: the transpose of such a ``[cols, rows]``."""
    if transposed:
        return _aligned(cols, rows, dtype, seed).t()
    pad = -cols % (16 // torch.tensor([], dtype=dtype).element_size())
    return _randn(rows, cols + pad, dtype=dtype, seed=seed, scale=0.3)[:, :cols]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tma_form_equals_the_pointer_form(dtype: torch.dtype) -> None:
    """The tensor-descriptor kernel (CUDA's form for 16-bit inputs): its replay equals the interpreter
    (verify) for K- or M-contiguous A and K- or N-contiguous B (``x @ w.t()``, dY^T @ X), unaligned
    M / N / K, K pieces serial and parallel, a bias with alpha and beta, a batch; and it gives the
    pointer kernel's bits — wherever the interpreter multiplies the same operand layouts: it
    multiplies a transposed bf16 tile (``tl.trans``) column-major, through another BLAS routine
    whose fp32 sums may differ (a device's MMA takes either layout; the CPU runs the pointer form).
    Negative control: another ``k_split`` is seen."""
    from samepath.kernels.compile_check import record_launches

    m, k, n = 21, 136, 40  # K pieces of two 32-column tiles, the last one short
    bias = _randn(m, n, dtype=dtype, seed=60)
    for a_t in (False, True):
        for b_t in (False, True):
            a = _aligned(m, k, dtype, seed=61 + a_t, transposed=a_t)
            b = _aligned(k, n, dtype, seed=63 + b_t, transposed=b_t)
            for k_split, partials in ((3, False), (3, True), (1, False)):
                config = _config(dtype, k_split=k_split, group_m=2)
                outs = []
                for tma in (True, False):
                    out = torch.empty((1, m, n), dtype=dtype)
                    with record_launches() as launches:
                        matmul_module.launch(
                            a[None], b[None], bias[None], out, alpha=0.5, beta=2.0, config=config,
                            partials=partials, tma=tma,
                        )  # fmt: skip
                    assert (launches[0].name == "_matmul_tma_kernel") == tma
                    outs.append(out)
                if dtype == torch.float16 or not (a_t or b_t):
                    assert torch.equal(outs[0], outs[1]), (a_t, b_t, k_split, partials)
    pieces, whole = (torch.empty((1, m, n), dtype=torch.float32) for _ in range(2))  # the fp32 sums
    matmul_module.launch(a[None], b[None], None, pieces, config=_config(dtype, k_split=3), tma=True)
    matmul_module.launch(a[None], b[None], None, whole, config=_config(dtype, k_split=1), tma=True)
    assert not torch.equal(pieces, whole), "negative control: another k_split"
    batched_a = torch.stack([_aligned(9, 24, dtype, seed=70 + i) for i in range(3)])
    batched_b = _aligned(24, 3 * 17, dtype, seed=73).view(24, 3, 17).transpose(0, 1)
    outs = [torch.empty((3, 9, 17), dtype=dtype) for _ in range(2)]
    for out, tma in zip(outs, (True, False), strict=True):
        matmul_module.launch(batched_a, batched_b, None, out, config=_config(dtype, k_split=2), tma=tma)
    assert torch.equal(outs[0], outs[1])


def test_tma_needs_addressable_operands() -> None:
    """The pointer form runs where a descriptor cannot address an operand: an unaligned row stride,
    no contiguous dimension, K slices, fp32 (CUDA's table: pointer loads), and on the CPU by default."""
    from samepath.kernels.matmul_tma import tma_descriptors

    config = _config(torch.bfloat16)
    a, b = _aligned(5, 24, torch.bfloat16, seed=80), _aligned(24, 16, torch.bfloat16, seed=81)
    assert tma_descriptors(a[None], b[None], config, 1, any_device=True) is not None
    assert tma_descriptors(a[None], b[None], config, 1) is None  # the CPU table: pointer loads
    assert tma_descriptors(a[None], b[None], config, 2, any_device=True) is None
    unaligned = _randn(5, 23, dtype=torch.bfloat16, seed=82)
    assert tma_descriptors(unaligned[None], _randn(23, 16, dtype=torch.bfloat16, seed=83)[None], config, 1,
                           any_device=True) is None  # fmt: skip
    assert tma_descriptors(a[None, :, ::2], b[None, ::2], config, 1, any_device=True) is None
    assert tma_descriptors(a[None].float(), b[None].float(), config, 1, any_device=True) is None


def test_persistent_grid_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer programs than tiles (as on CUDA): each program's scratch tile ends with its last tile's sums."""
    original = grid.num_programs
    monkeypatch.setattr(grid, "num_programs", lambda work, device, **kw: min(original(work, device, **kw), 5))
    a = _randn(70, 96, dtype=torch.bfloat16, seed=30)
    b = _randn(96, 90, dtype=torch.bfloat16, seed=31, scale=0.1)
    for k_split in (2, 3):
        out = torch.empty((1, 70, 90), dtype=torch.bfloat16)
        matmul_module.launch(
            a[None], b[None], None, out, k_slices=2, config=_config(torch.bfloat16, k_split=k_split),
            partials=False, scratch=True,
        )  # fmt: skip


def test_empty_k_gives_the_bias() -> None:
    a = torch.empty(3, 0)
    out = matmul(a, torch.empty(0, 5), _randn(5, dtype=torch.float32, seed=40))
    assert torch.equal(out, _randn(5, dtype=torch.float32, seed=40).expand(3, 5))


def _routed_layer(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, -1] = -30.0  # the last expert gets no pair
    weights, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return hidden_states, gate_up, down, index, weights.to(dtype)


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "dtype"),
    [
        (25, 48, 40, 6, 2, torch.bfloat16),
        (5, 64, 24, 4, 3, torch.float32),
        (13, 40, 20, 5, 2, torch.float16),
        (1, 32, 16, 8, 2, torch.bfloat16),
    ],
)
def test_grouped_experts_forward_and_backward(tokens, hidden, inter, experts, top_k, dtype) -> None:
    """The routed layer's grouped launches: both projections forward, dX of both, dW of both."""
    layer = _routed_layer(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    leaves = [t.clone().requires_grad_() if i in (0, 1, 2, 4) else t for i, t in enumerate(layer)]
    out = GroupedExpertsFunction.apply(*leaves)
    out.backward(_randn(*out.shape, dtype=dtype, seed=tokens + 1))


@pytest.mark.parametrize("k_split", [1, 2, 3])
def test_grouped_k_pieces_and_scratch(k_split: int) -> None:
    """K in pieces (CUDA's table) through the scratch tile, also on a persistent grid, and the
    weight gradient with experts of several pair blocks and none."""
    gen = torch.Generator().manual_seed(k_split)
    x = torch.randn(45, 72, generator=gen).to(torch.bfloat16)
    weight = torch.randn(5, 33, 72, generator=gen).to(torch.bfloat16)
    index = torch.randint(0, 4, (45, 1), generator=gen)
    config = _config(torch.bfloat16, k_split=k_split, block_k=16)
    plan = expert_plan(index, 5, config.block_m)
    grouped_linear(x, weight, plan, rows_per_pair=False, config=config)
    grad = torch.randn(45, 33, generator=gen).to(torch.bfloat16)
    grouped_weight_grad(grad, x, plan, 5, rows_per_pair=False, config=config)
    original = grid.num_programs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grid, "num_programs", lambda work, device, **kw: min(original(work, device, **kw), 4))
        grouped_linear(x, weight, plan, rows_per_pair=False, config=config)
        grouped_weight_grad(grad, x, plan, 5, rows_per_pair=False, config=config)


def _reversed_fold(at: np.ndarray, bt: np.ndarray, b_index: np.ndarray | None = None) -> np.ndarray:
    """The K tiles folded in descending order: the same products, another order."""
    return replay_matmul.fold_k_tiles(at[:, ::-1], bt[:, ::-1], b_index)


def test_negative_control_another_k_order_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _randn(20, 128, dtype=torch.float32, seed=50)
    b = _randn(128, 40, dtype=torch.float32, seed=51)
    x = _randn(30, 160, dtype=torch.float32, seed=52)
    weight = _randn(3, 40, 160, dtype=torch.float32, seed=53)
    plan = expert_plan(torch.randint(0, 3, (30, 1), generator=torch.Generator().manual_seed(54)), 3, 16)
    matmul(a, b)
    grouped_linear(x, weight, plan, rows_per_pair=False)
    monkeypatch.setattr(replay_matmul, "piece_partial", _reversed_piece_partial)
    with pytest.raises(ReplayMismatch):
        matmul(a, b)
    monkeypatch.setattr(replay_grouped, "fold_k_tiles", _reversed_fold)
    with pytest.raises(ReplayMismatch):
        grouped_linear(x, weight, plan, rows_per_pair=False)


def _reversed_piece_partial(a, b, first, end, bm, bn, bk, a_t=False, b_t=False):
    at = replay_matmul.a_tiles(a[:, :, first:end], bm, bk)
    bt = replay_matmul.b_tiles(b[:, first:end, :], bk, bn)
    return _reversed_fold(at, bt)
