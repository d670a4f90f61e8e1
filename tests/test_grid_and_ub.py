"""Triton-Ascend adaptation: persistent grids (any program count gives the same bits) and the
unified-buffer estimate of every frozen NPU tile."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import triton

import samepath
from samepath.distributed import merge_shard_lse, shard_lse
from samepath.kernels import grid, ub_fit
from samepath.kernels.clamped_swiglu import clamped_swiglu_mul
from samepath.kernels.config import (
    ATTENTION_TABLE,
    MATMUL_TABLE,
    ROW_REDUCE_TABLE,
    SUPPORTED_DTYPES,
    AttentionConfig,
    MatmulConfig,
    RowReduceConfig,
    matmul_config,
    padded_head_size,
)
from samepath.kernels.dispatch import DualJITFunction
from samepath.kernels.matmul import matmul

#: Every samepath kernel; each must be launched through the grid adapter.
ALL_KERNELS = {
    "_attention_fwd_kernel",
    "_attention_bwd_kernel",
    "_attention_bwd_preprocess_kernel",
    "_attention_merge_kernel",
    "_write_kv_cache_kernel",
    "_matmul_kernel",
    "_matmul_reduce_kernel",
    "_token_logprobs_fwd_kernel",
    "_token_logprobs_bwd_kernel",
    "_log_softmax_fwd_kernel",
    "_log_softmax_bwd_kernel",
    "_rms_norm_fwd_kernel",
    "_rms_norm_bwd_kernel",
    "_rms_norm_dw_reduce_kernel",
    "_silu_mul_kernel",
    "_gelu_tanh_mul_kernel",
    "_clamped_swiglu_kernel",
    "_rotary_kernel",
    "_shard_lse_kernel",
    "_merge_kernel",
    "_row_sum_kernel",
    "_softmax_kernel",
    "_column_sum_kernel",
    "_row_var_kernel",
    "_row_norm_kernel",
    "_grouped_matmul_kernel",
    "_grouped_weight_grad_kernel",
    "_kept_count_kernel",
}


# ----------------------------------------------------------------------------------------------
# The adapter
# ----------------------------------------------------------------------------------------------


def test_cap_programs_binds_to_cores_and_65535() -> None:
    assert grid.cap_programs(10, 40) == 10
    assert grid.cap_programs(1000, 40) == 40
    assert grid.cap_programs(10**6, 10**6) == grid.MAX_PROGRAMS == 65535
    assert grid.cap_programs(0, 40) == 0
    with pytest.raises(ValueError, match="work_items"):
        grid.cap_programs(-1, 40)
    with pytest.raises(ValueError, match="cores"):
        grid.cap_programs(10, 0)


def test_num_programs_is_the_work_on_cpu_and_cuda() -> None:
    assert grid.num_programs(100_000, torch.device("cpu"), uses_dot=True) == 100_000
    assert grid.num_programs(100_000, "cuda") == 100_000
    with pytest.raises(ValueError, match="work_items"):
        grid.num_programs(-3, "cpu")
    with pytest.raises(ValueError, match="device"):
        grid.num_programs(3, "mps")


class _FakeAscendDriver:
    """Triton-Ascend's driver surface the adapter reads: ``get_current_device`` and
    ``utils.get_device_properties(index)``."""

    def __init__(self) -> None:
        self.queried: list[int] = []
        driver = self

        class Utils:
            def get_device_properties(self, index: int) -> dict[str, int]:
                driver.queried.append(index)
                return {"max_shared_mem": 1, "num_aicore": 20 + index, "num_vectorcore": 2 * (20 + index)}

        self.utils = Utils()

    def get_current_device(self) -> int:
        return 1


@pytest.fixture
def fake_ascend_driver() -> Iterator[_FakeAscendDriver]:
    fake = _FakeAscendDriver()
    config = triton.runtime.driver
    # reset_active() would build the default driver (a GPU's, or Triton-Ascend's NPU one): restore
    # the config's own state instead.
    saved = dict(vars(config))
    grid._npu_core_counts.cache_clear()
    config.set_active(fake)
    try:
        yield fake
    finally:
        vars(config).clear()
        vars(config).update(saved)
        grid._npu_core_counts.cache_clear()


def test_num_programs_on_npu_binds_to_the_driver_core_counts(fake_ascend_driver: _FakeAscendDriver) -> None:
    # dot kernels on the AI cores, the others on the vector cores; "npu" is the current device (1).
    assert grid.num_programs(1000, "npu", uses_dot=True) == 21
    assert grid.num_programs(1000, "npu") == 42
    assert grid.num_programs(1000, "npu:0", uses_dot=True) == 20
    assert grid.num_programs(5, "npu:0") == 5
    assert grid.num_programs(0, "npu") == 0
    # Core counts are read once per device.
    grid.num_programs(10**6, "npu:0")
    assert sorted(fake_ascend_driver.queried) == [0, 1]


def test_num_programs_on_npu_never_exceeds_65535(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grid, "_npu_core_counts", lambda index: (100_000, 200_000))
    assert grid.num_programs(10**7, "npu", uses_dot=True) == 65535
    assert grid.num_programs(70_000, "npu") == 65535
    assert grid.num_programs(1234, "npu") == 1234


# ----------------------------------------------------------------------------------------------
# Any grid gives the same bits
# ----------------------------------------------------------------------------------------------


@contextmanager
def forced_programs(monkeypatch: pytest.MonkeyPatch, count: int | None) -> Iterator[dict[str, list[tuple]]]:
    """Launch every kernel with ``min(work, count)`` programs (``None``: the adapter's answer);
    yields ``{kernel: [(work_items, grid), ...]}`` of the launches."""
    launches: dict[str, list[tuple]] = {}
    pending: list[int] = []
    original_num_programs = grid.num_programs
    original_run = DualJITFunction.run

    def num_programs(
        work_items: int, device: torch.device | str, *, uses_dot: bool = False, persistent: bool = False
    ) -> int:
        pending.append(work_items)
        answer = original_num_programs(work_items, device, uses_dot=uses_dot, persistent=persistent)
        return answer if count is None else min(answer, count)

    def run(self: DualJITFunction, *args, grid, warmup, **kwargs):
        launches.setdefault(self.fn.__name__, []).append((pending.pop() if pending else None, grid))
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with monkeypatch.context() as patch:
        # dweight partials over 16 rows of 2048 columns: 130 rows of RMSNorm make 9 work items
        patch.setattr(importlib.import_module("samepath.kernels.rms_norm"), "GROUP_ELEMENTS", 16 * 2048)
        patch.setattr(grid, "num_programs", num_programs)
        patch.setattr(DualJITFunction, "run", run)
        yield launches


def _run_every_kernel(dtype: torch.dtype, seed: int, attention_config: AttentionConfig | None = None) -> dict:
    """Every samepath kernel, forward and backward, on fresh random inputs with unaligned sizes,
    GQA and padding; sized so that each kernel has more than 7 work items in some launch."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    def grads(outputs: tuple, inputs: tuple) -> tuple:
        cotangents = tuple(torch.randn(o.shape, generator=gen).to(o.dtype) for o in outputs)
        return torch.autograd.grad(outputs, inputs, cotangents)

    results: dict[str, tuple] = {}
    q, k, v = rand(57, 4, 80), rand(57, 2, 80), rand(57, 2, 80)
    cu = torch.tensor([0, 37, 40, 57], dtype=torch.int32)
    for window in (None, 9):
        out = samepath.varlen_attention(q, k, v, cu, sliding_window=window, config=attention_config)
        results[f"varlen_attention window={window}"] = (out, *grads((out,), (q, k, v)))
    caches = torch.zeros(9, 16, 2, 80, dtype=dtype), torch.zeros(9, 16, 2, 80, dtype=dtype)
    slots = torch.cat([torch.arange(0, 37), torch.full((3,), -1), torch.arange(96, 113)])
    samepath.write_kv_cache(k.detach(), v.detach(), *caches, slots)
    results["write_kv_cache"] = caches
    table = torch.tensor([[0, 1, 2], [3, 4, 0], [6, 7, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    seq_lens = torch.tensor([37, 3, 17], dtype=torch.int32)
    results["paged_attention"] = (
        samepath.paged_attention(q.detach()[:23], *caches, table, query_start_loc, seq_lens, 0.1),
    )
    # Every token of the three sequences, with KV segments as programs and the merge kernel.
    wide_table = torch.nn.functional.pad(table, (0, 2))
    results["paged_attention split"] = (
        samepath.paged_attention(
            q.detach(), *caches, wide_table, cu, torch.tensor([37, 3, 17], dtype=torch.int32), 0.1, split_kv=True
        ),
    )
    sinks = torch.randn(q.shape[1], generator=gen)
    results["paged_attention split sinks"] = (
        samepath.paged_attention(
            q.detach(), *caches, wide_table, cu, torch.tensor([37, 3, 17], dtype=torch.int32), 0.1, split_kv=True,
            sinks=sinks,
        ),
    )  # fmt: skip

    x, w, b = rand(37, 70), rand(45, 70), rand(45)
    y = samepath.linear(x, w, b)
    results["linear"] = (y, *grads((y,), (x, w, b)))
    # 111 rows: 14 tiles, fewer than the CPU's 16, so the K slices run as parallel partials.
    results["matmul k_slices=2"] = (matmul(torch.cat([x.detach()] * 3), w.detach().t(), k_slices=2),)

    logits = rand(2, 5, 3000)
    labels = torch.randint(0, 3000, (2, 5), generator=gen)
    labels[0, 1] = -100
    logprob, entropy = samepath.token_logprobs(logits, labels, 0.7, return_entropy=True)
    results["token_logprobs"] = (logprob, entropy, *grads((logprob, entropy), (logits,)))
    log_p = samepath.log_softmax(logits, 1.3)
    results["log_softmax"] = (log_p, *grads((log_p,), (logits,)))

    h, residual, weight = rand(130, 1800), rand(130, 1800), rand(1800)
    y = samepath.rms_norm(h, weight, 1e-6)
    results["rms_norm"] = (y, *grads((y,), (h, weight)))
    y, s = samepath.rms_norm(h, weight, 1e-6, residual=residual)
    results["rms_norm residual"] = (y, s, *grads((y, s), (h, residual, weight)))
    y, s = samepath.rms_norm(h, weight, 1e-6, residual=residual, weight_mode="fp32_one_plus_weight")
    results["rms_norm residual gemma"] = (y, s, *grads((y, s), (h, residual, weight)))

    gate, up = rand(5, 3000), rand(5, 3000)
    y = samepath.silu_mul(gate, up)
    results["silu_mul"] = (y, *grads((y,), (gate, up)))
    y = samepath.gelu_tanh_mul(gate, up)
    results["gelu_tanh_mul"] = (y, *grads((y,), (gate, up)))
    y = clamped_swiglu_mul(gate, up, 7.0, 1.702)
    results["clamped_swiglu"] = (y, *grads((y,), (gate, up)))

    cos, sin = samepath.rotary_cos_sin(torch.arange(130)[None], 48, 10000.0, dtype)
    q_rot, k_rot = rand(1, 4, 130, 64), rand(1, 2, 130, 64)
    qr, kr = samepath.apply_rotary(q_rot, k_rot, cos, sin)
    results["apply_rotary"] = (qr, kr, *grads((qr, kr), (q_rot, k_rot)))

    shard_logits = torch.randn(10, 400, generator=gen).to(dtype)
    shard_labels = torch.randint(0, 400, (10,), generator=gen)
    states = [shard_lse(shard_logits[:, i * 100 : (i + 1) * 100], shard_labels, i * 100, 0.7) for i in range(4)]
    results["shard_lse"] = tuple(torch.stack([state[i] for state in states]) for i in (0, 1))
    # The merge on 120 rows of synthetic shard states (8 blocks of 16 rows), a quarter of them -inf.
    lse = torch.randn(4, 120, generator=gen)
    zlab = torch.where(torch.rand(4, 120, generator=gen) < 0.25, float("-inf"), torch.randn(4, 120, generator=gen))
    results["merge_shard_lse"] = (merge_shard_lse(lse, zlab, torch.randint(0, 400, (120,), generator=gen), 100),)

    rows = torch.randn(20, 300, generator=gen).to(dtype)
    with samepath.batch_invariant():  # softmax, row sums, a 10-tile column sum, var_mean, norm
        results["reductions"] = (torch.softmax(rows, -1), rows.sum(-1), rows.sum(0), *torch.var_mean(rows, -1))
        results["reductions"] += (rows.norm(dim=-1),)
    from samepath.kernels.grouped_matmul import expert_plan, grouped_linear, grouped_weight_grad
    from samepath.kernels.sampling import sampling_keep_mask

    index = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(10)])
    block_m = matmul_config(dtype, "cpu").block_m
    plan = expert_plan(index, 3, block_m)
    pairs = grouped_linear(
        torch.randn(10, 40, generator=gen).to(dtype), rand(3, 64, 40).detach(), plan, rows_per_pair=False
    )
    results["grouped"] = (
        pairs,
        grouped_weight_grad(pairs, torch.randn(20, 40, generator=gen).to(dtype), plan, 3, rows_per_pair=True),
    )
    results["keep_mask"] = (sampling_keep_mask(rows.float(), top_k=50, top_p=0.9, min_p=0.01),)
    return {name: tuple(t.detach() for t in tensors) for name, tensors in results.items()}


def _mismatches(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True))]


