"""The CPU replays of the row-wise and elementwise kernels (RMSNorm forward / backward / dweight
reduce, rotary, SiLU·mul, GELU-tanh·mul) are bit-identical to Triton's interpreter.

Every case runs the public function (and its autograd backward) under ``cpu_executor("verify")``:
each launch runs the interpreter on copies and the replay on the arguments and compares every
tensor argument bit for bit. Negative controls: a replay with one step changed must be caught.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch

from samepath.kernels.config import row_reduce_config
from samepath.kernels.dispatch import DualJITFunction, ReplayMismatch, cpu_executor, replay_for
from samepath.kernels.gelu_tanh_mul import geglu_tanh, gelu_tanh_mul
from samepath.kernels.replay import elementwise
from samepath.kernels.replay import gated_mul as gated_replay
from samepath.kernels.replay import rms_norm as rms_norm_replay
from samepath.kernels.replay import rotary as rotary_replay
from samepath.kernels.rms_norm import norm_tiling, rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul, silu_mul_backward, swiglu

rms_norm_module = importlib.import_module("samepath.kernels.rms_norm")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WEIGHT_MODES = ["cast_then_weight", "fp32_weight", "fp32_one_plus_weight"]
KERNELS = [
    rms_norm_module._rms_norm_fwd_kernel,
    rms_norm_module._rms_norm_bwd_kernel,
    rms_norm_module._rms_norm_dw_reduce_kernel,
    importlib.import_module("samepath.kernels.rotary")._rotary_kernel,
    importlib.import_module("samepath.kernels.swiglu")._silu_mul_kernel,
    importlib.import_module("samepath.kernels.gelu_tanh_mul")._gelu_tanh_mul_kernel,
]


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


# ---- RMSNorm ---------------------------------------------------------------------------------

# (rows, hidden): one row, odd row counts, a hidden of 1, non-power-of-two hiddens, a block of
# 16 rows per tile (128), one row per tile (2500: block 4096) with several dweight partials.
RMS_SHAPES = [(1, 1), (37, 1), (5, 24), (37, 100), (3, 128), (33, 300), (70, 2500)]
RMS_CASES = [
    (shape, dtype, mode, residual)
    for i, shape in enumerate(RMS_SHAPES)
    for j, dtype in enumerate(DTYPES)
    for mode, residual in [(WEIGHT_MODES[(i + j) % 3], (i + j) % 2 == 0)]
] + [((37, 100), torch.bfloat16, mode, residual) for mode in WEIGHT_MODES for residual in (False, True)]


def _run_rms_norm(shape, dtype, mode, residual, grads=("y", "s")) -> None:
    rows, hidden = shape
    torch.manual_seed(rows * 1000 + hidden)
    base = _randn(rows, hidden + 3, dtype=dtype, scale=2.0)
    x = _leaf(base)[:, :hidden]  # a row stride that is not the hidden size
    weight = _leaf(_randn(hidden, dtype=dtype))
    res = _leaf(_randn(rows, hidden, dtype=dtype)) if residual else None
    with cpu_executor("verify"):
        out = rms_norm(x, weight, 1e-6, res, weight_mode=mode)
        if residual:
            y, s = out
            loss = sum(
                (t.float() * _randn(*t.shape, dtype=dtype).float()).sum()
                for name, t in (("y", y), ("s", s))
                if name in grads
            )
        else:
            loss = (out.float() * _randn(rows, hidden, dtype=dtype).float()).sum()
        loss.backward()


@pytest.mark.parametrize(("shape", "dtype", "mode", "residual"), RMS_CASES)
def test_rms_norm_replay_equals_interpreter(shape, dtype, mode, residual) -> None:
    _run_rms_norm(shape, dtype, mode, residual)


@pytest.mark.parametrize("grads", [("y",), ("s",)])
def test_rms_norm_replay_with_one_output_used(grads) -> None:
    """Only ``y`` (no residual gradient) or only ``s`` (a zero gradient for ``y``) reaches the loss."""
    _run_rms_norm((37, 100), torch.float16, "cast_then_weight", True, grads)


@pytest.fixture
def chunked_rows(monkeypatch):
    """RMSNorm tiled with a 64-column ``norm_chunk`` (the NPU's chunked rows, scaled down)."""
    cpu = row_reduce_config("cpu")
    monkeypatch.setattr(rms_norm_module, "row_reduce_config", lambda device: dataclasses.replace(cpu, norm_chunk=64))


@pytest.mark.parametrize(("rows", "hidden"), [(1, 65), (37, 150)])
@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_rms_norm_replay_of_chunked_rows(chunked_rows, rows, hidden, mode) -> None:
    assert norm_tiling(hidden, 64).num_chunks > 1
    _run_rms_norm((rows, hidden), torch.bfloat16 if mode != "fp32_weight" else torch.float32, mode, rows > 1)


def test_rms_norm_replay_with_extreme_values() -> None:
    """Zero rows, huge and tiny values, eps = 0 and an eps below fp32's normal range."""
    x = _randn(20, 48, dtype=torch.float32, scale=1e18)
    x[3] = 0.0
    x[4] *= 1e-40
    w = _randn(48, dtype=torch.float32)
    with cpu_executor("verify"):
        for eps in (0.0, 1e-40, 1e-5):
            for mode in WEIGHT_MODES:
                rms_norm(x, w, eps, weight_mode=mode)
                rms_norm(x.half(), w.half(), eps, weight_mode=mode)


def test_rms_norm_negative_control_unpadded_row_sum(monkeypatch) -> None:
    """Summing the squares over the valid columns only (not the padded block) changes bits."""

    def unpadded(squares, N, eps):
        return 1 / np.sqrt(np.sum(np.ascontiguousarray(squares[:, :N]), axis=1) / np.float32(N) + np.float32(eps))

    monkeypatch.setattr(rms_norm_replay, "_rstd", unpadded)
    torch.manual_seed(0)
    x, w = _randn(64, 300, dtype=torch.float32), _randn(300, dtype=torch.float32)
    with cpu_executor("verify"), pytest.raises(ReplayMismatch, match="_rms_norm_fwd_kernel"):
        rms_norm(x, w)


def test_rms_norm_negative_control_dweight_order(monkeypatch) -> None:
    """Adding the dweight partials in descending order changes bits."""
    original = rms_norm_replay._ascending_sum
    torch.manual_seed(1)
    x, w = _leaf(_randn(200, 2500, dtype=torch.float32)), _leaf(_randn(2500, dtype=torch.float32))
    y = rms_norm(x, w)
    monkeypatch.setattr(rms_norm_replay, "_ascending_sum", lambda partials: original(partials[::-1]))
    with cpu_executor("verify"), pytest.raises(ReplayMismatch, match="_rms_norm_dw_reduce_kernel"):
        y.backward(_randn(200, 2500, dtype=torch.float32))


# ---- rotary ----------------------------------------------------------------------------------

# (layout, batch / tokens, q heads, k heads, seq, head dim, rotary dim)
ROTARY_CASES = [
    ("hf", 2, 4, 2, 5, 64, 64, torch.float32),
    ("hf", 1, 3, 1, 7, 80, 80, torch.bfloat16),  # half = 40: a padded BLOCK_H
    ("hf", 2, 2, 2, 3, 128, 64, torch.float16),  # partial rotary
    ("vllm", 9, 4, 2, None, 96, 96, torch.bfloat16),
    ("vllm", 1, 2, 1, None, 64, 32, torch.float32),
    ("vllm", 70, 2, 1, None, 32, 24, torch.float16),  # several row blocks, half = 12
]


@pytest.mark.parametrize(("layout", "n", "hq", "hk", "seq", "head", "rdim", "dtype"), ROTARY_CASES)
def test_rotary_replay_equals_interpreter(layout, n, hq, hk, seq, head, rdim, dtype) -> None:
    torch.manual_seed(n * 100 + head)
    if layout == "hf":
        positions = torch.randint(0, 4096, (n, seq))
        q, k = _leaf(_randn(n, hq, seq, head, dtype=dtype)), _leaf(_randn(n, hk, seq, head, dtype=dtype))
    else:
        positions = torch.randint(0, 4096, (n,))
        q, k = _leaf(_randn(n, hq, head, dtype=dtype)), _leaf(_randn(n, hk, head, dtype=dtype))
    cos, sin = rotary_cos_sin(positions, rdim, 10000.0, dtype)
    with cpu_executor("verify"):
        q_embed, k_embed = apply_rotary(q, k, cos, sin)
        ((q_embed.float() * _randn(*q.shape, dtype=dtype).float()).sum() + k_embed.float().sum()).backward()


@pytest.mark.parametrize(
    ("layout", "head", "rdim", "dtype"),
    [("hf", 64, 32, torch.bfloat16), ("vllm", 80, 80, torch.float16), ("vllm", 48, 24, torch.float32)],
)
def test_rotary_interleaved_replay_equals_interpreter(layout, head, rdim, dtype) -> None:
    """GPT-J pairs (2i, 2i + 1), whole and partial heads, forward and backward."""
    torch.manual_seed(head + rdim)
    if layout == "hf":
        positions = torch.randint(0, 4096, (2, 5))
        q, k = _leaf(_randn(2, 3, 5, head, dtype=dtype)), _leaf(_randn(2, 1, 5, head, dtype=dtype))
    else:
        positions = torch.randint(0, 4096, (9,))
        q, k = _leaf(_randn(9, 4, head, dtype=dtype)), _leaf(_randn(9, 2, head, dtype=dtype))
    cos, sin = rotary_cos_sin(positions, rdim, 10000.0, dtype, interleaved=True)
    with cpu_executor("verify"):
        q_embed, k_embed = apply_rotary(q, k, cos, sin, interleaved=True)
        ((q_embed.float() * _randn(*q.shape, dtype=dtype).float()).sum() + k_embed.float().sum()).backward()


def test_rotary_replay_with_broadcast_and_strided_inputs() -> None:
    """cos/sin broadcast over the batch (stride 0) and q a transposed view ([B, S, H, D] -> [B, H, S, D])."""
    torch.manual_seed(2)
    cos, sin = rotary_cos_sin(torch.arange(6)[None], 64, 500000.0, torch.bfloat16)
    q = _leaf(_randn(3, 6, 4, 64, dtype=torch.bfloat16)).transpose(1, 2)
    k = _leaf(_randn(3, 2, 6, 64, dtype=torch.bfloat16))
    with cpu_executor("verify"):
        q_embed, k_embed = apply_rotary(q, k, cos, sin)
        (q_embed.float().sum() + k_embed.float().sum()).backward()


def test_rotary_negative_control_one_rounding(monkeypatch) -> None:
    """Rounding ``x*cos - x2*sin`` once (no rounding of each product) changes bf16 bits."""

    def one_rounding(x, cos, sin, out, half, head, dtype, backward, interleaved=False):
        x1, x2 = rotary_replay.widen(x[..., :half]), rotary_replay.widen(x[..., half : 2 * half])
        c, s = rotary_replay.widen(cos), rotary_replay.widen(sin)
        out[..., :half] = rotary_replay.cast(x1 * c[..., :half] - x2 * s[..., :half], dtype)
        out[..., half : 2 * half] = rotary_replay.cast(x2 * c[..., half:] + x1 * s[..., half:], dtype)

    monkeypatch.setattr(rotary_replay, "_rotate", one_rounding)
    torch.manual_seed(3)
    cos, sin = rotary_cos_sin(torch.arange(32), 64, 10000.0, torch.bfloat16)
    q = _randn(32, 4, 64, dtype=torch.bfloat16)
    with cpu_executor("verify"), pytest.raises(ReplayMismatch, match="_rotary_kernel"):
        apply_rotary(q, q, cos, sin)


# ---- SiLU·mul and GELU-tanh·mul --------------------------------------------------------------

GATED = {"silu": (silu_mul, swiglu), "gelu_tanh": (gelu_tanh_mul, geglu_tanh)}
# (leading shape, width): one element, non-powers of two, just over one 2048-column block, 2.5 blocks.
GATED_SHAPES = [((1,), 1), ((3,), 7), ((2, 3), 130), ((5,), 2049), ((2,), 5000)]


@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "width"), GATED_SHAPES)
def test_gated_replay_equals_interpreter(act, dtype, lead, width) -> None:
    torch.manual_seed(width)
    separate, fused = GATED[act]
    gate, up = _leaf(_randn(*lead, width, dtype=dtype, scale=4.0)), _leaf(_randn(*lead, width, dtype=dtype))
    gate_up = _leaf(_randn(*lead, 2 * width, dtype=dtype, scale=4.0))
    with cpu_executor("verify"):
        out = separate(gate, up)
        (out.float() * _randn(*out.shape, dtype=dtype).float()).sum().backward()
        out = fused(gate_up)  # the halves of one tensor: a row stride of 2 * width
        (out.float() * _randn(*out.shape, dtype=dtype).float()).sum().backward()


