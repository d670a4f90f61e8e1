"""samepath.processed_logprobs / sampling_keep_mask: the sampling edits (min_tokens, min-p, top-k,
top-p) against an fp64 reference of the documented rule, their edge cases and errors, and the
vLLM plugin's step functions composed in vLLM's order, bit for bit equal to the trainer's function.
CPU only (Triton's interpreter); the end-to-end vLLM cases are in tests/test_integration_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import samepath
from samepath.integrations.vllm.sampler import check_processed_sampling, min_p_mask, penalties, top_k_top_p
from samepath.kernels.config import OP_FORMULAS, RowReduceConfig

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _reference_keep(z: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """The documented rule in fp64, one row at a time, sorted positions as a plain loop."""
    keep = torch.zeros_like(z, dtype=torch.bool)
    for row in range(z.shape[0]):
        s = torch.sort(z[row].double(), descending=True).values
        e = torch.exp(s - s[0])
        kept = [j for j in range(len(s)) if j < k and e[j] >= min_p]
        n = len(kept)
        if p < 1.0:
            mass = sum(float(e[j]) for j in kept)
            run, below = 0.0, 0
            for j in kept:
                run += float(e[j])
                below += run < p * mass
            n = min(n, below + 1)
        keep[row] = z[row] >= s[max(n, 1) - 1].float()
    return keep


def _midpoints(z: torch.Tensor, what: str, gen: torch.Generator) -> torch.Tensor:
    """Per row, a top_p (or min_p) halfway between two consecutive fp64 cumulative masses (or
    weights), so that fp32 rounding cannot move the boundary."""
    values = []
    for row in range(z.shape[0]):
        s = torch.sort(z[row].double(), descending=True).values
        e = torch.exp(s - s[0])
        points = torch.cumsum(e, 0) / e.sum() if what == "top_p" else e
        j = int(torch.randint(0, min(8, len(s) - 1), (1,), generator=gen))
        values.append(float((points[j] + points[j + 1]) / 2))
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize(
    ("rows", "vocab", "chunk"),
    [(5, 37, None), (4, 300, 16), (3, 5000, None)],
    ids=["V37", "V300-chunk16", "V5000-two-chunks"],
)
def test_keep_mask_matches_the_fp64_rule(rows, vocab, chunk):
    z = _logits(rows, vocab, seed=vocab)
    gen = torch.Generator().manual_seed(1)
    config = RowReduceConfig(vocab_chunk=chunk) if chunk else None
    top_p = _midpoints(z, "top_p", gen)
    min_p = _midpoints(z, "min_p", gen)
    top_k = torch.randint(1, vocab + 5, (rows,), generator=gen, dtype=torch.int32)
    cases = [
        dict(top_p=top_p),
        dict(min_p=min_p),
        dict(top_k=top_k),
        dict(top_k=top_k, top_p=top_p),
    ]
    for case in cases:
        got = samepath.sampling_keep_mask(z, config=config, **case)
        for row in range(rows):
            k = int(case["top_k"][row]) if "top_k" in case else vocab
            p = float(case["top_p"][row]) if "top_p" in case else 1.0
            m = float(case["min_p"][row]) if "min_p" in case else 0.0
            want = _reference_keep(z[row : row + 1], k, p, m)[0]
            assert torch.equal(got[row], want), (case.keys(), row)
        assert bool(got.any(-1).all())


def test_ties_at_the_boundary_are_all_kept():
    z = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0, -2.0, 3.0]])
    assert samepath.sampling_keep_mask(z, top_k=2).tolist() == [[True, True, True, True, False, False, False, True]]
    e = torch.exp(z.double() - 5.0)[0]
    # the mass of the max alone is below p: top-p reaches into the tied 3.0s and keeps all four
    p = float(e[0] / e.sum()) + 0.01
    got = samepath.sampling_keep_mask(z, top_p=p)
    assert got.tolist() == [[True, True, True, True, False, False, False, True]]
    # min-p exactly at a tied weight keeps the ties (e >= min_p)
    m = float(torch.tensor(float(e[1]), dtype=torch.float32))
    assert samepath.sampling_keep_mask(z, min_p=m)[0, [1, 2, 3, 7]].all()


def test_off_values_are_no_ops():
    """top_k larger than the vocabulary (or 0 / -1), top_p = 1, min_p = 0: the log-probs of the
    tempered logits, bit for bit, and a keep mask of all True."""
    logits = _logits(4, 40, seed=3).to(torch.bfloat16)
    labels = torch.randint(0, 40, (4,), generator=torch.Generator().manual_seed(2))
    plain = samepath.logprobs(logits, labels, 0.7)
    for kw in (dict(top_k=41), dict(top_k=0), dict(top_k=-1), dict(top_p=1.0), dict(min_p=0.0), dict(top_k=40)):
        assert torch.equal(samepath.processed_logprobs(logits, labels, 0.7, **kw), plain), kw
    z = logits.float() / 0.7
    assert bool(samepath.sampling_keep_mask(z, top_k=100, top_p=torch.ones(4), min_p=0.0).all())


def test_greedy_ignores_top_k_top_p_min_p_as_vllm_does():
    logits = _logits(3, 30, seed=4)
    labels = logits.argmax(-1)
    want = samepath.logprobs(logits, labels, 1.0)
    assert torch.equal(samepath.processed_logprobs(logits, labels, 0.0, top_p=0.5, top_k=2, min_p=0.5), want)


def test_edits_change_the_log_probs_as_the_reference_says():
    """top-p renormalises over the kept set: fp32 result close to the fp64 log-softmax of the kept
    logits; a dropped label is -inf."""
    logits = _logits(6, 64, seed=5)
    z = logits / 0.8
    labels = z.argmax(-1)
    got = samepath.processed_logprobs(logits, labels, 0.8, top_p=0.6, top_k=20)
    keep = _reference_keep(z, 20, float(torch.tensor(0.6)), 0.0)
    ref = torch.log_softmax(z.double().masked_fill(~keep, float("-inf")), -1).gather(1, labels[:, None])[:, 0]
    assert torch.allclose(got.double(), ref, atol=2e-6, rtol=0)
    assert not torch.equal(got, samepath.logprobs(logits, labels, 0.8))
    dropped = (~keep).float().argmax(-1)
    assert torch.isneginf(samepath.processed_logprobs(logits, dropped, 0.8, top_p=0.6, top_k=20)).all()


def test_min_tokens_masks_the_stop_tokens_while_unmet():
    logits = _logits(2 * 5, 50, seed=6).view(2, 5, 50)
    labels = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    labels[0, 4] = 7  # the stop token, generated once min_tokens is met
    got = samepath.processed_logprobs(logits, labels, 0.9, min_tokens=3, stop_token_ids=[7, 11])
    masked = logits.clone()
    masked[:, :3, 7] = float("-inf")
    masked[:, :3, 11] = float("-inf")
    assert torch.equal(got, samepath.logprobs(masked, labels, 0.9))
    assert got[0, 4].isfinite()
    # an explicit count of generated tokens: the second row is 2 tokens further
    generated = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    got = samepath.processed_logprobs(logits, labels, 0.9, min_tokens=3, stop_token_ids=[7], generated=generated)
    masked = logits.clone()
    masked[0, :3, 7] = float("-inf")
    masked[1, :1, 7] = float("-inf")
    assert torch.equal(got, samepath.logprobs(masked, labels, 0.9))
    # one row without a leading dimension: its first token
    one = samepath.processed_logprobs(logits[0, 0], labels[0, 0], 0.9, min_tokens=1, stop_token_ids=[7])
    assert torch.equal(
        one, samepath.logprobs(logits[0, 0].index_fill(0, torch.tensor([7]), float("-inf")), labels[0, 0], 0.9)
    )
    # negative control: without min_tokens the stop token's log-prob is not masked away
    assert not torch.equal(samepath.processed_logprobs(logits, labels, 0.9), got)


@pytest.mark.parametrize("temperature", [0.9, 0.0])
def test_a_position_with_every_token_masked_is_nan_as_in_vllm(temperature):
    """min_tokens unmet while the stop tokens cover the vocabulary (or every allowed token is a
    stop token): vLLM 0.32's MinTokensLogitsProcessor sets them all to -inf (index_put_, no
    fallback outside structured outputs / speculative decoding) and its log_softmax of that row is
    NaN; the documented result here is the same NaN at those positions and no other."""
    vocab = 6
    logits = _logits(4, vocab, seed=9)
    labels = torch.tensor([1, 2, 3, 4])
    got = samepath.processed_logprobs(logits, labels, temperature, min_tokens=2, stop_token_ids=list(range(vocab)))
    # vLLM's steps: the stop tokens of rows below min_tokens to -inf, the temperature, log_softmax
    masked = logits.clone()
    masked[:2] = float("-inf")
    scaled = masked / temperature if temperature else masked
    vllm = torch.log_softmax(scaled, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.equal(got.isnan(), vllm.isnan()) and got[:2].isnan().all() and got[2:].isfinite().all()
    assert torch.equal(samepath.log_softmax(masked[:2]).isnan(), torch.ones(2, vocab, dtype=torch.bool))  # the plugin's
    allowed = samepath.processed_logprobs(
        logits, labels, temperature, min_tokens=2, stop_token_ids=[1, 2], allowed_token_ids=[1, 2]
    )
    assert allowed[:2].isnan().all() and not allowed[2:].isnan().any()


def test_rows_are_batch_invariant_and_the_harness_can_fail():
    logits = _logits(12, 300, seed=7).to(torch.bfloat16)
    labels = (logits.float() / 0.7).argmax(-1)
    kw = dict(top_p=0.9, top_k=50, min_p=0.02)
    batch = samepath.processed_logprobs(logits, labels, 0.7, **kw)
    alone = torch.cat([samepath.processed_logprobs(logits[i : i + 1], labels[i : i + 1], 0.7, **kw) for i in range(12)])
    assert torch.equal(batch, alone)
    # negative control: the same comparison without the top-p edit on one side reports a difference
    no_top_p = samepath.processed_logprobs(logits, labels, 0.7, top_k=50, min_p=0.02)
    assert not torch.equal(batch, no_top_p)


def test_gradient_flows_to_kept_tokens_only():
    logits = _logits(4, 32, seed=8).requires_grad_(True)
    labels = (logits.detach() / 0.9).argmax(-1)
    samepath.processed_logprobs(logits, labels, 0.9, top_p=0.7).sum().backward()
    keep = samepath.sampling_keep_mask(logits.detach() / torch.full((1,), 0.9), top_p=0.7)
    assert torch.isfinite(logits.grad).all()
    assert bool((logits.grad[~keep] == 0).all()) and bool((logits.grad[keep] != 0).any())


def _vllm_steps(logits, temperature, top_k, top_p, min_p, stop_masked):
    """vLLM's sampler order with the plugin's step functions, on one decode batch ``[B, V]`` with
    per-request parameters as vLLM's input batch holds them (top_k off = V, top_p off = 1)."""
    z = logits.float()
    z[stop_masked] = float("-inf")
    z = z.div_(temperature.unsqueeze(1))
    if bool((min_p > 0).any()):
        z = min_p_mask(z, min_p.unsqueeze(1))
    return torch.log_softmax(top_k_top_p(z, top_k, top_p), -1)


