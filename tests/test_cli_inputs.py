"""Bad and edge inputs to the ``samepath`` command line: each is exit status 2 with one line naming
the argument, found before any model is built or loaded (the runners are replaced by functions
that fail if they are reached); the usual dtype spellings are accepted everywhere."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath.check import cli, harness
from samepath.check.cli import main
from samepath.rl import train_check


@pytest.fixture
def no_work(monkeypatch):
    """Every way into a model run fails the test."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("a model was built or run before the input was checked")

    for owner, name in (
        (harness, "load_default_model"),
        (harness, "load_model"),
        (harness, "build_default_model"),
        (harness, "run_stock_and_patched"),
        (train_check, "run"),
    ):
        monkeypatch.setattr(owner, name, must_not_run)


def _bad(argv: list[str], capsys) -> str:
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2, (argv, captured)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("command", ["check", "doctor", "train-check"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e-30", "-1"])
def test_temperature_out_of_range_is_exit_2_before_any_work(command, value, no_work, capsys):
    message = _bad([command, f"--temperature={value}"], capsys)
    assert "--temperature must be" in message and value.lstrip("-") in message.lower()


@pytest.mark.parametrize("command", ["check", "doctor", "train-check"])
def test_negative_seed_is_refused(command, no_work, capsys):
    assert "--seed must be a non-negative integer" in _bad([command, "--seed", "-1"], capsys)


def test_doctor_prompt_len_zero_is_refused(no_work, capsys):
    assert "--prompt-len must be at least 1, got 0" in _bad(["doctor", "--prompt-len", "0"], capsys)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a read-only /proc")
@pytest.mark.parametrize("command", ["check", "doctor", "audit", "train-check"])
def test_unwritable_json_is_found_before_the_run(command, no_work, capsys):
    """/proc exists and refuses new files even to root, whom os.access would have let through."""
    assert "--json '/proc/samepath-report.json' is not writable" in _bad(
        [command, "--json", "/proc/samepath-report.json"], capsys
    )


def test_writable_json_check_leaves_no_file(tmp_path):
    target = tmp_path / "report.json"
    cli._check_writable("--json", str(target))
    assert not target.exists()
    target.write_text("kept")
    cli._check_writable("--json", str(target))
    assert target.read_text() == "kept"


@pytest.mark.parametrize("command", ["check", "doctor", "audit", "train-check"])
def test_a_hub_id_is_named_as_one(command, no_work, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder named Qwen here
    message = _bad([command, "--model", "Qwen/Qwen3-0.6B"], capsys)
    assert "not a local directory; samepath does not download Hub ids" in message
    assert "--local-dir DIR" in message and "--model DIR" in message
    assert "does not exist" in _bad([command, "--model", str(tmp_path / "a" / "b" / "c")], capsys)


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("float16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float32", "float32"),
        ("float", "float32"),
    ],
)
def test_dtype_spellings(spelling, canonical):
    assert harness.canonical_dtype_name(spelling) == canonical
    assert harness.parse_dtype(spelling) is harness.DTYPES[canonical]


def test_precision_spellings_and_refusals():
    precisions = ("bf16", "fp32_master")
    for spelling in ("bf16", "bfloat16", "BF16", "torch.bfloat16"):
        assert cli._parse_precision(spelling, precisions) == "bf16"
    assert cli._parse_precision("fp32-master", precisions) == "fp32_master"
    with pytest.raises(harness.CheckInputError, match="use fp32_master"):
        cli._parse_precision("float32", precisions)
    with pytest.raises(harness.CheckInputError, match="fp16 training is not implemented"):
        cli._parse_precision("half", precisions)


def test_dtype_and_precision_spellings_reach_the_run(no_work, monkeypatch, capsys):
    """`--dtype bf16` and `--precision bfloat16` pass validation and arrive canonical."""
    seen = {}

    def stop(args, dtype, device, seed, progress):
        seen["dtype"] = (args.dtype, dtype)
        raise harness.CheckInputError("stopped after validation")

    monkeypatch.setattr(cli, "_load", stop)
    assert "stopped after validation" in _bad(["doctor", "--dtype", "bf16"], capsys)
    assert seen["dtype"] == ("bfloat16", harness.DTYPES["bfloat16"])

    def fake_run(spec, on_step=None):
        seen["precision"] = spec.precision
        raise harness.CheckInputError("stopped after validation")

    monkeypatch.setattr(train_check, "run", fake_run)
    argv = ["train-check", "--precision", "bfloat16", "--progress", "off"]  # the stub stands in for the run
    assert "stopped after validation" in _bad(argv, capsys)
    assert seen["precision"] == "bf16"
    assert "unsupported dtype 'int8' for --dtype" in _bad(["check", "--dtype", "int8"], capsys)


def test_train_check_takes_model_dir_and_names_it(tmp_path, no_work, monkeypatch, capsys):
    """--model DIR reaches the run; the header names the model and the dtypes (the loop is replaced
    by recorded metrics: tests/test_rl.py runs it)."""
    import torch
    import transformers

    from samepath.check.harness import DEFAULT_MODEL_CONFIG
    from samepath.rl import step_metrics

    transformers.Qwen2Config(**{**DEFAULT_MODEL_CONFIG, "num_hidden_layers": 1}).save_pretrained(tmp_path)
    seen = []
    lp = torch.tensor([[-1.0, -2.0]])

    def fake_run(spec, on_step=None):
        seen.append(spec)
        return [step_metrics(0, lp, lp + (1e-3 if spec.numerics == "stock" else 0.0), weight_change=0.1)]

    monkeypatch.setattr(train_check, "run", fake_run)
    assert main(["train-check", "--model", str(tmp_path), "--steps", "1", "--precision", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert [s.model for s in seen] == [str(tmp_path)] * 2 and seen[0].precision == "bf16"
    assert out.splitlines()[0].startswith(f"samepath train-check: qwen2 ({tmp_path}; 1 layers, hidden 64)")
    assert "trainer bf16 (bf16 weights), rollout hf in bfloat16" in out.splitlines()[0]
    assert "--tie-embeddings applies to the embedded default" in _bad(
        ["train-check", "--model", str(tmp_path), "--tie-embeddings"], capsys
    )