@pytest.mark.parametrize("act", list(GATED))
def test_gated_replay_with_extreme_values(act) -> None:
    """Saturating and overflowing exponentials, zeros of both signs, infinities and NaN."""
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4])
    special = torch.cat([special, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    gate = torch.cat([special, torch.randn(50) * 30]).reshape(5, 13)
    up = torch.randn(5, 13)
    separate, _ = GATED[act]
    for dtype in DTYPES:
        g, u = _leaf(gate.to(dtype)), _leaf(up.to(dtype))
        with cpu_executor("verify"):
            separate(g, u).float().sum().backward()


def test_silu_mul_backward_into_strided_buffers() -> None:
    """silu_mul_backward as the MoE backward calls it: gradients into the halves of one buffer."""
    torch.manual_seed(4)
    gate_up = _randn(9, 2 * 70, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    grad = _randn(9, 70, dtype=torch.bfloat16)
    buffer = torch.empty_like(gate_up)
    grad_gate, grad_up = buffer.chunk(2, dim=-1)
    with cpu_executor("verify"):
        silu_mul_backward(gate, up, grad, grad_gate, grad_up)


def test_gated_negative_control_sigmoid_form(monkeypatch) -> None:
    """``g * (1 / (1 + exp(-g)))`` instead of ``g / (1 + exp(-g))`` changes bits."""

    def sigmoid_form(g):
        e = np.float32(1.0) + np.exp(np.negative(g))
        return g * (np.float32(1.0) / e), np.float32(1.0), lambda sig: sig

    monkeypatch.setattr(gated_replay, "_silu", sigmoid_form)
    torch.manual_seed(5)
    gate, up = torch.randn(16, 300), torch.randn(16, 300)
    with cpu_executor("verify"), pytest.raises(ReplayMismatch, match="_silu_mul_kernel"):
        silu_mul(gate, up)


# ---- blocks of rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 300])
def test_replays_cut_into_small_blocks(monkeypatch, chunk) -> None:
    """Blocks of one row (or one row of a head) and of a few rows / heads / batch entries: every
    way the replays cut a launch into blocks gives the interpreter's bits."""
    monkeypatch.setattr(elementwise, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(rotary_replay, "CHUNK_ELEMENTS", chunk)
    _run_rms_norm((37, 100), torch.bfloat16, "cast_then_weight", True)
    _run_rms_norm((9, 300), torch.float16, "fp32_one_plus_weight", False)
    torch.manual_seed(chunk)
    cos, sin = rotary_cos_sin(torch.randint(0, 999, (2, 11)), 32, 10000.0, torch.bfloat16)
    q, k = _leaf(_randn(2, 3, 11, 40, dtype=torch.bfloat16)), _leaf(_randn(11, 2, 40, dtype=torch.bfloat16))
    with cpu_executor("verify"):
        q_embed, _ = apply_rotary(q, q, cos, sin)
        _, k_embed = apply_rotary(k, k, cos.reshape(22, 32)[:11], sin.reshape(22, 32)[:11])
        (q_embed.float().sum() + k_embed.float().sum()).backward()
        gate_up = _leaf(_randn(6, 2 * 50, dtype=torch.float16, scale=4.0))
        swiglu(gate_up).float().sum().backward()


# ---- the default executor uses the replays ---------------------------------------------------


def test_every_kernel_has_a_replay_and_the_default_executor_runs_it(monkeypatch) -> None:
    assert all(replay_for(kernel) is not None for kernel in KERNELS)

    def no_interpreter(*args, **kwargs):
        raise AssertionError("the interpreter ran")

    monkeypatch.setattr(DualJITFunction, "_interpret", no_interpreter)
    torch.manual_seed(6)
    x, w = _leaf(_randn(8, 100, dtype=torch.bfloat16)), _leaf(_randn(100, dtype=torch.bfloat16))
    with cpu_executor("replay"):
        y, s = rms_norm(x, w, residual=x * 2)
        cos, sin = rotary_cos_sin(torch.arange(8), 64, 10000.0, torch.bfloat16)
        q, _ = apply_rotary(y.reshape(8, 1, 100)[..., :64], s.reshape(8, 1, 100)[..., :64], cos, sin)
        out = silu_mul(q, q) + gelu_tanh_mul(q, q)
        out.float().sum().backward()
    assert x.grad is not None and w.grad is not None