def test_vllm_step_functions_equal_the_trainers_function():
    """The rollout side (the plugin's functions on a mixed decode batch, vLLM's order) and the
    trainer side (processed_logprobs per request on its own rows) agree bit for bit; dropping
    one edit on the trainer side reports a difference (negative control)."""
    vocab = 96
    logits = _logits(5, vocab, seed=9).to(torch.bfloat16)
    temperature = torch.tensor([0.7, 1.0, 0.9, 1.3, 1.0])
    top_k = torch.tensor([vocab, 10, vocab, 20, vocab], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.01, 0.0])
    stop_masked = torch.zeros(5, vocab, dtype=torch.bool)
    stop_masked[4, 3] = True  # request 4 is still below its min_tokens; its stop token is 3
    with samepath.batch_invariant():
        rollout = _vllm_steps(logits, temperature, top_k, top_p, min_p, stop_masked)
    sampled = rollout.argmax(-1)
    requests = [
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=10),
        dict(temperature=0.9, min_p=0.05),
        dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.01),
        dict(temperature=1.0, min_tokens=4, stop_token_ids=[3], generated=torch.tensor([1])),
    ]
    for row, request in enumerate(requests):
        label = sampled[row : row + 1]
        trainer = samepath.processed_logprobs(logits[row : row + 1], label, **request)
        assert torch.equal(trainer, rollout[row : row + 1].gather(1, label[:, None])[:, 0]), request
        plain = samepath.processed_logprobs(logits[row : row + 1], label, request["temperature"])
        assert not torch.equal(plain, trainer), request
    assert torch.isneginf(rollout[4, 3])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(temperature=-1.0), "temperature"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=2, stop_token_ids=[999]), "stop_token_ids"),
        (dict(generated=torch.zeros(3)), "generated"),
    ],
)
def test_bad_values_name_the_argument(kwargs, name):
    logits = _logits(4, 20, seed=10)
    labels = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=name):
        samepath.processed_logprobs(logits, labels, **kwargs)


