"""bench/npu_formula.py (the ``formula`` stage of bench/npu_check.sh) in its dry run: every check the CPU can
run (Triton kernels under the interpreter, the Ascend C kernel replaced by its replay), the device steps it
skipped listed, and a broken exp2 identity caught."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from bench import npu_formula
from samepath.kernels.attention.ascendc import replay


def test_dry_run_passes_every_check_and_lists_the_device_steps(tmp_path) -> None:
    out = tmp_path / "formula.json"
    assert npu_formula.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert set(report["checks"]) == set(npu_formula.CHECKS)
    for check, results in report["checks"].items():
        assert all(r["ok"] for r in results.values()), (check, results)
    identities = report["checks"]["identities"]
    assert identities["exp2(0) == 1"]["ok"] and identities["log2(1) == 0"]["ok"]
    masked = report["checks"]["masked_tile"]
    assert masked["negative control: no -inf guard turns fresh masked rows into NaN"]["ok"]
    for which in ("triton", "ascendc"):
        visits = masked[f"{which}: training rows == rows decoded alone"]["fully_masked_visits"]
        assert visits["fresh"] > 0 and visits["with_data"] > 0  # both kinds of fully masked tile were visited
    compared = {name: r for name, r in report["checks"]["backends"].items() if name.startswith("ascendc vs")}
    callers = {name.split(": ", 1)[1] for name in compared}
    assert callers == {"varlen_attention", "varlen_attention backward", "packed_attention", "paged_attention prefill",
                       "paged_attention chunked", "paged_attention decode"}  # fmt: skip
    assert set(report["checks"]["backends"]) - set(compared) == {"seconds"}  # no comparison row goes unchecked
    assert all(r["bitwise_equal"] is True for r in compared.values())  # the replay: same schedule
    assert len(report["skipped_device_steps"]) == sum(len(s) for s in npu_formula.DEVICE_STEPS.values())


def test_a_broken_exp2_identity_fails_the_check(monkeypatch, tmp_path) -> None:
    """Negative control: an Ascend C exp2 whose exp2(0) is not 1 fails the one-key rows (exit status 1)."""
    broken = dataclasses.replace(
        replay.TRITON_INTERPRETER, name="broken", exp2=lambda x: np.exp2(x) * np.float32(1 - 2**-24)
    )
    monkeypatch.setattr(replay, "simulate_forward", functools.partial(replay.simulate_forward, primitives=broken))
    out = tmp_path / "formula.json"
    assert npu_formula.main(["--dry-run", "--checks", "identities", "--out", str(out)]) == 1
    results = json.loads(out.read_text())["checks"]["identities"]
    assert not results["ascendc: a row seeing one key returns its value, lse its score"]["ok"]
    assert results["triton: a row seeing one key returns its value, lse its score"]["ok"]
