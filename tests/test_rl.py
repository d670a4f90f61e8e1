"""samepath.rl: a GRPO loop whose rollout (Hugging Face ``generate`` on a separate model that
receives the trainer's weights by a state-dict copy after every step) and trainer log-probs are
``torch.equal`` at every step, with the weights changing between steps.

Negative controls, each a deliberate difference present on every machine: a rollout sent the
bf16 cast rounded toward zero instead of to nearest even (a cast done differently), and a
rollout that keeps the weights of the first step (slow).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath.check.cli import main  # noqa: E402
from samepath.check.harness import DEFAULT_MODEL_CONFIG  # noqa: E402
from samepath.rl import (  # noqa: E402
    AUTOCAST_REFUSAL,
    CopyTask,
    HFRollout,
    Trainer,
    group_advantages,
    numerics,
    run_grpo,
    step_metrics,
)

#: One layer, small vocabulary: three interpreted RL steps fit the main suite.
TINY = {**DEFAULT_MODEL_CONFIG, "num_hidden_layers": 1, "vocab_size": 128, "hidden_size": 32}
TINY |= {"intermediate_size": 48, "head_dim": 16}
LOOP = dict(group_size=2, new_tokens=3)


def tiny_model(tied: bool, seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen3Config(**{**TINY, "tie_word_embeddings": tied})
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # spread the logits out, as the check harness's default model does
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def task() -> CopyTask:
    return CopyTask(TINY["vocab_size"], num_prompts=2, min_len=2, max_len=4, seed=1)


def assert_on_policy(history, steps: int) -> None:
    assert len(history) == steps
    for m in history:
        assert m.bitwise_equal, f"step {m.step}: rollout and trainer log-probs differ (max |Δ| {m.max_abs_diff})"
        assert m.equal_tokens == m.tokens
        assert m.ratio_min == m.ratio_max == 1.0
        assert m.max_abs_diff == m.mean_abs_diff == m.k3_kl == 0.0
        assert m.rollout_probs_diff_max == m.rollout_probs_diff_mean == 0.0
        # AdamW without weight decay: a weight moves only when the policy gradient is nonzero. (The
        # loss value itself is -mean(advantages) at ratio 1, zero up to rounding: not asserted.)
        assert m.weight_change > 0, f"step {m.step}: the update changed no weight the rollout is sent"


def test_fp32_master_tied_embeddings_three_steps_bit_identical():
    """fp32 master weights, forward on their bf16 cast under autocast, lm_head tied to the embedding."""
    model = tiny_model(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with numerics("samepath"):
        trainer = Trainer(model, "fp32_master", lr=1e-3)
        rollout = HFRollout.for_trainer(trainer)
        history = run_grpo(trainer, rollout, task(), steps=3, **LOOP)
    assert_on_policy(history, 3)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    served = rollout.model.state_dict()
    for name, tensor in trainer.rollout_state_dict().items():
        assert served[name].dtype == torch.bfloat16 and torch.equal(served[name], tensor), name
    assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight


class TruncatingRollout(HFRollout):
    """Sent the bf16 cast rounded toward zero (the low 16 bits of each fp32 dropped), not to nearest
    even as ``Tensor.to`` and the trainer's forward round."""

    def load_weights(self, weights):
        super().load_weights({name: self.truncate(masters[name]) for name in weights})

    @staticmethod
    def truncate(t: torch.Tensor) -> torch.Tensor:
        bits = t.float().contiguous().view(torch.int32) & -65536
        return bits.view(torch.float32).to(torch.bfloat16)


masters: dict[str, torch.Tensor] = {}


