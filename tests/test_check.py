"""``samepath check``: on the embedded default model samepath's logdiff == 0 (stock's is reported,
and is whatever this machine's kernels make it); the JSON schema is stable; exit statuses are right;
bad input gives one line on stderr."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath
from samepath import integrations
from samepath.check import harness
from samepath.check.cli import main
from samepath.check.report import SCHEMA_VERSION, compare

TOP_KEYS = {"schema_version", "tool", "samepath_version", "model", "settings", "runs", "logdiff_zero", "exit_status"}
TOP_KEYS |= {"environment", "patched_vs_stock"}
RUN_KEYS = {
    "tokens",
    "equal_tokens",
    "equal_fraction",
    "max_abs_logp_diff",
    "mean_abs_logp_diff",
    "k3_kl",
    "probs_diff_max",
    "probs_diff_mean",
    "bit_identical",
    "per_position_max_abs_logp_diff",
    "fingerprints",
}
FAST = ["--batch", "2", "--new-tokens", "4", "--seed", "0"]


@pytest.fixture(scope="module")
def check_run(tmp_path_factory):
    """One in-process ``samepath check`` on the embedded default (bf16), with --json and --plot."""
    out = tmp_path_factory.mktemp("check")
    argv = ["check", *FAST, "--json", str(out / "report.json")]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(out / "logdiff.png")]
    except ImportError:
        pass
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()  # stderr not a terminal, as in CI or a log
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(argv)
    (out / "stderr.txt").write_text(stderr.getvalue())
    return status, stdout.getvalue(), out


def test_check_samepath_is_bit_identical(check_run) -> None:
    status, text, out = check_run
    assert status == 0, text
    doc = json.loads((out / "report.json").read_text())
    stock, patched = doc["runs"]["stock"], doc["runs"]["samepath"]
    assert stock["tokens"] == patched["tokens"] == 8
    # Whether stock kernels part generate from the forward in the last bit is the machine's BLAS and
    # thread count; the stock run's figures must agree with each other either way. That check can
    # report a difference is test_check_exits_1_when_samepath_logdiff_is_not_zero's business.
    assert stock["bit_identical"] is (stock["equal_tokens"] == 8) is (stock["max_abs_logp_diff"] == 0)
    assert stock["max_abs_logp_diff"] < 0.5
    assert patched["bit_identical"] and patched["equal_fraction"] == 1.0
    for name in ("max_abs_logp_diff", "mean_abs_logp_diff", "k3_kl", "probs_diff_max", "probs_diff_mean"):
        assert patched[name] == 0.0, name
    assert doc["logdiff_zero"] is True and doc["exit_status"] == 0
    assert patched["fingerprints"] == {"rollout": samepath.fingerprint(), "trainer": samepath.fingerprint()}
    assert "logdiff = 0 with samepath" in text and "bitwise equal" in text and "k3 KL" in text
    assert not integrations.enabled()  # check leaves the patch state as it found it


def test_check_json_schema_is_stable(check_run) -> None:
    _, _, out = check_run
    doc = json.loads((out / "report.json").read_text())
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert set(doc) == TOP_KEYS
    assert set(doc["model"]) == {"source", "model_type", "dtype", "num_layers", "hidden_size"}
    assert doc["model"] == {
        "source": "embedded-default",
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "num_layers": 2,
        "hidden_size": 64,
    }
    assert set(doc["settings"]) == {"rollout", "batch", "new_tokens", "temperature", "seed", "prompt_lengths"}
    assert set(doc["runs"]) == {"stock", "samepath"}
    for run in doc["runs"].values():
        assert set(run) == RUN_KEYS
        assert len(run["per_position_max_abs_logp_diff"]) == 4
    env = doc["environment"]
    assert env["device"] == "cpu" or env["device"].startswith("cuda")
    assert env["versions"]["samepath"] == samepath.__version__ and env["versions"]["torch"] == torch.__version__
    assert env["versions"]["transformers"] and "vllm" not in env["versions"]  # vllm only with --rollout vllm
    closeness = doc["patched_vs_stock"]
    assert 1 <= closeness["tokens"] <= 8 and 0 <= closeness["max_abs_logp_diff"] < 0.5
    # the schema is documented where it is defined
    from samepath.check import report

    for key in TOP_KEYS | RUN_KEYS | {"device", "versions", "executor"}:
        assert f'"{key}"' in report.__doc__, key


def test_check_plot(check_run) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    _, text, out = check_run
    plot = out / "logdiff.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written to" in text


def test_compare_metrics() -> None:
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    trainer = torch.tensor([[-1.0, -2.5], [-0.5, -3.0]])
    m = compare(rollout, trainer)
    assert (m.tokens, m.equal_tokens, m.bit_identical) == (4, 3, False)
    assert m.max_abs_logp_diff == 0.5 and m.mean_abs_logp_diff == 0.125
    r = -0.5
    assert math.isclose(m.k3_kl, (math.exp(r) - 1 - r) / 4)
    assert math.isclose(m.probs_diff_max, math.exp(-2.0) - math.exp(-2.5))
    assert m.per_position_max_abs_logp_diff == [0.0, 0.5]
    same = compare(rollout, rollout.clone())
    assert same.bit_identical and same.max_abs_logp_diff == 0 and same.k3_kl == 0


def test_check_exits_1_when_samepath_logdiff_is_not_zero(monkeypatch, capsys) -> None:
    def fake(model, prompts, new_tokens, temperature, seed, progress=None, vllm_model_dir=None):
        lp = torch.full((len(prompts), new_tokens), -1.0)
        generated = torch.ones(len(prompts), new_tokens, dtype=torch.long)
        fp = samepath.fingerprint()
        stock = harness.SideBySide("stock", prompts, generated, lp, lp - 1e-3, fp, fp)
        off = lp.clone()
        off[0, -1] = torch.nextafter(off[0, -1], torch.tensor(0.0))
        patched = harness.SideBySide("samepath", prompts, generated, lp, off, fp, fp)
        return stock, patched

    monkeypatch.setattr(harness, "run_stock_and_patched", fake)
    assert main(["check", *FAST, "--json", "-"]) == 1
    doc = json.loads(capsys.readouterr().out)  # --json - : the document alone on stdout
    assert doc["exit_status"] == 1 and doc["logdiff_zero"] is False
    assert doc["runs"]["samepath"]["equal_tokens"] == 7
    assert main(["check", *FAST]) == 1
    assert "logdiff != 0 with samepath: 1 of 8" in capsys.readouterr().out


def _bad(argv: list[str], capsys) -> str:
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2, (argv, captured)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_bad_input_is_one_line_exit_2(tmp_path, capsys) -> None:
    import transformers

    assert "does not exist" in _bad(["check", "--model", str(tmp_path / "nowhere")], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in _bad(["check", "--model", str(empty)], capsys)
    bert = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(bert)
    message = _bad(["check", "--model", str(bert)], capsys)
    assert "'bert'" in message and "a type samepath does not patch" in message
    odd_heads = tmp_path / "odd_heads"
    transformers.Qwen3Config(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=12
    ).save_pretrained(odd_heads)
    assert "head size = 12 is not a supported head size" in _bad(["check", "--model", str(odd_heads)], capsys)
    assert "head size = 12" in _bad(["doctor", "--model", str(odd_heads)], capsys)
    assert "unsupported dtype 'int8'" in _bad(["check", "--dtype", "int8"], capsys)
    assert "unsupported dtype" in _bad(["doctor", "--dtype", "float64"], capsys)
    assert "--batch must be at least 1" in _bad(["check", "--batch", "0"], capsys)
    if importlib.util.find_spec("vllm") is None:
        assert "needs vLLM" in _bad(["check", "--rollout", "vllm"], capsys)
    assert "unknown rollout engine" in _bad(["check", "--rollout", "sglang"], capsys)
    assert "invalid int value" in _bad(["check", "--new-tokens", "many"], capsys)
    assert "unrecognized arguments" in _bad(["check", "--frobnicate"], capsys)
    assert main(["check", "--help"]) == 0 and "--plot" in capsys.readouterr().out


def test_bad_outputs_and_devices_are_refused_before_any_work(tmp_path, monkeypatch, capsys) -> None:
    def must_not_run(*args, **kwargs):
        raise AssertionError("the check ran before its output paths and device were checked")

    monkeypatch.setattr(harness, "run_stock_and_patched", must_not_run)
    monkeypatch.setattr(harness, "load_default_model", must_not_run)
    missing = tmp_path / "nowhere" / "report.json"
    assert "the folder" in _bad(["check", "--json", str(missing)], capsys)
    assert "is a directory" in _bad(["doctor", "--json", str(tmp_path)], capsys)
    if importlib.util.find_spec("matplotlib") is not None:
        assert "--plot" in _bad(["check", "--plot", str(tmp_path / "nowhere" / "p.png")], capsys)
    if not torch.cuda.is_available():
        assert "device 'cuda' is not usable" in _bad(["check", "--device", "cuda"], capsys)
        assert "device 'cuda' is not usable" in _bad(["doctor", "--device", "cuda"], capsys)


def test_version_and_exit_statuses_in_help(capsys) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"samepath {samepath.__version__}") and samepath.fingerprint() in out
    for argv in (["--help"], ["check", "--help"], ["doctor", "--help"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "exit status:" in text and "2  bad input" in text and "3  an unexpected error" in text, argv


def _phase_lines(err: str, command: str, phases: list[tuple[str, str]]) -> None:
    """``err`` (stderr, not a terminal) is one plain line as each phase starts and one as it ends,
    in order, numbered of the total, the end with its count and time; no carriage return and no
    time-left estimate."""
    assert "\r" not in err and "\x1b" not in err, repr(err)
    assert "remaining" not in err and "ETA" not in err and "<" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"samepath {command}: [")]
    assert len(lines) == 2 * len(phases), err
    for i, (phase, count) in enumerate(phases):
        head = f"samepath {command}: [{i + 1}/{len(phases)}] {phase}"
        begin, end = lines[2 * i], lines[2 * i + 1]
        assert begin.startswith(head + " (") and begin.endswith(") ..."), (begin, head)
        assert re.fullmatch(re.escape(head) + r" done: " + re.escape(count) + r"\d+\.\d s", end), (end, count)
    assert err.splitlines()[-1].startswith(f"samepath {command}: {len(phases)} phases in ")


def test_check_progress_is_a_plain_line_per_phase(check_run) -> None:
    _, _, out = check_run
    phases = [("load model", ""), ("stock rollout", "4/4 tokens, "), ("stock trainer", "")]
    phases += [("samepath rollout", "4/4 tokens, "), ("samepath trainer", "")]
    _phase_lines((out / "stderr.txt").read_text(), "check", phases)


def test_doctor_progress_is_a_plain_line_per_phase(capsys) -> None:
    argv = ["doctor", "--dtype", "float32", "--batch", "1", "--prompt-len", "3", "--new-tokens", "1"]
    assert main([*argv, "--numerics", "samepath"]) == 0  # --progress auto; capsys's stderr is no terminal
    err = capsys.readouterr().err
    assert "load model (the embedded default model" in err
    phases = [("load model", ""), ("samepath generate", "1/1 tokens, "), ("samepath rollout", "")]
    _phase_lines(err, "doctor", [*phases, ("samepath trainer", "")])


def test_progress_live_on_a_terminal_and_plain_elsewhere() -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    assert harness.progress_mode("auto", terminal) == "live" and harness.progress_mode("on", terminal) == "live"
    assert harness.progress_mode("auto", log) == "lines" and harness.progress_mode("lines", terminal) == "lines"
    assert harness.progress_mode("off", terminal) == "off"
    live = harness.Progress("samepath check", "live", terminal, phases=2)
    live.start("stock rollout", 3, "tokens")
    for _ in range(3):
        live.advance()
    live.start("stock trainer")
    live.end()
    live.close()
    text = terminal.getvalue()
    assert "\rsamepath check: [1/2] stock rollout: 2/3 tokens, " in text
    ended = [line.split("\r")[-1] for line in text.split("\n") if line]
    assert ended[0].startswith("samepath check: [1/2] stock rollout done: 3/3 tokens, ") and ended[0].endswith(
        "s\x1b[K"
    )
    assert ended[1].startswith("samepath check: [2/2] stock trainer done: ")
    assert ended[2].startswith("samepath check: 2 phases in ")
    failed = harness.Progress("samepath check", "lines", log)
    failed.start("samepath rollout", 4, "tokens")
    failed.advance()
    failed.close()  # an error left the phase open: stopped, not done
    assert log.getvalue().splitlines()[-1].startswith("samepath check: samepath rollout stopped: 1/4 tokens, ")
    log = io.StringIO()
    silent = harness.Progress("x", "off", log)
    silent.start("a", 1, "tokens")
    silent.advance()
    silent.close()
    assert log.getvalue() == ""


def test_python_m_samepath_check(tmp_path) -> None:
    """The module entry point, in a fresh process: JSON on stdout, exit status 0."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]
        ),
    )
    argv = ["check", "--dtype", "float32", "--batch", "1", "--new-tokens", "2", "--temperature", "0", "--json", "-"]
    proc = subprocess.run(
        [sys.executable, "-m", "samepath", *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["runs"]["samepath"]["bit_identical"] and doc["settings"]["temperature"] == 0.0
    assert "Traceback" not in proc.stderr
