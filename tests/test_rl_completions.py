"""samepath.rl with completions of real lengths and per-request seeds.

- EOS-terminated and length-capped completions mixed in one batch, for three GRPO steps: the
  rollout (Hugging Face ``generate``) and the trainer's log-probs over exactly the generated tokens
  are ``torch.equal`` (importance ratio exactly 1 on every token) with the weights changing; the
  same loop stock (the frameworks' kernels, the trainer dividing bf16 logits by the temperature as
  verl does) drifts: the negative control.
- Reproducible rollouts: every request its own seed (``base + index*1000003 + sample*1009 +
  step*9176``); the same seeds give the same completions bit for bit, in any batch order; other
  seeds give others (the negative control); an EOS run is the capped run cut at its first EOS.
- Autocast over fp32 modules with samepath's kernels: refused (an RMSNorm meets a bf16 input and an
  fp32 weight); ``fp32_master``, the supported alternative, equals the bf16-cast forward.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath.rl import (  # noqa: E402
    HFRollout,
    Trainer,
    completion_mask,
    numerics,
    request_seed,
    request_seeds,
    run_grpo,
)
from samepath.rl.train_check import StockTrainer  # noqa: E402
from tests.test_rl import TINY, task, tiny_model  # noqa: E402

#: The EOS id, and the factor its lm_head row is scaled by: its logit then swings far above and
#: below the others, so about half the completions end at EOS within 4 tokens, the rest are capped.
EOS, EOS_SCALE = 7, 6.0
LOOP = dict(group_size=2, new_tokens=4, eos_token_id=EOS)
TEMPERATURE = 0.7


def eos_model() -> torch.nn.Module:
    model = tiny_model(tied=False)
    with torch.no_grad():
        model.lm_head.weight[EOS].mul_(EOS_SCALE)
    return model


def test_request_seed_recipe():
    assert request_seed(5, 2, 3, 4) == 5 + 2 * 1000003 + 3 * 1009 + 4 * 9176
    assert request_seeds(1, 2, 2, 3) == [request_seed(1, i, j, 3) for i in range(2) for j in range(2)]
    tokens = torch.tensor([[3, EOS, 4, EOS], [1, 2, 3, 4], [EOS, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(tokens, EOS), expected)
    assert completion_mask(tokens, None).all()


def test_eos_and_capped_completions_three_steps_on_policy_and_stock_drifts():
    history = {}
    for name, trainer_class in (("samepath", Trainer), ("stock", StockTrainer)):
        with numerics(name):
            trainer = trainer_class(eos_model(), "fp32_master", lr=1e-3, temperature=TEMPERATURE)
            history[name] = run_grpo(trainer, HFRollout.for_trainer(trainer), task(), steps=3, **LOOP)
    for m in history["samepath"]:
        assert m.eos_completions > 0 and m.capped_completions > 0, m  # both kinds in every batch
        assert m.bitwise_equal and m.equal_tokens == m.tokens, f"step {m.step}: max |Δ| {m.max_abs_diff}"
        assert m.ratio_min == m.ratio_max == 1.0 and m.k3_kl == 0.0 and m.rollout_probs_diff_max == 0.0
        assert m.weight_change > 0
    assert sum(m.tokens for m in history["samepath"]) < 3 * 4 * LOOP["new_tokens"]  # the completions' own tokens
    assert sum(m.eos_completions for m in history["stock"]) > 0
    assert any(not m.bitwise_equal and m.max_abs_diff > 0 for m in history["stock"])


def test_trainer_logprobs_cover_exactly_the_generated_tokens():
    """After a completion's end the trainer's log-probs are 0 with no gradient, and the forward
    sees only prompt + completion: equal to the same completion alone in a batch of one."""
    with numerics("samepath"):
        trainer = Trainer(eos_model(), "fp32_master", temperature=TEMPERATURE)
        rollout = HFRollout.for_trainer(trainer)
        prompts = [p for p in task().prompts() for _ in range(2)]
        tokens, rollout_lp = rollout.generate(prompts, 4, TEMPERATURE, request_seeds(3, 2, 2, 0), EOS)
        mask = completion_mask(tokens, EOS)
        assert not mask.all() and mask.any(1).all()
        lp = trainer.logprobs(prompts, tokens, mask)
        assert torch.equal(lp.detach(), rollout_lp)
        assert torch.equal(lp.detach()[~mask], torch.zeros(int((~mask).sum())))
        lp.sum().backward()
        row = int((~mask).any(1).nonzero()[0])
        alone = trainer.logprobs(prompts[row : row + 1], tokens[row : row + 1], mask[row : row + 1])
        assert torch.equal(alone.detach(), lp.detach()[row : row + 1])


def test_seeded_rollouts_replay_bit_for_bit():
    with numerics("samepath"):
        rollout = HFRollout(eos_model(), torch.bfloat16)
        prompts = [p for p in task().prompts() for _ in range(2)]
        seeds = request_seeds(11, 2, 2, 1)
        tokens, lp = rollout.generate(prompts, 4, TEMPERATURE, seeds)
        again, again_lp = rollout.generate(prompts, 4, TEMPERATURE, seeds)
        assert torch.equal(tokens, again) and torch.equal(lp, again_lp)
        # Each request on its own seed: the batch reversed gives each the same completion.
        rev, rev_lp = rollout.generate(prompts[::-1], 4, TEMPERATURE, seeds[::-1])
        assert torch.equal(rev.flip(0), tokens) and torch.equal(rev_lp.flip(0), lp)
        other, _ = rollout.generate(prompts, 4, TEMPERATURE, request_seeds(12, 2, 2, 1))
        assert not torch.equal(other, tokens)  # negative control: other seeds, other completions
        # With an EOS each completion is the capped one cut after its first EOS.
        cut, cut_lp = rollout.generate(prompts, 4, TEMPERATURE, seeds, EOS)
        mask = completion_mask(tokens, EOS)
        assert torch.equal(cut[mask], tokens[mask]) and torch.equal(cut_lp[mask], lp[mask])
        assert torch.equal(cut_lp[~mask], torch.zeros(int((~mask).sum())))
    with pytest.raises(ValueError, match="seeds"):
        rollout.generate(prompts, 4, TEMPERATURE, seeds[:1])


def test_autocast_over_fp32_is_refused_by_name():
    """A patched model under ``torch.autocast(bf16)`` over fp32 weights is refused by name at its
    first norm (autocast would leave the embedding, norms and residual stream in fp32 and give Qwen3's
    ``q_norm`` a bf16 input with an fp32 weight: bits no bf16 rollout computes), naming the supported
    alternative. ``fp32_master`` (the forward on the bf16 cast, under autocast) equals the rollout's
    forward."""
    model = tiny_model(tied=False).float()
    ids = torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    with numerics("samepath"), torch.no_grad():
        reference = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids, use_cache=False).logits
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            pytest.raises(ValueError, match=r"autocast\(torch.bfloat16\) over fp32 weights is refused"),
        ):
            model(input_ids=ids, use_cache=False)
        trainer = Trainer(copy.deepcopy(model), "fp32_master")
        master = trainer._forward_logits(ids, torch.ones_like(ids))
    assert torch.equal(master, reference)
    torch.manual_seed(0)  # a model without q_norm (Llama) too, at its first norm
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float()
    with numerics("samepath"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="fp32_master"):
            llama(input_ids=ids, use_cache=False)


def test_train_check_eos_completions_from_the_models_own_eos(tmp_path, capsys):
    """``samepath train-check --model DIR``: the model's own ``eos_token_id`` ends completions by
    default (``--eos-token-id auto``), EOS and capped ones in one run, samepath bit-identical on the
    completions' tokens; ``--eos-token-id none`` caps all of them."""
    from samepath.check.cli import main

    model = eos_model()
    model.config.eos_token_id = EOS
    model.save_pretrained(tmp_path / "model")
    argv = ["train-check", "--model", str(tmp_path / "model"), "--steps", "2", "--prompts", "2", "--group-size", "2"]
    argv += ["--new-tokens", "4", "--seed", "0", "--json", str(tmp_path / "out.json")]
    assert main(argv) == 0, capsys.readouterr()
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["settings"]["eos_token_id"] == EOS
    steps = report["runs"]["samepath"]["steps"]
    assert all(s["bitwise_equal"] and s["ratio_min"] == s["ratio_max"] == 1.0 for s in steps)
    assert sum(s["eos_completions"] for s in steps) > 0 and sum(s["capped_completions"] for s in steps) > 0
    assert f"ended at EOS {EOS}" in capsys.readouterr().out
    assert main([*argv[:-2], "--eos-token-id", "none", "--json", str(tmp_path / "capped.json")]) == 0
    capped = json.loads((tmp_path / "capped.json").read_text())
    assert capped["settings"]["eos_token_id"] is None
    assert all(s["eos_completions"] == 0 and s["tokens"] == 16 for s in capped["runs"]["samepath"]["steps"])