def test_keep_mask_refuses_non_fp32_and_wrong_row_counts():
    with pytest.raises(ValueError, match="float32"):
        samepath.sampling_keep_mask(torch.zeros(2, 8, dtype=torch.bfloat16), top_k=2)
    with pytest.raises(ValueError, match="top_p"):
        samepath.sampling_keep_mask(torch.zeros(2, 8), top_p=torch.ones(3))


def _engine(mode: str, **extra):
    model_config = SimpleNamespace(logprobs_mode=mode, logits_processors=extra.pop("logits_processors", None))
    return SimpleNamespace(model_config=model_config, speculative_config=None, use_v2_model_runner=False, **extra)


def _params(**overrides):
    base = dict(
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        allowed_token_ids=None,
        bad_words=None,
        structured_outputs=None,
        thinking_token_budget=None,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        min_tokens=4,
    )
    return SimpleNamespace(**(base | overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(bad_words=["x"]),
        dict(structured_outputs=object()),
        dict(thinking_token_budget=8),
    ],
    ids=lambda o: next(iter(o)),
)
def test_processed_modes_refuse_edits_the_trainer_cannot_reproduce(overrides):
    name = next(iter(overrides))
    for mode in ("processed_logprobs", "processed_logits"):
        with pytest.raises(ValueError, match=rf"{name}=.*raw_logprobs"):
            check_processed_sampling(_params(**overrides), _engine(mode))
    check_processed_sampling(_params(**overrides), _engine("raw_logprobs"))


