"""RMSNorm: HF's rounding points, batch invariance, fp64 closeness, deterministic backward, errors."""

from __future__ import annotations

import importlib
import os
import shutil

import numpy as np
import pytest
import torch
import triton

from samepath.kernels.compile_check import compile_launch, record_launches
from samepath.kernels.config import OP_FORMULAS, RowReduceConfig
from samepath.kernels.rms_norm import norm_tiling, rms_norm

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_EXPONENT = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int):
    g = _gen(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    r = (torch.randn(rows, hidden, generator=g) * 2).to(dtype)
    dy = torch.randn(rows, hidden, generator=g).to(dtype)
    return x, w, r, dy


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variance: torch.Tensor | None = None):
    """transformers' LlamaRMSNorm.forward (optionally with a given fp32 mean square)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    if variance is None:
        variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _interpreter_mean_square(x: torch.Tensor) -> torch.Tensor:
    """The fp32 mean square as the kernel's tl.sum computes it under the interpreter (numpy's sum
    over the row padded to the power-of-two block)."""
    h = x.float().numpy()
    block = triton.next_power_of_2(h.shape[-1])
    padded = np.zeros((h.shape[0], block), dtype=np.float32)
    padded[:, : h.shape[1]] = h
    sums = np.stack([np.sum(row * row) for row in padded]).astype(np.float32)
    return torch.from_numpy(sums / np.float32(h.shape[1]))[:, None]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the spacing of b's dtype at b (subnormals included)."""
    exponent = torch.floor(torch.log2(b.double().abs().clamp_min(1e-45))).clamp_min(MIN_EXPONENT[b.dtype])
    spacing = torch.exp2(exponent - MANTISSA[b.dtype])
    return (a.double() - b.double()).abs() / spacing


def test_formula_is_registered() -> None:
    assert "dweight_reduction" in OP_FORMULAS["rms_norm"]


