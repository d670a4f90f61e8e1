"""The one-pass attention backward: closeness to fp64 for GQA groups, windows and the CUDA tiles;
gradients bitwise independent of the batch around a sequence; a negative control."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from attention_harness import Batch, make_batch, reference_attention

from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import ATTENTION_TABLE, attention_config

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _grads(batch: Batch, grad_out: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    out = varlen_attention(*leaves, batch.cu_seqlens, **kwargs)
    out.backward(grad_out.to(out.dtype))
    return leaves[0].grad, leaves[1].grad, leaves[2].grad


def _fp64_grads(batch: Batch, grad_out: torch.Tensor, scale: float, sliding_window: int | None) -> tuple:
    leaves = [t.detach().double().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    reference_attention(Batch(*leaves, batch.lens), scale, True, sliding_window).backward(grad_out.double())
    return tuple(leaf.grad for leaf in leaves)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    limit = TOLERANCE[dtype] * max(expected.abs().max().item(), 1.0)
    err = (actual.double() - expected).abs().max().item()
    assert err <= limit, f"{what}: max error {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,sliding_window",
    [(2, 2, None), (4, 1, 13), (16, 2, None), (24, 1, 9)],
    ids=["group1", "group4-window13", "group8", "group24-two-head-chunks-window9"],
)
def test_gqa_gradients_match_fp64(num_heads: int, num_kv_heads: int, sliding_window: int | None) -> None:
    """Several KV tiles per sequence (tiles of 16 keys on the CPU), unaligned lengths."""
    batch = make_batch([23, 40], num_heads, num_kv_heads, 64, torch.float32, seed=num_heads)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(num_heads + 1))
    got = _grads(batch, grad_out, scale=0.125, sliding_window=sliding_window)
    expected = _fp64_grads(batch, grad_out, 0.125, sliding_window)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        _assert_close(a, e, torch.float32, name)


@pytest.mark.parametrize(
    "dtype,num_heads,sliding_window",
    [(torch.bfloat16, 4, None), (torch.float16, 8, 70), (torch.bfloat16, 2, 30)],
    ids=["bf16-group2", "fp16-group4-window70", "bf16-group1-window30"],
)
def test_cuda_tiles_match_fp64(dtype: torch.dtype, num_heads: int, sliding_window: int | None) -> None:
    """The CUDA row (32 packed query rows against 64-key tiles, so a KV tile meets many query
    tiles and a query tile several KV tiles) under the interpreter, with a non-power-of-two head."""
    config = ATTENTION_TABLE["cuda", {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], 128]
    batch = make_batch([150, 29], num_heads, 2, 96, dtype, seed=num_heads)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(3))
    scale = 96**-0.5
    got = _grads(batch, grad_out, scale=scale, sliding_window=sliding_window, config=config)
    expected = _fp64_grads(batch, grad_out, scale, sliding_window)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert a.dtype == dtype
        _assert_close(a, e, dtype, name)


def _sequence_grads(lens: list[int], order: list[int], dtype: torch.dtype, seed: int, **kwargs) -> dict[int, tuple]:
    """Gradients of sequences ``order`` (indices into ``lens``, each with fixed random Q, K, V and
    dO) run as one packed batch in that order; returned per sequence index."""
    parts = []
    for index in order:
        batch = make_batch([lens[index]], 4, 1, 80, dtype, seed=seed + index)
        grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(seed + 100 + index))
        parts.append((batch, grad_out))
    tensors = (torch.cat([getattr(batch, name) for batch, _ in parts]) for name in ("query", "key", "value"))
    packed = Batch(*tensors, [lens[i] for i in order])
    grads = _grads(packed, torch.cat([p[1] for p in parts]), **kwargs)
    result, start = {}, 0
    for index in order:
        result[index] = tuple(g[start : start + lens[index]] for g in grads)
        start += lens[index]
    return result


def _mismatches(batch: dict[int, tuple], other: dict[int, tuple]) -> list[int]:
    return [i for i in other if not all(torch.equal(a, b) for a, b in zip(batch[i], other[i], strict=True))]


LENS = [37, 5, 50, 19]


@pytest.mark.parametrize(
    "dtype,sliding_window", [(torch.float32, None), (torch.bfloat16, 13)], ids=["fp32-causal", "bf16-window13"]
)
def test_gradients_are_independent_of_the_batch(dtype: torch.dtype, sliding_window: int | None) -> None:
    """A sequence's dQ, dK and dV have the same bits in a batch of four, in a shuffled batch of
    three, alone, and in a second identical run."""
    full = _sequence_grads(LENS, [0, 1, 2, 3], dtype, seed=11, sliding_window=sliding_window)
    again = _sequence_grads(LENS, [0, 1, 2, 3], dtype, seed=11, sliding_window=sliding_window)
    shuffled = _sequence_grads(LENS, [3, 2, 0], dtype, seed=11, sliding_window=sliding_window)
    alone = _sequence_grads(LENS, [2], dtype, seed=11, sliding_window=sliding_window)
    assert _mismatches(full, again) == []
    assert _mismatches(full, shuffled) == []
    assert _mismatches(full, alone) == []


def test_negative_control_other_kv_tiles_change_dq() -> None:
    """The same harness (fp32 gradients, where a last-bit difference is not hidden by a 16-bit
    cast) with 32-key backward tiles — dQ partials summed over other key ranges — reports every
    sequence longer than one 16-key tile."""
    full = _sequence_grads(LENS, [0, 1, 2, 3], torch.float32, seed=11)
    cpu = attention_config(80, torch.float32, torch.device("cpu"))
    other = dataclasses.replace(cpu, bwd_block_n=2 * cpu.bwd_block_n)
    changed = _sequence_grads(LENS, [3, 2, 0, 1], torch.float32, seed=11, config=other)
    assert _mismatches(full, changed) == [3, 2, 0]
    assert [i for i in changed if not torch.equal(full[i][0], changed[i][0])] == [3, 2, 0]


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.ascend") is not None,
    reason="Triton-Ascend replaces upstream Triton, which compiles for CUDA",
)
def test_sm90_build_orders_the_dq_sums_through_l2() -> None:
    """The compiled (sm_90) backward keeps the protocol's memory ordering: counter atomics with
    acquire-release semantics at GPU scope, and the fp32 dQ sums read and written through L2
    (``.cg``), never from an SM's non-coherent L1."""
    from samepath.kernels.compile_check import compile_launch, record_launches

    config = ATTENTION_TABLE["cuda", "bfloat16", 128]
    batch = make_batch([40], 4, 1, 128, torch.bfloat16, seed=5)
    with record_launches() as launches:
        _grads(batch, torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(6)), config=config)
    (launch,) = [launch for launch in launches if launch.name == "_attention_bwd_kernel"]
    ptx = compile_launch(launch).asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.cg" in ptx and "st.global.cg" in ptx


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.ascend") is not None,
    reason="Triton-Ascend replaces upstream Triton, which compiles for CUDA",
)
def test_sm90_training_attention_tiles(monkeypatch) -> None:
    """The compile report's training case (bf16, head 128, GQA 32/8) on the CUDA table: the forward at
    128 query rows on wgmma, every backward dot on wgmma (no mma.sync), delta in the preprocessing
    kernel, nothing spills. Negative control: 16-key backward tiles (M = 16) fall back to mma.sync."""
    from samepath.kernels import compile_check
    from samepath.kernels import config as config_module

    def kernels() -> dict[str, dict]:
        (case,) = compile_check.compile_report(cases=["attention-training"])["cases"]
        return {k["kernel"]: k for k in case["kernels"]}

    found = kernels()
    assert set(found) == {"_attention_fwd_kernel", "_attention_bwd_preprocess_kernel", "_attention_bwd_kernel"}
    forward, backward = found["_attention_fwd_kernel"], found["_attention_bwd_kernel"]
    assert forward["constexprs"]["BLOCK_M"] == 128 and forward["mma"] == "wgmma" and forward["num_warps"] == 8
    assert backward["mma"] == "wgmma" and not backward["mma_sync"]
    assert all(k["spill_stores"] == k["spill_loads"] == 0 for k in found.values())
    table = dict(config_module.ATTENTION_TABLE)
    key = ("cuda", "bfloat16", 128)
    table[key] = dataclasses.replace(table[key], bwd_block_n=16)
    monkeypatch.setattr(config_module, "ATTENTION_TABLE", table)
    assert kernels()["_attention_bwd_kernel"]["mma_sync"]
