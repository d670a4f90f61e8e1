"""Triton-Ascend: every samepath kernel, as launched, lowers to Triton-Ascend's MLIR.

Runs only where Triton-Ascend replaces upstream Triton (``nox -s ascend`` builds that
environment); the consistency tests run there too, under Triton-Ascend's interpreter.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton.backends.ascend") is None:
    pytest.skip("Triton-Ascend is not installed (run `nox -s ascend`)", allow_module_level=True)

import samepath
from samepath.kernels.compile_check import lower_for_ascend, record_launches
from samepath.kernels.config import ATTENTION_TABLE, MATMUL_TABLE

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter


def _exercise_every_kernel(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    q, k, v = rand(20, 4, 80), rand(20, 2, 80), rand(20, 2, 80)
    attention_config = ATTENTION_TABLE["npu", {torch.float32: "float32"}.get(dtype, "bfloat16"), 128]
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    samepath.varlen_attention(q, k, v, cu, config=attention_config, sliding_window=6).sum().backward()
    caches = torch.zeros(4, 16, 2, 80, dtype=dtype), torch.zeros(4, 16, 2, 80, dtype=dtype)
    samepath.write_kv_cache(k.detach(), v.detach(), *caches, torch.arange(20))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    samepath.paged_attention(
        q.detach(), *caches, table, cu, torch.tensor([12, 8], dtype=torch.int32), 0.1, config=attention_config
    )
    matmul_config = MATMUL_TABLE["npu", {torch.float32: "float32"}.get(dtype, "bfloat16")]
    x, w, b = rand(5, 48), rand(40, 48), rand(40)
    samepath.linear(x, w, b, config=matmul_config).sum().backward()
    # K slices of a decode-sized GEMM: fp32 partials as parallel programs, then the ordered reduction
    samepath.matmul(x.detach(), w.detach().t(), b.detach(), k_slices=2, config=matmul_config)
    logits = rand(3, 1000)
    lp, entropy = samepath.token_logprobs(logits, torch.tensor([1, 5, 999]), 0.7, return_entropy=True)
    (lp.sum() + entropy.sum()).backward()
    samepath.log_softmax(logits).sum().backward()
    from samepath.kernels.grouped_matmul import expert_plan, grouped_linear, grouped_weight_grad

    plan = expert_plan(torch.tensor([[0, 2], [1, 2], [2, 0]]), 3, matmul_config.block_m)
    pairs = grouped_linear(x.detach()[:3], rand(3, 40, 48).detach(), plan, rows_per_pair=False, config=matmul_config)
    grouped_weight_grad(pairs, x.detach()[:3], plan, 3, rows_per_pair=False, config=matmul_config)
    with samepath.batch_invariant():  # aten softmax / sum / mean: row, row-sum and column kernels
        torch.softmax(logits.detach(), -1)
        logits.detach().mean(-1)
        logits.detach().sum(0)
        torch.var_mean(logits.detach(), -1)
        logits.detach().norm(dim=-1)
    h, weight = rand(3, 80), rand(80)
    samepath.rms_norm(h, weight, 1e-6).sum().backward()
    samepath.silu_mul(rand(3, 80), rand(3, 80)).sum().backward()
    positions = torch.arange(6)[None]
    cos, sin = samepath.rotary_cos_sin(positions, 32, 10000.0, dtype)
    qr, kr = samepath.apply_rotary(rand(1, 4, 6, 32), rand(1, 2, 6, 32), cos, sin)
    (qr.sum() + kr.sum()).backward()
    from samepath.kernels import gated_delta as gd  # Gated DeltaNet: forward, backward, the slot path

    qg, kg, vg = rand(5, 1, 16), rand(5, 1, 16), rand(5, 2, 16)
    gates, betas = (-torch.rand(5, 2, generator=gen)).requires_grad_(), torch.rand(5, 2, generator=gen)
    gd.chunk_gated_delta(qg, kg, vg, gates, betas, cu // 4)[0].float().sum().backward()
    slots = gd.GatedDeltaSlots.allocate(2, 1, 2, 16, 16, dtype)
    ids = torch.tensor([1, 0])
    gd.gated_delta_continue_slots(qg.detach(), kg.detach(), vg.detach(), gates.detach(), betas, cu // 4, slots, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_kernel_lowers_for_ascend(dtype: torch.dtype) -> None:
    with record_launches() as launches:
        _exercise_every_kernel(dtype)
    results = {}
    for launch in launches:
        results.setdefault(launch.name, lower_for_ascend(launch))
    assert set(results.values()) <= {"mlir", "binary"}
    assert len(results) >= 12, sorted(results)
    assert {"_matmul_kernel", "_matmul_reduce_kernel", "_rms_norm_fwd_kernel", "_silu_mul_kernel"} <= set(results)
    assert {"_attention_fwd_kernel", "_attention_bwd_preprocess_kernel", "_attention_bwd_kernel"} <= set(results)
    assert {
        "_softmax_kernel",
        "_row_sum_kernel",
        "_column_sum_kernel",
        "_row_var_kernel",
        "_row_norm_kernel",
        "_grouped_matmul_kernel",
        "_grouped_weight_grad_kernel",
    } <= set(results)
    assert {"_gated_delta_fwd_kernel", "_gated_delta_bwd_state_kernel", "_gated_delta_bwd_qkg_kernel"} <= set(results)


def test_chunked_rms_norm_lowers_for_ascend(monkeypatch) -> None:
    """The NPU table folds RMSNorm rows longer than ``norm_chunk`` in chunks: that path lowers too."""
    import importlib

    from samepath.kernels.config import ROW_REDUCE_TABLE

    module = importlib.import_module("samepath.kernels.rms_norm")
    monkeypatch.setattr(module, "row_reduce_config", lambda device: ROW_REDUCE_TABLE["npu"])
    gen = torch.Generator().manual_seed(1)
    hidden = ROW_REDUCE_TABLE["npu"].norm_chunk + 40
    x = torch.randn(2, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    with record_launches() as launches:
        y, s = samepath.rms_norm(x, weight, 1e-6, residual=x.detach().clone())
        (y.float().sum() + s.float().sum()).backward()
    assert {launch.name for launch in launches} >= {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"}
    for launch in launches:
        assert lower_for_ascend(launch) in {"mlir", "binary"}, launch.name
