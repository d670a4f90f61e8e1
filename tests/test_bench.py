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

from bench import cases, report  # noqa: E402
from bench.run import run  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    result = run(["--device", "cpu", "--quick", "--out", str(out)])
    result["out"] = out
    return result


def test_quick_bench_rows_each_have_their_baseline(quick_run: dict) -> None:
    rows = quick_run["rows"]
    ops = {row["op"] for row in rows}
    expected = set(cases.OPS) - (set() if importlib.util.find_spec("transformers") else {"e2e"})
    assert ops == expected
    for row in rows:
        assert row["baseline"], row
        assert row["note"] == "", row
        for key in ("baseline_ms", "samepath_ms", "speedup"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["samepath_ms"])
        assert row["unit"] in ("TFLOP/s", "GB/s", "tok/s")
    # every case is compared with stock PyTorch
    stock = {"torch SDPA", "eager math", "torch F.linear (CPU BLAS)", "F.log_softmax + gather (fp32)"}
    stock |= {"eager math (HF RMSNorm)", "torch F.rms_norm", "stock HF (sdpa, torch ops)"}
    for op, config in {(row["op"], row["config"]) for row in rows}:
        baselines = {row["baseline"] for row in rows if (row["op"], row["config"]) == (op, config)}
        assert baselines & stock, (op, config, baselines)


def test_quick_bench_csv_and_table_carry_device_versions_and_fingerprint(quick_run: dict) -> None:
    head, rows = report.read_csv(quick_run["paths"]["csv"])
    assert head["device"] == report.CPU_LABEL and "not device numbers" in head["device"]
    assert head["fingerprint"] == samepath.fingerprint()
    assert head["torch"] == torch.__version__
    assert head["triton"] and head["mode"].startswith("quick")
    assert any("flash-attn" in value for key, value in head.items() if key.startswith("note"))
    assert list(rows[0]) == report.FIELDS
    assert len(rows) == len(quick_run["rows"])
    assert all(row["baseline"] and float(row["baseline_ms"]) > 0 and float(row["samepath_ms"]) > 0 for row in rows)

    table = quick_run["paths"]["txt"].read_text()
    assert table == quick_run["table"] + "\n"
    assert f"# fingerprint: {samepath.fingerprint()}" in table
    assert "not device numbers" in table
    title = table.splitlines()[len(quick_run["header"])]
    for column in ("config", "baseline", "baseline ms", "samepath ms", "speedup", "samepath rate"):
        assert column in title


def test_quick_bench_writes_a_png(quick_run: dict) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the bench writes no PNG")
    png = quick_run["paths"]["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    assert len(list(tmp_path.glob("*.csv"))) == 1


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