def test_processed_modes_accept_what_the_trainer_reproduces_and_refuse_engine_features():
    check_processed_sampling(_params(), _engine("processed_logprobs"))
    for engine, what in [
        (_engine("processed_logprobs", logits_processors=["my.Proc"]), "logits_processors"),
        (_engine("processed_logprobs", watermark_config=object()), "watermarking"),
    ]:
        with pytest.raises(ValueError, match=what):
            check_processed_sampling(_params(), engine)
    engine = _engine("processed_logprobs")
    engine.speculative_config = object()
    with pytest.raises(ValueError, match="speculative"):
        check_processed_sampling(_params(), engine)


def test_the_rule_is_in_the_fingerprint():
    assert "top_p" in OP_FORMULAS["sampling"]


def test_an_integration_without_samepaths_masks_refuses_top_k_top_p_min_p():
    """vllm-ascend's sampler runs its own top-k / top-p / min-p kernels: there they are refused too."""
    for name, value in [("top_k", 5), ("top_p", 0.9), ("min_p", 0.1), ("repetition_penalty", 1.2)]:
        plain = _params(top_k=0, top_p=1.0, min_p=0.0)
        setattr(plain, name, value)
        with pytest.raises(ValueError, match=rf"{name}={value}"):
            check_processed_sampling(plain, _engine("processed_logprobs"), sampling_masks=False)
        check_processed_sampling(plain, _engine("processed_logprobs"))
        check_processed_sampling(plain, _engine("raw_logprobs"), sampling_masks=False)
    off = _params(top_k=-1, top_p=1.0, min_p=0.0)
    check_processed_sampling(off, _engine("processed_logprobs"), sampling_masks=False)