_reference: dict[torch.dtype, tuple[dict, dict]] = {}


def _default_run(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, dict]:
    if dtype not in _reference:
        with forced_programs(monkeypatch, None) as launches:
            results = _run_every_kernel(dtype, seed=7)
        _reference[dtype] = results, launches
    return _reference[dtype]


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_any_program_count_gives_the_same_bits(
    dtype: torch.dtype, programs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, default_launches = _default_run(dtype, monkeypatch)
    # On the CPU the default grid is one program per work item.
    assert set(default_launches) == ALL_KERNELS
    assert all(g == (work,) for calls in default_launches.values() for work, g in calls)

    with forced_programs(monkeypatch, programs) as launches:
        forced = _run_every_kernel(dtype, seed=7)
    assert set(launches) == ALL_KERNELS
    for name, calls in launches.items():
        assert all(g == (min(work, programs),) for work, g in calls), name
        # Some launch of every kernel really made its programs take several work items.
        assert max(work for work, _ in calls) > programs, name
    assert _mismatches(reference, forced) == []


def test_negative_control_the_comparison_sees_a_different_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same harness with another KV tile (a different schedule) must report attention rows."""
    reference, _ = _default_run(torch.float32, monkeypatch)
    other = AttentionConfig(block_m=16, tile_n=16)
    with forced_programs(monkeypatch, 3):
        changed = _run_every_kernel(torch.float32, seed=7, attention_config=other)
    assert "varlen_attention window=None" in _mismatches(reference, changed)


_ON_TRITON_ASCEND = importlib.util.find_spec("triton.backends.ascend") is not None


def _record_distributed_launches() -> list:
    from samepath.kernels.compile_check import record_launches

    logits = torch.randn(6, 300).to(torch.bfloat16)
    labels = torch.randint(0, 300, (6,))
    with record_launches() as launches:
        states = [shard_lse(logits[:, i * 100 : (i + 1) * 100], labels, i * 100) for i in range(3)]
        merge_shard_lse(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]), labels, 100)
    assert {launch.name for launch in launches} == {"_shard_lse_kernel", "_merge_kernel"}
    return launches


@pytest.mark.skipif(not _ON_TRITON_ASCEND, reason="Triton-Ascend is not installed (run under `nox -s ascend`)")
def test_distributed_kernels_lower_for_ascend() -> None:
    """tests/test_ascend.py lowers the other kernels, with their persistent loops."""
    from samepath.kernels.compile_check import lower_for_ascend

    assert {lower_for_ascend(launch) for launch in _record_distributed_launches()} <= {"mlir", "binary"}


@pytest.mark.skipif(_ON_TRITON_ASCEND, reason="Triton-Ascend replaces upstream Triton, which compiles for CUDA")
def test_distributed_kernels_compile_for_hopper() -> None:
    from samepath.kernels.compile_check import compile_launch

    for launch in _record_distributed_launches():
        compile_launch(launch)


# ----------------------------------------------------------------------------------------------
# Unified-buffer estimate
# ----------------------------------------------------------------------------------------------

NPU_DTYPES = sorted(SUPPORTED_DTYPES.values())


@pytest.mark.parametrize("head_size", [64, 128, 80, 256])
@pytest.mark.parametrize("dtype", NPU_DTYPES)
def test_npu_attention_tiles_fit_the_unified_buffer(dtype: str, head_size: int) -> None:
    config = ATTENTION_TABLE["npu", dtype, padded_head_size(head_size)]
    assert 0 < ub_fit.check_attention(config, head_size, dtype) <= ub_fit.UB_BYTES


@pytest.mark.parametrize("dtype", NPU_DTYPES)
def test_npu_matmul_and_vocab_tiles_fit_the_unified_buffer(dtype: str) -> None:
    assert 0 < ub_fit.check_matmul(MATMUL_TABLE["npu", dtype], dtype) <= ub_fit.UB_BYTES
    assert 0 < ub_fit.check_logprobs(ROW_REDUCE_TABLE["npu"], dtype) <= ub_fit.UB_BYTES


@pytest.mark.parametrize("dtype", NPU_DTYPES)
def test_npu_rms_norm_rows_fit_the_unified_buffer(dtype: str) -> None:
    """Rows up to ``norm_block_max`` fit because rows longer than ``norm_chunk`` are folded in
    chunks; held whole, the longest would not (negative control)."""
    npu = ROW_REDUCE_TABLE["npu"]
    for hidden in (1024, 4096, 5120, 8192, npu.norm_block_max):
        ub_fit.check_rms_norm(hidden, dtype, "norm_chunk", norm_chunk=npu.norm_chunk)
    with pytest.raises(ValueError, match=r"^norm_block_max does not fit"):
        ub_fit.check_rms_norm(npu.norm_block_max, dtype, "norm_block_max")


@pytest.mark.parametrize("dtype", NPU_DTYPES)
def test_largest_rms_norm_row_that_fits(dtype: str) -> None:
    largest = ub_fit.max_rms_norm_hidden(dtype)
    assert largest == 4096
    assert ub_fit.check_rms_norm(largest, dtype) <= ub_fit.UB_BYTES
    with pytest.raises(ValueError, match=r"^hidden does not fit"):
        ub_fit.check_rms_norm(largest + 1, dtype)


def test_a_tile_that_cannot_fit_raises_naming_the_argument() -> None:
    big_attention = AttentionConfig(block_m=128, tile_n=256)
    with pytest.raises(ValueError, match=r"^config does not fit .*_attention_fwd_kernel .*tile_n=256.*UB"):
        ub_fit.check_attention(big_attention, 128, torch.float32)
    with pytest.raises(ValueError, match=r"^tuned does not fit .*_matmul_kernel"):
        ub_fit.check_matmul(MatmulConfig(block_m=256, block_n=256, block_k=128), torch.bfloat16, "tuned")
    with pytest.raises(ValueError, match=r"^config\.vocab_chunk does not fit"):
        ub_fit.check_logprobs(RowReduceConfig(vocab_chunk=16384), "float32")
    # The cube's L1 is checked too: long K and V tiles of a wide head overflow it, not the UB.
    with pytest.raises(ValueError, match=r"^config does not fit .*524288-byte L1 buffer"):
        ub_fit.check_attention(AttentionConfig(block_m=16, tile_n=256), 256, torch.float32)
    # The backward holds dK and dV of a KV tile across its loop: long backward KV tiles of a wide
    # head overflow the UB while the forward's tiles fit.
    with pytest.raises(ValueError, match=r"^config does not fit .*_attention_bwd_kernel .*bwd_block_n=64.*UB"):
        ub_fit.check_attention(AttentionConfig(block_m=16, tile_n=32, bwd_block_n=64), 256, torch.float32)
    assert ub_fit.check_attention(AttentionConfig(block_m=16, tile_n=32), 256, torch.float32) <= ub_fit.UB_BYTES
    with pytest.raises(ValueError, match="dtype"):
        ub_fit.check_matmul(MATMUL_TABLE["npu", "float32"], torch.float64)
    with pytest.raises(ValueError, match="hidden"):
        ub_fit.check_rms_norm(0, torch.float32)


def test_buffers_are_aligned_and_loop_loads_double_buffered() -> None:
    assert ub_fit.Buffer("mask", (3,), "int1").nbytes == 32
    assert ub_fit.Buffer("k", (64, 64), "bfloat16", copies=2).nbytes == 2 * 64 * 64 * 2
    tiles = ub_fit.attention_forward_buffers(16, 64, 128, "bfloat16")
    k = next(b for b in tiles if b.name == "k")
    assert (k.shape, k.copies, k.memory) == ((128, 64), 2, "l1")
    # A larger KV tile needs more of both memories.
    larger = ub_fit.attention_forward_buffers(16, 128, 128, "bfloat16")
    assert ub_fit.footprint(larger) > ub_fit.footprint(tiles)
    assert ub_fit.footprint(larger, "l1") > ub_fit.footprint(tiles, "l1")