@pytest.mark.parametrize("hidden", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rounding_points_match_hf(dtype: torch.dtype, hidden: int) -> None:
    x, w, r, _ = _inputs(7, hidden, dtype, seed=hidden)
    ours = rms_norm(x, w, EPS)
    # Every rounding point is HF's: given the same fp32 statistics, the bits are HF's exactly.
    assert torch.equal(ours, _hf_rms_norm(x, w, EPS, _interpreter_mean_square(x)))
    # Against stock HF (torch's own row sum order): the fp32 statistics differ in their last bits,
    # which moves fp32 outputs by a few ulps and bf16/fp16 outputs by <= 1 ulp, rarely.
    stock = _hf_rms_norm(x, w, EPS)
    assert _ulps(ours, stock).max() <= (8 if dtype == torch.float32 else 1)
    if dtype != torch.float32:
        assert (ours != stock).float().mean() <= 0.01

    ours_y, ours_s = rms_norm(x, w, EPS, residual=r)
    hf_s = r + x  # the decoder layer's `hidden_states = residual + hidden_states`
    assert torch.equal(ours_s, hf_s)
    assert torch.equal(ours_y, _hf_rms_norm(hf_s, w, EPS, _interpreter_mean_square(hf_s)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_fused_residual_add_differs(dtype: torch.dtype) -> None:
    """An add fused into the fp32 statistics (no rounding of s) gives other bits: the exactness
    check above can fail."""
    x, w, r, _ = _inputs(16, 1000, dtype, seed=3)
    ours_y, _ = rms_norm(x, w, EPS, residual=r)
    h = x.float() + r.float()
    fused = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    assert not torch.equal(ours_y, fused)


@pytest.mark.parametrize("hidden", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype, hidden: int) -> None:
    x, w, r, dy = _inputs(33, hidden, dtype, seed=10 + hidden)

    def run(rows: slice):
        xs, rs = x[rows].clone().requires_grad_(), r[rows].clone().requires_grad_()
        y, s = rms_norm(xs, w, EPS, residual=rs)
        (y.float() * dy[rows].float()).sum().backward()
        return y.detach(), s.detach(), xs.grad, rs.grad

    full = run(slice(0, 33))
    for m in (1, 2, 3, 7, 16):
        part = run(slice(0, m))
        for a, b in zip(part, full, strict=True):
            assert torch.equal(a, b[:m])
    for i in (0, 5, 32):
        alone = run(slice(i, i + 1))
        for a, b in zip(alone, full, strict=True):
            assert torch.equal(a, b[i : i + 1])
    # without a residual, too
    y_full = rms_norm(x, w, EPS)
    assert torch.equal(rms_norm(x[17:18], w, EPS), y_full[17:18])


TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("rows,hidden", [(3, 80), (33, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype, rows: int, hidden: int) -> None:
    x, w, r, dy = _inputs(rows, hidden, dtype, seed=20 + rows)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, _ = rms_norm(xs, ws, EPS, residual=rs)
    (y.float() * dy.float()).sum().backward()

    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    exact = x64 + r64
    s64 = exact + (exact.to(dtype).double() - exact).detach()  # value rounded like ours, gradient of x + r
    y64 = w64 * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    (y64 * dy.double()).sum().backward()

    tol = TOLERANCE[dtype]
    assert _rel_err(y, y64) <= tol
    assert _rel_err(xs.grad, x64.grad) <= 2 * tol
    assert torch.equal(xs.grad, rs.grad)
    assert _rel_err(ws.grad, w64.grad) <= 2 * tol


def _norm_chunk(monkeypatch, chunk: int) -> None:
    """Run RMSNorm with rows folded in chunks of ``chunk`` columns (the NPU table folds 4096)."""
    import importlib

    module = importlib.import_module("samepath.kernels.rms_norm")
    chunked = RowReduceConfig(vocab_chunk=4096, norm_chunk=chunk)
    monkeypatch.setattr(module, "row_reduce_config", lambda device: chunked)


def _forward_backward(x, w, r, dy):
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = rms_norm(xs, ws, EPS, residual=rs)
    (y.float() * dy.float()).sum().backward()
    return y, s, xs.grad, ws.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_rows_are_batch_invariant_deterministic_and_match_fp64(monkeypatch, dtype: torch.dtype) -> None:
    """Rows longer than ``norm_chunk`` (here 200 columns in chunks of 32, the last one partial):
    a row alone equals it in a batch, two runs are equal, and the results are close to fp64."""
    x, w, r, dy = _inputs(37, 200, dtype, seed=71)
    _norm_chunk(monkeypatch, 32)
    y, s, dx, dw = _forward_backward(x, w, r, dy)
    again = _forward_backward(x, w, r, dy)
    assert all(torch.equal(a, b) for a, b in zip((y, s, dx, dw), again, strict=True))
    for row in (0, 17, 36):
        alone = _forward_backward(x[row : row + 1], w, r[row : row + 1], dy[row : row + 1])
        assert torch.equal(alone[0], y[row : row + 1]) and torch.equal(alone[2], dx[row : row + 1])
    plain = x.clone().requires_grad_()  # without a residual (no dS in the backward)
    (rms_norm(plain, w, EPS).float() * dy.float()).sum().backward()
    x_only = x.double().requires_grad_()
    (w.double() * x_only * torch.rsqrt(x_only.pow(2).mean(-1, keepdim=True) + EPS) * dy.double()).sum().backward()
    assert _rel_err(plain.grad, x_only.grad) <= 2 * TOLERANCE[dtype]

    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    exact = x64 + r64
    s64 = exact + (exact.to(dtype).double() - exact).detach()
    y64 = w64 * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    (y64 * dy.double()).sum().backward()
    tol = TOLERANCE[dtype]
    assert _rel_err(y, y64) <= tol
    assert _rel_err(dx, x64.grad) <= 2 * tol
    assert _rel_err(dw, w64.grad) <= 2 * tol


def test_chunking_is_part_of_the_numerics(monkeypatch) -> None:
    """A row that fits one chunk is computed as before; a row folded in chunks sums its squares in
    another order (negative control: some fp32 output differs)."""
    x, w, r, dy = _inputs(64, 200, torch.float32, seed=72)
    whole = _forward_backward(x, w, r, dy)
    _norm_chunk(monkeypatch, 256)
    assert all(torch.equal(a, b) for a, b in zip(whole, _forward_backward(x, w, r, dy), strict=True))
    _norm_chunk(monkeypatch, 32)
    assert not torch.equal(whole[0], _forward_backward(x, w, r, dy)[0])


def _dweight_run(x, w, r, dy):
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, _ = rms_norm(xs, ws, EPS, residual=rs)
    (y * dy).sum().backward()
    return xs.grad, rs.grad, ws.grad


def test_backward_is_deterministic_and_dweight_order_is_fixed(monkeypatch) -> None:
    """dweight is a two-level reduction of a fixed shape: fp32 partials over groups of ``group``
    rows (tiles of ``rows`` rows in ascending order, each tile's rows summed), then the partials
    in ascending order."""
    hidden = 1000
    tiling = norm_tiling(hidden, 16384)
    assert (tiling.rows, tiling.group) == (2, 128)
    rows = 2 * tiling.group + 5
    x, w, r, dy = _inputs(rows, hidden, torch.float32, seed=7)
    first, second = _dweight_run(x, w, r, dy), _dweight_run(x, w, r, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    s = x + r
    n = s * torch.rsqrt(_interpreter_mean_square(s) + EPS)
    terms = dy * n

    def partial(group_rows: range) -> torch.Tensor:
        acc = torch.zeros(hidden)
        for start in range(group_rows.start, group_rows.stop, tiling.rows):
            tile = terms[start : min(start + tiling.rows, group_rows.stop)]
            acc = acc + (tile[0] + tile[1] if len(tile) == 2 else tile[0] + 0.0)
        return acc

    expected = torch.zeros(hidden)
    for start in range(0, rows, tiling.group):
        expected = expected + partial(range(start, min(start + tiling.group, rows)))
    assert torch.equal(first[2], expected)
    assert _rel_err(first[2], terms.double().sum(0)) < 1e-5
    # Negative controls: the same terms summed serially in another order, or with another group
    # size, give other bits.
    reverse = torch.zeros(hidden)
    for i in range(rows - 1, -1, -1):
        reverse = reverse + terms[i]
    assert not torch.equal(first[2], reverse)
    monkeypatch.setattr(importlib.import_module("samepath.kernels.rms_norm"), "GROUP_ELEMENTS", 16 * 1024)
    other = _dweight_run(x, w, r, dy)
    assert torch.equal(other[0], first[0]) and not torch.equal(other[2], first[2])


def test_dweight_partials_are_summed_in_fixed_spans(monkeypatch) -> None:
    """More partials than one span: each span of ``DW_SPAN`` partials is summed from 0 in ascending
    order, then the span sums in ascending order; deterministic and close to fp64. Negative control:
    one serial chain over all the partials (the reduction before the spans) gives other bits."""
    rms_norm_module = importlib.import_module("samepath.kernels.rms_norm")
    monkeypatch.setattr(rms_norm_module, "GROUP_ELEMENTS", 16 * 256)  # 16 rows per partial
    hidden, span = 200, rms_norm_module.DW_SPAN
    rows = 16 * (span + 1) + 5  # 10 partials: spans of 8 and 2
    x, w, r, dy = _inputs(rows, hidden, torch.float32, seed=17)
    with record_launches() as launches:
        first = _dweight_run(x, w, r, dy)
    levels = [launch for launch in launches if launch.name == "_rms_norm_dw_reduce_kernel"]
    assert [launch.args[3] for launch in levels] == [span, 2]  # the spans, then all the span sums
    partials = levels[0].args[0].clone()
    assert partials.shape == (10, hidden)
    assert all(torch.equal(a, b) for a, b in zip(first, _dweight_run(x, w, r, dy), strict=True))

    def serial(values: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(hidden)
        for value in values:
            acc = acc + value
        return acc

    expected = serial(torch.stack([serial(partials[i : i + span]) for i in range(0, len(partials), span)]))
    assert torch.equal(first[2], expected)
    s = x + r
    terms = dy * (s * torch.rsqrt(_interpreter_mean_square(s) + EPS))
    assert _rel_err(first[2], terms.double().sum(0)) < 1e-5
    assert not torch.equal(first[2], serial(partials)), "negative control: one chain over all partials"
    # The column blocks of a level are free (each column is its own chain): CUDA's smaller blocks.
    monkeypatch.setattr(rms_norm_module, "DW_REDUCE_BLOCK", 16)
    assert torch.equal(_dweight_run(x, w, r, dy)[2], first[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_dim_rows_share_a_program(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm (hidden 128): 16 rows per tile, 1024 per dweight partial. Rows alone equal
    rows in a batch (forward and dx), the backward is deterministic and close to fp64."""
    tiling = norm_tiling(128, 16384)
    assert (tiling.rows, tiling.group) == (16, 1024)
    x, w, r, dy = _inputs(1100, 128, dtype, seed=9)
    y, s, dx, dw = _forward_backward(x, w, r, dy)
    for rows in (slice(0, 1), slice(5, 22), slice(1090, 1100)):
        alone = _forward_backward(x[rows], w, r[rows], dy[rows])
        assert torch.equal(alone[0], y[rows]) and torch.equal(alone[1], s[rows]) and torch.equal(alone[2], dx[rows])
    assert all(torch.equal(a, b) for a, b in zip((y, s, dx, dw), _forward_backward(x, w, r, dy), strict=True))
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    exact = x64 + r64
    s64 = exact + (exact.to(dtype).double() - exact).detach()
    y64 = w64 * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    (y64 * dy.double()).sum().backward()
    assert _rel_err(y, y64) <= TOLERANCE[dtype]
    assert _rel_err(dx, x64.grad) <= 2 * TOLERANCE[dtype]
    assert _rel_err(dw, w64.grad) <= 2 * TOLERANCE[dtype]


def test_bad_input_names_the_argument() -> None:
    x, w, r, _ = _inputs(2, 80, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"weight must have shape \(80,\)"):
        rms_norm(x, w[:40])
    with pytest.raises(ValueError, match=r"x\.dtype must be one of"):
        rms_norm(x.double(), w.double())
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, w.half())
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, w.to("meta"))
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, w, residual=r[:1])
    with pytest.raises(ValueError, match="residual dtype"):
        rms_norm(x, w, residual=r.bfloat16())
    with pytest.raises(ValueError, match="residual is on meta"):
        rms_norm(x, w, residual=r.to("meta"))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] = 16385 is not a supported hidden size"):
        rms_norm(torch.randn(1, 16385), torch.randn(16385))
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm(x, w, eps=float("nan"))
    with pytest.raises(ValueError, match="samepath kernels run on"):
        rms_norm(x.to("meta"), w.to("meta"))


def test_a_missing_weight_is_a_type_error_naming_it() -> None:
    """The contract takes a weight: ``None`` is a TypeError naming ``weight`` (an AttributeError on
    ``None.dim`` before) and the weightless form it points to, ``ones``, gives the same bits."""
    x = _inputs(2, 80, torch.float32, seed=0)[0]
    with pytest.raises(TypeError, match=r"weight must be a tensor of shape \(80,\), got NoneType; .* torch\.ones\(80"):
        rms_norm(x, None, 1e-6)
    ones = torch.ones(80, dtype=x.dtype)
    assert torch.equal(rms_norm(x, ones, 1e-6), rms_norm(x, ones.clone(), 1e-6))


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_kernels_compile_for_hopper(monkeypatch) -> None:
    x, w, r, dy = _inputs(18, 1000, torch.bfloat16, seed=1)
    with record_launches() as launches:
        xs = x.clone().requires_grad_()
        y, _ = rms_norm(xs, w.clone().requires_grad_(), EPS, residual=r)
        (y.float() * dy.float()).sum().backward()
        rms_norm(x, w, EPS)
        _norm_chunk(monkeypatch, 256)  # rows folded in chunks
        _forward_backward(x, w, r, dy)
    seen = set()
    for launch in launches:
        key = (
            launch.name,
            launch.kwargs.get("HAS_RESIDUAL"),
            launch.kwargs.get("HAS_DS"),
            launch.kwargs.get("NUM_CHUNKS"),
        )
        if key not in seen:
            seen.add(key)
            assert compile_launch(launch).asm["cubin"], launch.name
    assert {key[3] for key in seen if key[0] != "_rms_norm_dw_reduce_kernel"} == {1, 4}
    assert {key[0] for key in seen} == {
        "_rms_norm_fwd_kernel",
        "_rms_norm_bwd_kernel",
        "_rms_norm_dw_reduce_kernel",
    }


# ----------------------------------------------------------------------------------------------
# Weight modes: OLMo-2 (fp32 row times the weight) and Gemma (fp32 row times 1 + weight)
# ----------------------------------------------------------------------------------------------

FP32_WEIGHT_MODES = ["fp32_weight", "fp32_one_plus_weight"]


def _hf_fp32_weight_norm(x, weight, eps, mode, variance=None):
    """transformers' Olmo2RMSNorm (``fp32_weight``) / Gemma3RMSNorm (``fp32_one_plus_weight``)."""
    h = x.float()
    if variance is None:
        variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    factor = weight.float() if mode == "fp32_weight" else 1.0 + weight.float()
    return (h * factor).to(x.dtype)


@pytest.mark.parametrize("mode", FP32_WEIGHT_MODES)
@pytest.mark.parametrize("hidden", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_modes_round_as_hf(dtype: torch.dtype, hidden: int, mode: str) -> None:
    """Given the same fp32 statistics, each mode has the bits of its Hugging Face module; the
    residual add rounds to the dtype first, as Gemma 3's decoder layer adds."""
    x, w, r, _ = _inputs(7, hidden, dtype, seed=hidden + 1)
    w = (0.3 * torch.randn(hidden, generator=_gen(hidden))).to(dtype)  # Gemma's weights sit around 0
    ours = rms_norm(x, w, EPS, weight_mode=mode)
    assert torch.equal(ours, _hf_fp32_weight_norm(x, w, EPS, mode, _interpreter_mean_square(x)))
    ours_y, ours_s = rms_norm(x, w, EPS, residual=r, weight_mode=mode)
    assert torch.equal(ours_s, r + x)
    assert torch.equal(ours_y, _hf_fp32_weight_norm(r + x, w, EPS, mode, _interpreter_mean_square(r + x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_weight_mode_cast_point_is_seen(dtype: torch.dtype) -> None:
    """Llama's cast point (round the row, then multiply) with the Gemma factor ``1 + w`` as its
    weight gives other bits than Gemma's fp32 multiply: the check above can fail; and the
    default mode keeps the Llama bits (unchanged by the new modes)."""
    x, w, _, _ = _inputs(16, 1000, dtype, seed=5)
    gemma = rms_norm(x, w, EPS, weight_mode="fp32_one_plus_weight")
    llama_style = rms_norm(x, (1.0 + w.float()).to(dtype), EPS)
    assert not torch.equal(gemma, llama_style)
    assert not torch.equal(rms_norm(x, w, EPS, weight_mode="fp32_weight"), rms_norm(x, w, EPS))
    assert torch.equal(rms_norm(x, w, EPS), _hf_rms_norm(x, w, EPS, _interpreter_mean_square(x)))


@pytest.mark.parametrize("mode", FP32_WEIGHT_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_modes_row_alone_equals_row_in_batch(dtype: torch.dtype, mode: str) -> None:
    x, w, r, dy = _inputs(33, 80, dtype, seed=40)

    def run(rows: slice):
        xs, rs = x[rows].clone().requires_grad_(), r[rows].clone().requires_grad_()
        y, s = rms_norm(xs, w, EPS, residual=rs, weight_mode=mode)
        (y.float() * dy[rows].float()).sum().backward()
        return y.detach(), s.detach(), xs.grad

    full = run(slice(0, 33))
    for rows in (slice(0, 1), slice(0, 7), slice(17, 18), slice(32, 33)):
        for a, b in zip(run(rows), full, strict=True):
            assert torch.equal(a, b[rows])


def _weight_mode_fp64(x, r, w, dy, dtype, mode):
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    exact = x64 + r64
    s64 = exact + (exact.to(dtype).double() - exact).detach()
    factor = w64 if mode == "fp32_weight" else 1.0 + w64
    y64 = factor * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    (y64 * dy.double()).sum().backward()
    return y64, x64.grad, w64.grad


@pytest.mark.parametrize("chunk", [None, 32], ids=["whole_rows", "chunked_rows"])
@pytest.mark.parametrize("mode", FP32_WEIGHT_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_modes_forward_and_gradients_match_fp64(monkeypatch, dtype, mode, chunk) -> None:
    """Forward, dx and dweight of each mode close to fp64, with rows held whole (80 columns) and
    folded in chunks (200 columns in chunks of 32, the backward's chunked path); deterministic."""
    hidden = 80 if chunk is None else 200
    if chunk is not None:
        _norm_chunk(monkeypatch, chunk)
    x, w, r, dy = _inputs(19, hidden, dtype, seed=60 + hidden)
    w = (0.3 * torch.randn(hidden, generator=_gen(hidden))).to(dtype)

    def run():
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        y, _ = rms_norm(xs, ws, EPS, residual=rs, weight_mode=mode)
        (y.float() * dy.float()).sum().backward()
        return y, xs.grad, rs.grad, ws.grad

    y, dx, dr, dw = run()
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dr, dw), run(), strict=True))
    y64, dx64, dw64 = _weight_mode_fp64(x, r, w, dy, dtype, mode)
    tol = TOLERANCE[dtype]
    assert _rel_err(y, y64) <= tol
    assert _rel_err(dx, dx64) <= 2 * tol
    assert torch.equal(dx, dr)
    assert _rel_err(dw, dw64) <= 2 * tol


def test_weight_mode_is_checked_and_in_the_formula() -> None:
    x, w, _, _ = _inputs(2, 80, torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight_mode must be one of"):
        rms_norm(x, w, weight_mode="gemma")
    assert "weight_mode_fp32_one_plus_weight" in OP_FORMULAS["rms_norm"]