def test_penalties_follow_the_history_of_each_position_and_equal_vllms_step():
    """Penalties at position t see the prompt and labels[:t]: the trainer's function equals the
    plugin's vLLM step run on each decode step's history (vLLM's metadata layout: prompts padded
    with V, outputs as lists), bit for bit; without the penalties the log-probs differ (negative
    control); an fp64 evaluation of the same rule is close."""
    vocab, steps = 40, 6
    prompt = [3, 5, 5, 9]
    labels = torch.tensor([5, 7, 7, 3, 20, 7])
    logits = _logits(steps, vocab, seed=11)
    logits[torch.arange(steps), labels] = logits.amax(-1) + 2.0  # the sampled tokens stay in the top-p set
    logits = logits.to(torch.bfloat16)
    kw = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, prompt_token_ids=prompt)
    trainer = samepath.processed_logprobs(logits, labels, 0.8, top_p=0.99, **kw)
    assert torch.isfinite(trainer).all()
    for t in range(steps):
        metadata = SimpleNamespace(
            no_penalties=False,
            prompt_token_ids=torch.tensor([[*prompt, vocab]]),
            presence_penalties=torch.tensor([0.4]),
            frequency_penalties=torch.tensor([0.3]),
            repetition_penalties=torch.tensor([1.3]),
        )
        z = penalties(logits[t : t + 1].float(), metadata, [[*labels[:t].tolist(), -1]])
        z = top_k_top_p(z.div_(torch.tensor([[0.8]])), None, torch.tensor([0.99]))
        with samepath.batch_invariant():
            rollout = torch.log_softmax(z, -1)[0, labels[t]]
        assert torch.equal(rollout, trainer[t]), t
    assert not torch.equal(samepath.processed_logprobs(logits, labels, 0.8, top_p=0.99), trainer)

    x = logits.double()
    reference = []
    for t in range(steps):
        counts = torch.bincount(labels[:t], minlength=vocab).double()
        seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(prompt))
        z = torch.where(seen, torch.where(x[t] > 0, x[t] / 1.3, x[t] * 1.3), x[t]) - 0.3 * counts - 0.4 * (counts > 0)
        reference.append(torch.log_softmax(z / 0.8, -1)[labels[t]])
    plain = samepath.processed_logprobs(logits, labels, 0.8, **kw)
    assert torch.allclose(plain.double(), torch.stack(reference), atol=5e-6, rtol=0)


def test_penalties_need_one_response_and_its_prompt():
    logits = _logits(6, 20, seed=12)
    with pytest.raises(ValueError, match="one response"):
        samepath.processed_logprobs(logits.view(2, 3, 20), torch.zeros(2, 3, dtype=torch.int64), repetition_penalty=1.1)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        samepath.processed_logprobs(logits, torch.zeros(6, dtype=torch.int64), presence_penalty=0.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        samepath.processed_logprobs(
            logits, torch.zeros(6, dtype=torch.int64), repetition_penalty=0.0, prompt_token_ids=[]
        )


def test_allowed_token_ids_and_logit_bias():
    """Tokens outside allowed_token_ids are -inf before everything, biases are one fp32 addition
    each (vLLM's ``logits[rows, ids] += bias``), in vLLM's order; without them the log-probs differ."""
    logits = _logits(5, 30, seed=13).to(torch.bfloat16)
    labels = torch.tensor([2, 4, 2, 9, 4])
    kw = dict(allowed_token_ids=[2, 4, 9, 11], logit_bias={4: 1.5, 11: -3.25}, min_tokens=2, stop_token_ids=[9])
    got = samepath.processed_logprobs(logits, labels, 0.9, top_p=0.9, **kw)
    z = logits.float()
    z[:, [0, 1, 3, 5, 6, 7, 8, 10, *range(12, 30)]] = float("-inf")
    z[:2, 9] = float("-inf")
    z[:, 4] += torch.tensor(1.5)
    z[:, 11] += torch.tensor(-3.25)
    z = z / torch.tensor([0.9])
    z = top_k_top_p(z, None, torch.full((5,), 0.9))
    with samepath.batch_invariant():
        want = torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0]
    assert torch.equal(got, want)
    assert not torch.equal(
        samepath.processed_logprobs(logits, labels, 0.9, top_p=0.9, min_tokens=2, stop_token_ids=[9]), got
    )
    with pytest.raises(ValueError, match="allowed_token_ids"):
        samepath.processed_logprobs(logits, labels, allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias"):
        samepath.processed_logprobs(logits, labels, logit_bias={99: 1.0})
