"""The benchmark harness and the tuning sweep, on the CPU (Triton interpreter, tiny sizes).

The bench's numbers mean nothing here; what is checked is the structure of its outputs (every
row has its baseline, the header names device and fingerprint, CSV and PNG are written) and that
the tuner rejects a numerics-changing candidate while accepting neutral ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import samepath
from samepath.kernels import config as config_module
from samepath.kernels import tuning

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `bench` is a folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import baselines, gpu_bitwise, report  # noqa: E402
from bench import run as run_module  # noqa: E402
from bench import timing as timing_module  # noqa: E402
from bench.run import run  # noqa: E402

#: A CPU subset that covers every kind of case (packed and paged attention, a Liger-covered op,
#: end to end with host time per layer) and still runs in about 20 seconds.
QUICK_OPS = "varlen_fwd,paged_decode,rms_norm,e2e"

#: Every optional baseline the bench knows, by the name its "not importable" line uses.
OPTIONAL = [
    *baselines.SDPA_BACKENDS,
    "torch varlen_attn",
    "FlashInfer",
    "Liger-Kernel",
    "vLLM Triton attention",
    "vLLM batch-invariant kernels",
    "vLLM Triton fused MoE",
    "flash-attn",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    args = ["--device", "cpu", "--quick", "--ops", QUICK_OPS, "--warmup", "0", "--repeats", "2", "--out", str(out)]
    result = run(args)
    result["out"] = out
    return result


def test_quick_bench_rows_have_min_median_max_of_several_calls(quick_run: dict) -> None:
    rows = quick_run["rows"]
    ops = {row["op"] for row in rows}
    expected = set(QUICK_OPS.split(",")) - (set() if importlib.util.find_spec("transformers") else {"e2e"})
    assert ops == expected
    for row in rows:
        assert row["baseline"] and row["note"] == "", row
        assert row["calls"] >= 2, row
        for side in ("baseline", "samepath"):
            low, mid, high = row[f"{side}_min_ms"], row[f"{side}_ms"], row[f"{side}_max_ms"]
            assert all(math.isfinite(v) and v > 0 for v in (low, mid, high)), row
            assert low <= mid <= high, row
        assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["samepath_ms"])
        assert row["rotation"].startswith(("2 sets", "3 sets", "4 sets")), row
    # every case is compared with a stock PyTorch baseline
    stock = {"eager math (HF)", "eager math (HF, gather pages)", "eager math (HF RMSNorm)", "torch F.rms_norm"}
    stock |= {"stock HF (sdpa, torch ops)"}
    for op, config in {(row["op"], row["config"]) for row in rows}:
        names = {row["baseline"] for row in rows if (row["op"], row["config"]) == (op, config)}
        assert names & stock, (op, config, names)
    # decode is compared only with baselines that read the paged cache, never a dense one
    decode = {row["baseline"] for row in rows if row["op"] == "paged_decode"}
    assert decode and all("gather pages" in name or "paged" in name for name in decode), decode


def test_quick_bench_times_the_old_schedule_in_the_same_run(quick_run: dict) -> None:
    """Attention (packed and paged) and RMSNorm are each compared with the pre-issue-14 schedule
    (bench/old_schedule.py), as a ratio in the same run."""
    from bench import old_schedule

    for op in ("varlen_fwd", "paged_decode", "rms_norm"):
        old = [row for row in quick_run["rows"] if row["op"] == op and row["baseline"].startswith(old_schedule.LABEL)]
        assert len(old) == 1 and math.isfinite(old[0]["speedup"]), op


def test_attention_backward_has_no_old_schedule_row() -> None:
    """The old schedule is a forward-only baseline: today's backward kernel on old tiles would not be
    the backward that schedule ran, so the forward + backward case has no such row (the forward has)."""
    from bench import baselines as baselines_module
    from bench import old_schedule
    from bench.cases import varlen_case

    found = baselines_module.find(torch.device("cpu"), torch.bfloat16)
    args = ([20, 12], 4, 2, 64, torch.bfloat16, torch.device("cpu"), found)
    assert old_schedule.LABEL in varlen_case("varlen_fwd", *args).baselines
    assert not [name for name in varlen_case("varlen_fwdbwd", *args).baselines if "old" in name]


def test_bench_calls_attention_as_the_integrations_do(monkeypatch) -> None:
    """samepath's attention in the bench: ``validate=False`` and a LaunchPlan, as integrations/hf.py and
    integrations/vllm/attention.py call it (the plan built once, not per call)."""
    from bench import baselines as baselines_module
    from bench import cases

    calls: list[dict] = []
    for name in ("varlen_attention", "paged_attention"):
        original = getattr(cases, name)

        def spy(*args, original=original, **kwargs):
            calls.append(kwargs)
            return original(*args, **kwargs)

        monkeypatch.setattr(cases, name, spy)
    cpu = torch.device("cpu")
    found = baselines_module.find(cpu, torch.float32)
    varlen = cases.varlen_case("varlen_fwd", [9, 5], 4, 2, 32, torch.float32, cpu, found)
    paged = cases.paged_case("paged_decode", 2, 20, 1, 4, 2, 32, torch.float32, cpu, found)
    for case in (varlen, paged, varlen, paged):
        case.samepath(case.make(0))
    assert len(calls) == 4 and all(call["validate"] is False for call in calls)
    assert all(isinstance(call["plan"], cases.LaunchPlan) for call in calls)
    assert calls[0]["plan"] is calls[2]["plan"] and calls[1]["plan"] is calls[3]["plan"]


def test_old_schedule_overrides_are_scoped_and_change_no_default() -> None:
    """The bench's old-schedule overrides restore the library on exit and leave the fingerprint,
    and the packing / tiling / grid functions, as they were."""
    from bench import old_schedule

    attention, rms_norm, matmul_module = (
        old_schedule.attention_plan_module,
        old_schedule.rms_norm_module,
        old_schedule.matmul_module,
    )
    assert attention.__name__ == "samepath.kernels.attention.plan" and rms_norm.__name__ == "samepath.kernels.rms_norm"
    before = samepath.fingerprint()
    packing, tiling, grid = attention.packing, rms_norm._tiling, matmul_module.grid
    with old_schedule.unpacked_heads(), old_schedule.one_row_per_norm_program(), old_schedule.non_persistent_matmul():
        assert attention.packing(4, 16).head_chunk == 1 and rms_norm._tiling(128, torch.device("cpu")).rows == 1
        assert matmul_module.grid.num_programs(1000, "cpu", persistent=True) == 1000
    assert (attention.packing, rms_norm._tiling, matmul_module.grid) == (packing, tiling, grid)
    assert attention.packing(4, 16).head_chunk == 4
    assert samepath.fingerprint() == before
    assert old_schedule.attention_config(128, torch.bfloat16, torch.device("cpu")).seg >= 1 << 20


def test_quick_bench_gqa_decode_and_lm_head_memory_rows(tmp_path: Path) -> None:
    """The paged decode of 8 query heads over 2 KV heads is timed against 8 over 8 (and the unpacked
    old schedule) — a ratio the bench reports, not asserted here; the fused lm_head's peak memory
    is measured against the unfused paths, and is below theirs (it never holds [rows, vocab])."""
    args = ["--device", "cpu", "--quick", "--ops", "paged_decode_gqa,lm_head_memory"]
    result = run([*args, "--warmup", "0", "--repeats", "2", "--out", str(tmp_path), "--no-png"])
    rows = result["rows"]
    gqa = [row for row in rows if row["op"] == "paged_decode_gqa"]
    assert {row["baseline"].split(", paged")[0] for row in gqa} >= {"samepath old schedule (pre-issue-14)"}
    assert any("H=8/8" in row["baseline"] for row in gqa) and all("H=8/2" in row["config"] for row in gqa)
    assert all(math.isfinite(row["speedup"]) and row["note"] == "" for row in gqa)
    memory = [row for row in rows if row["op"] == "lm_head_memory"]
    assert len(memory) >= 2 and all("peak MiB" in row["measures"] for row in memory)
    for row in memory:
        assert 0 < row["samepath_ms"] < row["baseline_ms"], row
        assert row["samepath_min_ms"] == row["samepath_max_ms"]  # the CPU accounting is exact
    assert "lm_head_memory" in result["paths"]["txt"].read_text()


def test_quick_bench_moe_expert_layer_rows(tmp_path: Path) -> None:
    """The MoE expert layer: samepath's grouped expert GEMMs timed against the per-expert loop and
    stock Hugging Face experts in the same run; vLLM's Triton fused MoE is timed where it imports
    and runs, and listed with its reason otherwise (here: not installed, or needs CUDA)."""
    args = ["--device", "cpu", "--quick", "--ops", "moe_experts", "--warmup", "0", "--repeats", "2"]
    result = run([*args, "--out", str(tmp_path), "--no-png"])
    rows = [row for row in result["rows"] if row["op"] == "moe_experts"]
    names = {row["baseline"] for row in rows}
    assert "samepath per-expert loop (one linear per expert)" in names
    assert "stock HF experts (Qwen3MoeExperts eager loop)" in names
    assert all(math.isfinite(row["speedup"]) and row["note"] == "" for row in rows), rows
    assert all("E=4 top_k=2" in row["config"] for row in rows)
    assert re.search(r"vLLM Triton fused MoE \((not importable|needs CUDA)", result["missing"])
    assert "moe_experts" in result["paths"]["txt"].read_text()


def test_every_optional_baseline_is_timed_or_listed_with_its_reason(quick_run: dict) -> None:
    head, missing = quick_run["header"], quick_run["missing"]
    assert missing.startswith("Baselines not importable / not applicable: ")
    timed = head["baselines_timed"]
    for name in OPTIONAL:
        listed = f"{name} (" in missing
        assert listed or name in timed, name
        assert not (listed and f"{name} (" in timed), name
    if not torch.cuda.is_available():  # this CPU machine: the CUDA-only kernels say so
        for name in ("torch SDPA cuDNN", "torch SDPA efficient", "FlashInfer", "Liger-Kernel"):
            assert f"{name} (" in missing, name
        assert "needs CUDA" in missing
    assert missing in quick_run["paths"]["txt"].read_text()
    # the SDPA backends that run here are timed by name, one at a time
    for name in baselines.SDPA_BACKENDS:
        if f"{name} (" not in missing:
            assert any(row["baseline"].startswith(name) for row in quick_run["rows"]), name


def test_quick_bench_csv_and_table_carry_device_versions_and_fingerprint(quick_run: dict) -> None:
    head, rows = report.read_csv(quick_run["paths"]["csv"])
    assert head["device"] == report.CPU_LABEL and "not device numbers" in head["device"]
    assert head["fingerprint"] == samepath.fingerprint()
    assert head["torch"] == torch.__version__
    assert head["triton"] and head["mode"].startswith("quick")
    calls = head["samepath_calls"]
    assert "validate=True" not in calls and "integrations/vllm/attention.py" in calls
    assert calls.count("validate=False, plan=LaunchPlan") == 2
    assert "min / median / max" in head["timing"] and "L2" in head["timing"]
    assert list(rows[0]) == report.FIELDS
    assert len(rows) == len(quick_run["rows"])
    assert all(
        float(row["baseline_min_ms"]) <= float(row["baseline_ms"]) <= float(row["baseline_max_ms"]) for row in rows
    )

    table = quick_run["paths"]["txt"].read_text()
    assert table.startswith(quick_run["table"])
    assert f"# fingerprint: {samepath.fingerprint()}" in table
    assert "not device numbers" in table
    title = table.splitlines()[len(quick_run["header"])]
    for column in ("base min", "base median", "base max", "samepath min", "samepath median", "samepath max"):
        assert column in title
    for column in ("config", "baseline", "speedup", "calls", "samepath rate"):
        assert column in title


def test_end_to_end_rows_include_host_time_per_layer(quick_run: dict) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed: no e2e cases")
    e2e = [row for row in quick_run["rows"] if row["op"] == "e2e"]
    configs = " | ".join(row["config"] for row in e2e)
    assert "rollout generate" in configs and "trainer fwd+bwd" in configs
    fused = [row for row in e2e if "fused lm_head (causal_lm_logprobs)" in row["config"]]
    full_logits = "samepath, full logits (model(...).logits)"
    assert {row["baseline"] for row in fused} == {"stock HF (sdpa, torch ops)", full_logits}
    host = [row for row in e2e if row["config"].startswith("host time per attention layer")]
    assert len(host) == 2 and all("host ms" in row["measures"] for row in host)
    # one layer (CPU quick), two timed calls: a trainer forward calls each attention layer once
    trainer_host = next(row for row in host if "trainer forward" in row["config"])
    assert "L=1 " in trainer_host["config"] and trainer_host["calls"] == 2


def test_quick_bench_writes_a_png(quick_run: dict) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the bench writes no PNG")
    png = quick_run["paths"]["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_quick_mode_times_more_than_one_call() -> None:
    warmup, repeats = run_module.defaults(torch.device("cpu"), quick=True)
    assert warmup >= 1 and repeats >= 3
    with pytest.raises(SystemExit):
        run(["--device", "cpu", "--repeats", "1", "--dry-run"])


def test_measure_warms_up_then_times_each_call_cycling_the_sets() -> None:
    seen: list[int] = []
    timing = timing_module.measure(seen.append, [0, 1, 2], torch.device("cpu"), warmup=2, repeats=4)
    assert seen == [0, 1, 2, 0, 1, 2]
    assert timing.n == 4 and 0 <= timing.min_ms <= timing.median_ms <= timing.max_ms


def test_rotation_covers_twice_the_l2() -> None:
    mib = 2**20
    cuda = torch.device("cuda")
    # an H200's 60 MB L2: 2 x L2 = 120 MiB of inputs, so a 8 MiB set is cycled 15 times
    rotation = timing_module.rotation_for(8 * mib, cuda, l2=60 * mib)
    assert rotation.target_bytes == 120 * mib and rotation.sets == 15 and rotation.covered
    # the target is clamped to 64-256 MiB on a device
    assert timing_module.rotation_target_bytes(cuda, l2=4 * mib) == 64 * mib
    assert timing_module.rotation_target_bytes(cuda, l2=512 * mib) == 256 * mib
    # a tiny set hits the cap and says it covers less than the target; a huge one still gets 2 sets
    tiny = timing_module.rotation_for(1024, cuda, l2=60 * mib)
    assert tiny.sets == timing_module.DEVICE_MAX_SETS and not tiny.covered and "< target" in tiny.label()
    assert timing_module.rotation_for(4096 * mib, cuda, l2=60 * mib).sets == 2
    # the CPU cycles fewer sets
    assert timing_module.rotation_for(1024, torch.device("cpu"), l2=2 * mib).sets == timing_module.CPU_MAX_SETS


def test_bench_runs_as_a_script_and_checks_its_ops(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown --ops"):
        run(["--device", "cpu", "--ops", "rms_norm,nope", "--out", str(tmp_path)])
    done = subprocess.run(
        [
            sys.executable,
            "bench/run.py",
            "--device",
            "cpu",
            "--quick",
            "--ops",
            "rms_norm",
            "--warmup",
            "0",
            "--repeats",
            "2",
            "--no-png",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "not device numbers" in done.stdout
    assert "Baselines not importable / not applicable: " in done.stdout
    assert len(list(tmp_path.glob("*.csv"))) == 1


# ----------------------------------------------------------------------------------------------
# The device scripts
# ----------------------------------------------------------------------------------------------


def test_bitwise_script_runs_its_split_k_checks_with_their_negative_control(tmp_path: Path) -> None:
    """bench/gpu_bitwise.py at --small sizes on the CPU: the split-K checks pass, the fp32 negative
    control (k_slices 2 against 1) reports a difference, and the JSON is written."""
    out = tmp_path / "bitwise.json"
    assert gpu_bitwise.main(["--device", "cpu", "--small", "--checks", "split_k", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["failed"] == 0 and payload["fingerprint"] == samepath.fingerprint()
    statuses = {r["check"]: r["status"] for r in payload["results"]}
    assert statuses["split-K float32: negative control S=2 vs S=1"] == "PASS"
    assert all(status in ("PASS", "INFO") for status in statuses.values()), statuses
    assert sum("== shard partials" in check for check in statuses) == 9  # 3 dtypes x S = 2, 4, 8


def test_device_scripts_dry_run_list_their_stages_and_check_every_entry() -> None:
    """``bash bench/gpu_check.sh --dry-run`` (and the NPU one) on this CPU: stages in order of value
    with budgets within 8 minutes, and every stage's Python entry imports and parses its arguments."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("STAGES", None)
    procs = {
        name: subprocess.Popen(
            ["bash", f"bench/{name}_check.sh", "--dry-run"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("gpu", "npu")
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        stages = re.findall(r"^  stage (\w+) +budget +(\d+) s", out, flags=re.M)
        expected = (
            ["setup", "bitwise", "bench", "tune"]
            if name == "gpu"
            else ["setup", "ascendc", "formula", "bitwise", "bench", "tune"]
        )
        assert [s for s, _ in stages] == expected, out
        assert sum(int(b) for _, b in stages) <= 480, out
        for entry in ("bitwise: bench/gpu_bitwise.py", "bench: python -m bench", "tune: bench/tune.py"):
            assert f"  ok   {entry}" in out, (entry, out)
        if name == "npu":  # the Ascend C stage: backward bitwise checks on that backend, and its bench
            assert "  ok   ascendc: bench/gpu_bitwise.py attention,attention_backward" in out, out
            assert "  ok   ascendc: bench/ascendc_attention.py" in out, out
            assert "passes=forward,decode,backward impls=triton,ascendc,torch_npu,flash_attn_npu" in out, out
            assert "  ok   formula: bench/npu_formula.py --dry-run ran on the CPU" in out, out
            assert "skipped (needs the NPU): backends: the Ascend C kernel on the NPU" in out, out
        assert "FAIL" not in out, out
        script = (ROOT / "bench" / f"{name}_check.sh").read_text() + (ROOT / "bench/device_check_lib.sh").read_text()
        assert not re.search(r"pip[^\n]*install[^\n]*\btorch\b", script), "the device script must not install torch"
        assert "--no-index --no-deps" in script and "-m pytest" not in script


def test_ascendc_attention_bench_runs_and_reports_what_cannot_run_here(tmp_path) -> None:
    """``bench/ascendc_attention.py --small`` on the CPU: in every pass (training forward, paged decode,
    backward) the Triton kernel is timed and bitwise the same call to call; the Ascend C kernel is
    refused off an NPU (an error row, exit 1); torch_npu and flash-attention-npu are skipped, saying why."""
    from bench import ascendc_attention

    out = tmp_path / "ascendc_attention.json"
    argv = ["--device", "cpu", "--small", "--repeats", "1", "--warmup", "0", "--out", str(out)]
    assert ascendc_attention.main(argv) == 1
    rows = {(r["pass"], r["impl"]): r for r in json.loads(out.read_text())["results"]}
    for name in ascendc_attention.PASSES:
        assert rows[name, "triton"]["deterministic"] is True and rows[name, "triton"]["median_ms"] > 0
        assert "NPU tensors only" in rows[name, "ascendc"]["error"]
        assert "torch_npu" in rows[name, "torch_npu"]["skipped"]
        assert "flash_attn" in rows[name, "flash_attn_npu"]["skipped"]
    assert "not applicable" in rows["forward", "flash_attn_npu"]["skipped"]
    with pytest.raises(SystemExit):
        ascendc_attention.parse_args(["--passes", "sideways"])


def test_device_script_rejects_unknown_arguments() -> None:
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown argument" in done.stderr


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------


def test_tuner_rejects_a_different_tile_n_and_accepts_neutral_params() -> None:
    key = tuning.TuneKey("attention", "cpu", "float32", 16)
    ref = key.reference()
    inputs = tuning.probe_inputs(key, torch.device("cpu"))
    expected = tuning.run_probe(key, ref, inputs)

    other_tiles = dataclasses.replace(ref, tile_n=ref.tile_n // 2)
    assert not tuning.is_neutral(key, other_tiles)
    verdict = tuning.verify_candidate(key, other_tiles, "cpu", inputs=inputs, reference_outputs=expected)
    assert not verdict.accepted
    assert "varlen_attention" in verdict.mismatches and "paged_attention" in verdict.mismatches

    neutral = dataclasses.replace(ref, num_warps=8, num_stages=3)
    assert tuning.is_neutral(key, neutral)
    verdict = tuning.verify_candidate(key, neutral, "cpu", inputs=inputs, reference_outputs=expected)
    assert verdict.accepted, verdict.reason()


def test_neutral_candidates_change_only_neutral_params() -> None:
    for key in tuning.keys_for("cuda", [torch.bfloat16, torch.float32], [64, 80, 128]):
        candidates = tuning.neutral_candidates(key)
        assert candidates[0] == key.reference() and len(candidates) > 1
        assert all(tuning.is_neutral(key, cand) for cand in candidates)
        assert not tuning.is_neutral(key, tuning.negative_control(key))


def test_sweep_output_round_trips_and_changes_no_fingerprint(tmp_path: Path) -> None:
    before = samepath.fingerprint()
    key = tuning.TuneKey("matmul", "cpu", "float32")
    ref = key.reference()
    other_k = dataclasses.replace(ref, block_k=ref.block_k // 2)
    candidates = [ref, dataclasses.replace(ref, num_warps=8), other_k]
    result = tuning.tune_key(key, "cpu", candidates=candidates, warmup=0, repeats=1, min_gain=-1.0, log=lambda _: None)
    assert "block_k=16" in result.negative_control
    assert [params for params, _ in result.rejected] == [{"block_k": ref.block_k // 2}]
    assert [params for params, _ in result.accepted] == [
        {"num_warps": 4, "num_stages": ref.num_stages, "group_m": ref.group_m},
        {"num_warps": 8, "num_stages": ref.num_stages, "group_m": ref.group_m},
    ]
    assert set(result.winner) == {"num_warps", "num_stages", "group_m"}

    path = tmp_path / "tuned-cpu.json"
    tuning.write_tuned(path, [result], "cpu")
    payload = json.loads(path.read_text())
    assert payload["fingerprint"] == before
    assert [set(entry["params"]) for entry in payload["entries"]] == [{"num_warps", "num_stages", "group_m"}]

    table = tuning.load_tuned(path)
    assert table.params == {key: result.winner}
    assert table.matmul_config(torch.float32, "cpu") == dataclasses.replace(ref, **result.winner)
    assert table.overrides() == {("matmul", "cpu", "float32"): result.winner}
    assert table.attention_config(128, torch.float32, "cpu") == config_module.attention_config(
        128, torch.float32, "cpu"
    )
    assert samepath.fingerprint() == before
    assert config_module.MATMUL_TABLE["cpu", "float32"] == ref


def _tuned_file(path: Path, params: dict, fingerprint: str | None = None) -> Path:
    entry = {"op": "attention", "device_kind": "cpu", "dtype": "bfloat16", "head_size": 128, "params": params}
    payload = {
        "format": tuning.TUNED_FORMAT,
        "fingerprint": fingerprint or samepath.fingerprint(),
        "device_kind": "cpu",
        "entries": [entry],
    }
    path.write_text(json.dumps(payload))
    return path


def test_loader_refuses_numerics_params_and_another_fingerprint(tmp_path: Path) -> None:
    ok = tuning.load_tuned(_tuned_file(tmp_path / "ok.json", {"num_warps": 8}))
    assert ok.attention_config(128, torch.bfloat16, "cpu").num_warps == 8
    assert (
        ok.attention_config(128, torch.bfloat16, "cpu").tile_n
        == config_module.ATTENTION_TABLE["cpu", "bfloat16", 128].tile_n
    )
    with pytest.raises(ValueError, match="tile_n"):
        tuning.load_tuned(_tuned_file(tmp_path / "tile.json", {"num_warps": 8, "tile_n": 64}))
    with pytest.raises(ValueError, match="block_m"):
        tuning.load_tuned(_tuned_file(tmp_path / "block.json", {"block_m": 32}))
    with pytest.raises(ValueError, match="power of two"):
        tuning.load_tuned(_tuned_file(tmp_path / "warps.json", {"num_warps": 3}))
    with pytest.raises(ValueError, match="fingerprint"):
        tuning.load_tuned(_tuned_file(tmp_path / "fp.json", {"num_warps": 8}, fingerprint="sp1-0000000000000000"))
    (tmp_path / "fmt.json").write_text("{}")
    with pytest.raises(ValueError, match="not a samepath tuned file"):
        tuning.load_tuned(tmp_path / "fmt.json")


def test_install_tuned_uses_the_config_hook_when_there_is_one(tmp_path: Path) -> None:
    table = tuning.load_tuned(_tuned_file(tmp_path / "ok.json", {"num_warps": 8}))
    before = samepath.fingerprint()
    hook = getattr(config_module, "set_tuned_overrides", None)
    if hook is None:
        with pytest.raises(RuntimeError, match="set_tuned_overrides"):
            tuning.install_tuned(table)
        return
    try:
        tuning.install_tuned(table)
        assert config_module.attention_config(128, torch.bfloat16, "cpu").num_warps == 8
        assert samepath.fingerprint() == before
    finally:
        hook({})


def test_quick_bench_mla_rows(tmp_path: Path) -> None:
    """DeepSeek's latent attention: samepath's absorbed form (training forward + backward, paged decode)
    timed against the stock decompressed form and the absorbed form in torch in the same run; FlashMLA is
    listed with its reason."""
    args = ["--device", "cpu", "--quick", "--ops", "mla_train,mla_decode", "--warmup", "0", "--repeats", "2"]
    result = run([*args, "--out", str(tmp_path), "--no-png"])
    rows = {(row["op"], row["baseline"]) for row in result["rows"]}
    assert ("mla_train", "stock decompressed MLA (HF: kv_b_proj, torch SDPA)") in rows
    assert ("mla_decode", "stock absorbed MLA decode in torch (vLLM's math, gather pages, SDPA)") in rows
    assert ("mla_decode", "stock decompressed MLA decode (HF generate: expand the cache, SDPA)") in rows
    assert all(math.isfinite(row["speedup"]) for row in result["rows"])
    assert "FlashMLA (" in result["missing"]


def test_quick_bench_gdn_rows(tmp_path: Path) -> None:
    """Gated DeltaNet: samepath's chunked schedule (training forward + backward, the slot decode step) timed
    against Hugging Face's torch fallbacks in the same run; flash-linear-attention is listed with its reason
    (not importable, or no GPU driver on the CPU)."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    args = ["--device", "cpu", "--quick", "--ops", "gdn_train,gdn_decode", "--warmup", "0", "--repeats", "2"]
    result = run([*args, "--out", str(tmp_path), "--no-png"])
    rows = {(row["op"], row["baseline"]) for row in result["rows"]}
    assert rows == {
        ("gdn_train", "stock HF torch_chunk_gated_delta_rule (padded batch)"),
        ("gdn_decode", "stock HF torch_recurrent_gated_delta_rule (one token)"),
    }
    assert all(math.isfinite(row["speedup"]) for row in result["rows"])
    assert "flash-linear-attention (" in result["missing"]