def test_bf16_cast_done_differently_is_reported():
    model = tiny_model(tied=False)
    with numerics("samepath"):
        trainer = Trainer(model, "fp32_master", lr=1e-3)
        masters.clear()
        masters.update({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        rollout = TruncatingRollout(copy.deepcopy(trainer.model), torch.bfloat16)
        history = run_grpo(trainer, rollout, task(), steps=1, **LOOP)
    differs = sum(int((TruncatingRollout.truncate(v) != v.to(torch.bfloat16)).sum()) for v in masters.values())
    assert differs > 0
    (m,) = history
    assert not m.bitwise_equal
    assert m.max_abs_diff > 0 and m.ratio_min < 1.0 < m.ratio_max and m.k3_kl > 0


def test_autocast_over_fp32_is_refused():
    with pytest.raises(ValueError, match="autocast") as info:
        Trainer(tiny_model(tied=False), "autocast")
    assert str(info.value) == AUTOCAST_REFUSAL


def test_autocast_cast_points():
    """Where torch.autocast(bf16) casts in a stock fp32 Qwen3: the matmuls' outputs are bf16, the
    embedding, the norms and the residual stream stay fp32 — why it cannot equal a bf16 rollout."""
    model = tiny_model(tied=True).float().eval()
    dtypes = {}
    hooks = [
        module.register_forward_hook(lambda mod, args, out, name=name: dtypes.__setitem__(name, out.dtype))
        for name, module in model.named_modules()
        if name.endswith(("embed_tokens", "input_layernorm", "q_proj", "q_norm", "down_proj", "lm_head", "layers.0"))
    ]
    ids = torch.randint(1, TINY["vocab_size"], (1, 5))
    with numerics("stock"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    layer = "model.layers.0"
    assert dtypes["model.embed_tokens"] == torch.float32
    assert dtypes[f"{layer}.input_layernorm"] == torch.float32
    assert dtypes[f"{layer}.self_attn.q_proj"] == torch.bfloat16
    assert dtypes[f"{layer}.self_attn.q_norm"] == torch.float32  # bf16 input times an fp32 weight
    assert dtypes[f"{layer}.mlp.down_proj"] == torch.bfloat16
    assert dtypes[layer] == torch.float32  # the residual stream
    assert out.logits.dtype == torch.bfloat16


def test_pairing_and_arguments_are_checked():
    model = tiny_model(tied=False)
    with pytest.raises(ValueError, match="precision"):
        Trainer(model, "fp16")
    trainer = Trainer(model, "bf16")
    with pytest.raises(ValueError, match=r"serves torch\.float32"):
        run_grpo(trainer, HFRollout(copy.deepcopy(model), torch.float32), task(), steps=1)
    rollout = HFRollout.for_trainer(trainer)
    bad = [(dict(steps=0), "steps"), (dict(steps=1, group_size=1), "group_size")]
    bad.append((dict(steps=1, sync_steps=-1), "sync_steps"))
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            run_grpo(trainer, rollout, task(), **kwargs)
    with pytest.raises(ValueError, match="float32"):
        rollout.load_weights({k: v.float() for k, v in trainer.rollout_state_dict().items()})
    with pytest.raises(ValueError, match="min_len"):
        CopyTask(10, min_len=4, max_len=2)
    from samepath.rl.train_check import TrainCheckSpec

    with pytest.raises(ValueError, match="rollout must be one of"):
        TrainCheckSpec(rollout="sglang")
    with pytest.raises(ValueError, match="transport must be one of shm, rpc, got 'nccl'"):  # at once, not in the child
        TrainCheckSpec(rollout="vllm", transport="nccl")


def test_group_advantages_and_reward():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.25, 0.75])
    adv = group_advantages(rewards, 2)
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0])
    assert torch.allclose(adv, expected, atol=1e-5)  # correctness of a formula, not a consistency claim
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 4)
    copy_task = CopyTask(vocab_size=11)
    assert copy_task.reward([2, 3], [2, 3, 2]) == 1.0
    assert copy_task.reward([2, 3], [7, 3, 2, 8]) == 1.0 - 10 / 40


def test_step_metrics_formulas():
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    trainer = rollout.clone()
    trainer[1, 1] = -2.9
    m = step_metrics(0, rollout, trainer)
    d = float(torch.tensor(-2.9).double() - torch.tensor(-3.0).double())
    assert not m.bitwise_equal and m.equal_tokens == 3 and m.tokens == 4
    assert m.max_abs_diff == abs(d) and m.mean_abs_diff == abs(d) / 4
    assert m.ratio_max == math.exp(d) and m.ratio_min == 1.0
    assert math.isclose(m.k3_kl, (math.exp(d) - 1 - d) / 4, rel_tol=1e-12)
    a, b = float(trainer[1, 1]), float(rollout[1, 1])
    assert math.isclose(m.rollout_probs_diff_max, abs(math.exp(a) - math.exp(b)), rel_tol=1e-12)
    same = step_metrics(1, rollout, rollout.clone())
    assert same.bitwise_equal and same.ratio_min == same.ratio_max == 1.0 and same.k3_kl == 0.0
    with pytest.raises(ValueError, match="shape"):
        step_metrics(0, rollout, rollout[:1])


