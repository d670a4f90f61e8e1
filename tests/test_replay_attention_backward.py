"""The CPU replay of the attention backward (``samepath.kernels.replay.attention_backward``) is
bit-identical to Triton's interpreter: every tensor argument of ``_attention_bwd_kernel`` (dQ, dK,
dV, the fp32 dQ row sums and the turn counters) compared by the ``verify`` executor, through
``varlen_attention``'s autograd and Hugging Face's attention function as training calls them.
Plus a negative control: a replay that sums the dQ partials in descending KV-tile order is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_harness import make_batch

import samepath.kernels.replay.attention_backward as replay_module
from samepath.integrations.hf import attention_forward
from samepath.kernels.attention import LaunchPlan, varlen_attention
from samepath.kernels.config import ATTENTION_TABLE
from samepath.kernels.dispatch import ReplayMismatch, cpu_executor


@pytest.fixture
def replay_calls(monkeypatch) -> list[int]:
    """Counts the replay's dQ folds, proving the replay (not only the interpreter) ran."""
    calls: list[int] = []
    fold = replay_module.fold_dq_partials

    def counted(partials: np.ndarray) -> np.ndarray:
        calls.append(1)
        return fold(partials)

    monkeypatch.setattr(replay_module, "fold_dq_partials", counted)
    return calls


def _verified_backward(lens, num_heads, num_kv_heads, head_size, dtype, seed, **kwargs) -> None:
    batch = make_batch(lens, num_heads, num_kv_heads, head_size, dtype, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    with cpu_executor("verify"):
        varlen_attention(*leaves, batch.cu_seqlens, **kwargs).backward(grad_out)
    assert all(leaf.grad is not None and leaf.grad.isfinite().all() for leaf in leaves)


CASES = {
    "fp32-group2-d64": ([23, 40], 4, 2, 64, torch.float32, {}),
    "bf16-group4-d64-window13": ([23, 40], 4, 1, 64, torch.bfloat16, {"sliding_window": 13}),
    "fp16-group3-d80-length1": ([5, 37, 1], 3, 1, 80, torch.float16, {}),
    "bf16-group18-two-chunks-d128-window9": ([19], 18, 1, 128, torch.bfloat16, {"sliding_window": 9}),
    "fp32-non-causal-d64": ([20, 17], 2, 2, 64, torch.float32, {"causal": False}),
    "fp16-empty-sequences-d128": ([0, 9, 0, 26], 2, 1, 128, torch.float16, {"scale": 0.3}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_varlen_backward_replay_is_the_interpreter(case, replay_calls) -> None:
    lens, num_heads, num_kv_heads, head_size, dtype, kwargs = case
    _verified_backward(lens, num_heads, num_kv_heads, head_size, dtype, seed=len(lens) + num_heads, **kwargs)
    assert replay_calls


@pytest.mark.parametrize(
    "dtype,sliding_window", [(torch.bfloat16, None), (torch.float16, 30)], ids=["bf16-causal", "fp16-window30"]
)
def test_cuda_tiles_replay_is_the_interpreter(dtype, sliding_window, replay_calls) -> None:
    """The CUDA row's tiles (32 packed rows, 64-key tiles: a query tile meets several KV tiles and a
    KV tile many query tiles), head size 80, an unaligned second sequence."""
    config = ATTENTION_TABLE["cuda", {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], 128]
    _verified_backward([70, 29], 4, 2, 80, dtype, seed=7, sliding_window=sliding_window, config=config)
    assert replay_calls


def test_plan_and_unchecked_metadata_replay_is_the_interpreter(replay_calls) -> None:
    """The trainer's call (``validate=False`` with a plan), on metadata that overruns the tokens:
    the backward runs on ``clamp_cu_seqlens`` of it, and rows outside every clamped sequence
    (the dQ row sums of single-contributor tiles too) are left as they were by both."""
    batch = make_batch([30, 10], 4, 2, 64, torch.bfloat16, seed=11)
    cu = torch.tensor([0, 30, 52], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    with cpu_executor("verify"):
        plan = LaunchPlan(cu, batch.query.shape[0])
        varlen_attention(*leaves, cu, validate=False, plan=plan).backward(grad_out)
    assert replay_calls


def test_hugging_face_training_backward_replay_is_the_interpreter(replay_calls) -> None:
    """Hugging Face's attention function as training calls it: packed rows with restarting
    ``position_ids``, and right-padded rows with a 2-D mask, both differentiated."""
    gen = torch.Generator().manual_seed(5)
    module = torch.nn.Module()
    query = torch.randn(2, 4, 21, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    key, value = (torch.randn(2, 2, 21, 64, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, 13:] = 0
    positions = torch.cat([torch.arange(8), torch.arange(13)])[None]
    with cpu_executor("verify"):
        packed, _ = attention_forward(module, query[:1], key[:1], value[:1], None, position_ids=positions)
        padded, _ = attention_forward(module, query, key, value, mask, sliding_window=6)
        (packed.float().sum() + (padded.float() * torch.randn(padded.shape, generator=gen)).sum()).backward()
    assert replay_calls and query.grad.isfinite().all()


def test_negative_control_descending_dq_order_is_caught(monkeypatch) -> None:
    """Summing each query tile's dQ partials from the last KV tile down must be reported."""

    def descending(partials: np.ndarray) -> np.ndarray:
        return np.add.accumulate(partials[:, ::-1], axis=1)[:, ::-1]

    monkeypatch.setattr(replay_module, "fold_dq_partials", descending)
    with pytest.raises(ReplayMismatch, match="'dQ'"):
        _verified_backward([40, 23], 4, 2, 64, torch.float32, seed=3)
