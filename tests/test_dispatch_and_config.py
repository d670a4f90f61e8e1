"""Device dispatch, the frozen numerics table and its fingerprint, and compiled-mode validity."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from attention_harness import make_batch, run_schedule
from triton.runtime.jit import JITFunction

import samepath
from samepath.kernels import config as config_module
from samepath.kernels.attention import varlen_attention
from samepath.kernels.compile_check import compile_launch, record_launches
from samepath.kernels.dispatch import fp32_to_bf16_bits


def _language_state() -> dict[str, object]:
    """Every attribute of triton.language that the interpreter patches, by identity."""
    return {
        f"{owner.__name__}.{name}": getattr(owner, name)
        for owner in (tl, tl.core, tl.math, tl.core.tensor)
        for name in dir(owner)
        if name not in ("__annotations__", "__dict__")
    }


def test_cpu_tensors_run_under_the_interpreter_without_settings() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "the CPU path must not need TRITON_INTERPRET"
    original_call = JITFunction.__call__
    language_before = _language_state()
    batch = make_batch([20], 2, 1, 64, torch.float32, seed=0)
    out = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    assert torch.isfinite(out).all()
    # the interpreter shims are scoped to the launch
    assert JITFunction.__call__ is original_call
    changed = [name for name, obj in _language_state().items() if language_before.get(name) != obj]
    assert changed == [], "triton.language must be left unpatched for compiled kernels"


def test_bf16_cast_rounds_to_nearest_even_like_torch() -> None:
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100
    values = torch.cat([values, torch.tensor([float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40])])
    ours = torch.from_numpy(fp32_to_bf16_bits(values.numpy()).view("int16")).view(torch.bfloat16)
    assert torch.equal(ours, values.to(torch.bfloat16))
    assert fp32_to_bf16_bits(torch.tensor([float("nan")]).numpy())[0] == 0x7FC0


def test_fingerprint_is_stable_and_covers_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    fp = samepath.fingerprint()
    assert fp == samepath.fingerprint() and fp.startswith(f"sp{config_module.NUMERICS_VERSION}-")
    samepath.assert_same_numerics(fp)

    key = ("cpu", "bfloat16", 128)
    changed = dict(config_module.ATTENTION_TABLE)
    changed[key] = dataclasses.replace(changed[key], tile_n=64)
    monkeypatch.setattr(config_module, "ATTENTION_TABLE", changed)
    assert samepath.fingerprint() != fp
    with pytest.raises(samepath.NumericsMismatchError, match="numerics fingerprint mismatch"):
        samepath.assert_same_numerics(fp)


def test_fingerprint_covers_formula_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    fp = samepath.fingerprint()
    monkeypatch.setitem(config_module.ATTENTION_FORMULA, "exp", "exp")
    assert samepath.fingerprint() != fp


def test_config_lookup_and_validation() -> None:
    cfg = config_module.attention_config(80, torch.bfloat16, torch.device("cpu"))
    assert cfg == config_module.ATTENTION_TABLE["cpu", "bfloat16", 128]
    for device in ("cpu", "cuda", "npu"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for head_size in (16, 64, 80, 96, 128, 256):
                config_module.attention_config(head_size, dtype, device)
    with pytest.raises(ValueError, match="tile_n must be a power of two"):
        config_module.AttentionConfig(block_m=16, tile_n=24)
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        config_module.AttentionConfig(block_m=0, tile_n=32)


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_compile_for_hopper(dtype: torch.dtype) -> None:
    """Every kernel, as actually launched (paged and contiguous, forward and backward, sliding
    window, KV segments serial and split with their merge, cache write, the backward's row sum), compiles to a cubin for
    sm_90 with the device tile table."""
    batch = make_batch([20, 9], 4, 2, 80, dtype, seed=1)
    cuda_config = config_module.ATTENTION_TABLE["cuda", config_module.dtype_name(dtype), 128]
    with record_launches() as launches:
        q, k, v = (t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value))
        varlen_attention(q, k, v, batch.cu_seqlens, sliding_window=8, config=cuda_config).sum().backward()
        run_schedule(batch, [[12, 8], [9]], page_size=16, seed=0, scale=0.1, config=cuda_config)
        run_schedule(batch, [[12, 8], [9]], page_size=16, seed=0, scale=0.1, config=cuda_config, split_kv=True)
    seen = set()
    for launch in launches:
        key = (launch.name, launch.kwargs.get("PAGED"), launch.kwargs.get("HAS_WINDOW"), launch.kwargs.get("SPLIT"))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_launch(launch)
        assert compiled.asm["cubin"], launch.name
    assert {name for name, _, _, _ in seen} == {
        "_attention_fwd_kernel",
        "_attention_merge_kernel",
        "_attention_bwd_kernel",
        "_write_kv_cache_kernel",
        "_attention_bwd_preprocess_kernel",  # the backward's delta = rowsum(dO * O)
    }


def test_tensor_parallel_size_of_a_fingerprint() -> None:
    from samepath.kernels.config import fingerprint, tensor_parallel_size_of

    assert tensor_parallel_size_of(fingerprint()) == 1
    assert tensor_parallel_size_of(fingerprint(3)) == 3
    assert tensor_parallel_size_of(fingerprint(9), max_size=8) is None
    assert tensor_parallel_size_of("sp1-0000000000000000") is None


def test_kernels_depend_on_nothing_above_them() -> None:
    """The kernels (and their fingerprint, TP degrees included) are the bottom layer: computing
    fingerprints imports neither samepath.distributed nor the integrations or the check tools."""
    import subprocess
    import sys

    code = (
        "import sys, samepath\n"
        "fps = (samepath.fingerprint(), samepath.fingerprint(2))\n"
        "above = sorted(m for m in sys.modules if m.startswith(('samepath.distributed', "
        "'samepath.integrations', 'samepath.check')))\n"
        "assert not above, above\n"
        "import samepath.distributed\n"
        "assert (samepath.fingerprint(), samepath.fingerprint(2)) == fps\n"
        "print(fps[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == samepath.fingerprint()


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_compile_report_runs_launchers_dry_with_the_cuda_table(tmp_path) -> None:
    """`python -m samepath.kernels.compile_check --target sm_90 --json OUT` on one case: the decode
    GEMM runs its K pieces as parallel programs (grid of the CUDA SMs), loads its tiles through
    tensor descriptors (TMA), uses wgmma, does not spill."""
    from samepath.kernels import compile_check

    out = tmp_path / "report.json"
    assert compile_check.main(["--target", "sm_90", "--cases", "matmul-decode", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"] == "sm_90" and report["fingerprint"] == samepath.fingerprint()
    (case,) = report["cases"]
    kernels = {k["kernel"]: k for k in case["kernels"]}
    cuda = config_module.MATMUL_TABLE["cuda", "bfloat16"]
    matmul = kernels["_matmul_tma_kernel"]
    assert matmul["mma"] == "wgmma" and matmul["tma"] and matmul["num_warps"] == cuda.num_warps
    assert matmul["constexprs"]["BLOCK_M"] == cuda.block_m and matmul["constexprs"]["PARTIALS"] is True
    assert matmul["grid"] == [min(132, 4096 // cuda.block_n * cuda.k_split)]
    assert kernels["_matmul_reduce_kernel"]["mma"] == "none" and not kernels["_matmul_reduce_kernel"]["tma"]
    assert all(k["spill_stores"] == k["spill_loads"] == 0 and k["registers"] > 0 for k in case["kernels"])
    with pytest.raises(ValueError, match="target must be a CUDA architecture"):
        compile_check.target_of("gfx90a")
    with pytest.raises(ValueError, match="cases must be among"):
        compile_check.compile_report(cases=["nope"])


def test_committed_compile_report_is_current() -> None:
    """bench/results/compile-sm_90.json is the report of this process's numerics: regenerate it
    (README, "Compile report") whenever the fingerprint changes."""
    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "compile-sm_90.json"
    report = json.loads(path.read_text())
    assert (report["numerics_version"], report["fingerprint"]) == (
        config_module.NUMERICS_VERSION,
        samepath.fingerprint(),
    ), f"{path.name} is stale: python -m samepath.kernels.compile_check --target sm_90 --json {path}"
    assert all("tma" in kernel for case in report["cases"] for kernel in case["kernels"]), "a report without TMA"