def _cli(argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    return status, stdout.getvalue()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--steps", "0"], "--steps"),
        (["--group-size", "1"], "--group-size"),
        (["--precision", "fp16"], "--precision"),
        (["--rollout", "sglang"], "rollout"),
        (["--eos-token-id", "320"], "--eos-token-id"),
        (["--eos-token-id", "end"], "--eos-token-id"),
        (["--transport", "rpc"], "--transport"),
    ],
)
def test_train_check_bad_input(argv, fragment, capsys):
    assert main(["train-check", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_train_check_exit_status_and_json(tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = ["train-check", "--steps", "1", "--prompts", "1", "--group-size", "2", "--new-tokens", "2"]
    argv += ["--json", str(out)]
    png = tmp_path / "drift.png"
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    status, text = _cli(argv)
    report = json.loads(out.read_text())
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert status == 0, text
    assert report["exit_status"] == 0 and report["bit_identical"] is True
    steps = report["runs"]["samepath"]["steps"]
    assert len(steps) == 1 and all(s["bitwise_equal"] and s["ratio_max"] == 1.0 for s in steps)
    assert all(s["weight_change"] > 0 for s in steps)
    assert report["environment"]["versions"]["torch"] == torch.__version__
    # The default (temperature 0.7) shows the drift samepath removes on every machine, by construction
    # and not by how this CPU's stock kernels round: stock's trainer divides its bf16 logits by 0.7 in
    # bf16 (as verl does) while the rollout divides fp32 logits, so its log-probs differ.
    stock = report["runs"]["stock"]
    assert len(stock["steps"]) == 1 and stock["bit_identical"] is False
    assert stock["steps"][0]["equal_tokens"] < stock["steps"][0]["tokens"] and stock["steps"][0]["max_abs_diff"] > 0
    assert report["settings"]["temperature"] == 0.7
    assert report["model"]["source"] == "embedded-default" and report["model"]["trainer_precision"] == "fp32_master"
    header = text.splitlines()[0]
    assert header.startswith("samepath train-check: qwen3 (embedded default") and "bfloat16" in header
    assert "fp32_master" in header and "temperature 0.7" in header
    # progress on stderr (not a terminal): a plain line as each loop starts and ends, with its steps
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("samepath train-check: [")]
    assert [line.split(" (")[0].split(" done")[0] for line in lines] == [
        "samepath train-check: [1/2] stock GRPO",
    ] * 2 + ["samepath train-check: [2/2] samepath GRPO"] * 2
    assert " done: 1/1 steps, " in lines[1] and " done: 1/1 steps, " in lines[3]


@pytest.mark.slow
def test_bf16_trainer_untied_three_steps_bit_identical():
    with numerics("samepath"):
        trainer = Trainer(tiny_model(tied=False), "bf16", lr=1e-3)
        history = run_grpo(trainer, HFRollout.for_trainer(trainer), task(), steps=3, **LOOP)
    assert_on_policy(history, 3)


@pytest.mark.slow
def test_stale_rollout_is_reported():
    """The rollout is sent the weights after the first update only: steps 0 and 1 agree, step 2
    (the trainer one update ahead) does not."""
    with numerics("samepath"):
        trainer = Trainer(tiny_model(tied=True), "fp32_master", lr=1e-3)
        history = run_grpo(trainer, HFRollout.for_trainer(trainer), task(), steps=3, sync_steps=1, **LOOP)
    assert history[0].bitwise_equal and history[1].bitwise_equal
    assert all(m.weight_change > 0 for m in history)
    assert not history[2].bitwise_equal and history[2].max_abs_diff > 0


def test_train_check_exits_1_when_a_samepath_step_differs(monkeypatch, tmp_path):
    """The exit status follows samepath's steps: one step that differs gives 1 (the loop is
    replaced by recorded metrics; the loop itself is exercised above)."""
    from samepath.rl import train_check

    lp = torch.tensor([[-1.0, -2.0]])

    def fake_run(spec, on_step=None):
        return [step_metrics(0, lp, lp), step_metrics(1, lp, lp + 1e-3, weight_change=0.1)]

    monkeypatch.setattr(train_check, "run", fake_run)
    out = tmp_path / "r.json"
    status, text = _cli(["train-check", "--steps", "2", "--json", str(out)])
    assert status == 1 and "NOT bit-identical" in text
    report = json.loads(out.read_text())
    assert report["exit_status"] == 1 and report["bit_identical"] is False
    assert [s["bitwise_equal"] for s in report["runs"]["samepath"]["steps"]] == [True, False]


def test_train_check_output_defines_stock_and_the_plot_reads_zero_as_bit_identical(tmp_path, monkeypatch) -> None:
    """The table says what "stock" is; the plot's axis says that 0 means bit-identical."""
    import dataclasses

    from samepath.rl import StepMetrics, train_check

    fields = {f.name: 0.0 for f in dataclasses.fields(StepMetrics)}
    step = StepMetrics(**{**fields, "step": 1, "tokens": 4, "bitwise_equal": True, "equal_tokens": 4})
    assert "stock: the same loop with the frameworks' own kernels" in train_check.format_table([step], [step])
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    import matplotlib.figure

    labels = []
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: labels.append(fig.axes[0].get_ylabel())
    )
    train_check.plot([step], [step], str(tmp_path / "steps.png"))
    assert labels and "0 = bit-identical" in labels[0]
