"""vllm-ascend's sampling edits (penalties, top-k / top-p, min-p) on samepath, on a fake module tree.

The tree has vllm-ascend's patch points as its 0.18.0 / 0.23.0 source has them (``AscendSampler``
with a staticmethod ``apply_penalties``, a module-level ``apply_top_k_top_p`` that
``AscendTopKTopPSampler.__init__`` binds, vLLM's ``MinPLogitsProcessor``); the step runs the order
vLLM / vllm-ascend run (penalties, temperature, min-p, top-k / top-p, fp32 log-softmax) and is
compared with :func:`samepath.processed_logprobs` bit for bit. The NPU kernels themselves are not
run here.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

import samepath
from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm_ascend import sampler, state

ASCEND_SOURCE = """
import torch

def _stock_top_k_top_p(logits, k, p):  # stands for vllm-ascend's Ascend C / PyTorch top-k / top-p
    if k is not None:
        kth = logits.topk(int(k.max()), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p is not None:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p[:, None]
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits

apply_top_k_top_p = _stock_top_k_top_p

class AscendSampler:
    @staticmethod
    def apply_penalties(logits, sampling_metadata, output_token_ids):
        return logits  # stands for the Triton-Ascend penalties

class AscendTopKTopPSampler:
    def __init__(self):
        self.apply_top_k_top_p = apply_top_k_top_p  # as vllm-ascend binds it

    def processed_logprobs(self, logits, k, p):
        logits = self.apply_top_k_top_p(logits, k, p)
        return logits.log_softmax(dim=-1, dtype=torch.float32)
"""


class MinPLogitsProcessor:
    def __init__(self, min_p: float) -> None:
        self.min_p = torch.tensor([min_p])
        self.min_p_count = int(min_p > 0)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # stands for vLLM's own
        probs = logits.softmax(-1)
        return logits.masked_fill(probs < self.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


@pytest.fixture
def fake_tree(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    ascend = types.ModuleType(sampler.ASCEND_SAMPLER_MODULE)
    exec(ASCEND_SOURCE, ascend.__dict__)
    topk = types.ModuleType("vllm.v1.sample.ops.topk_topp_sampler")
    topk.apply_top_k_top_p = ascend._stock_top_k_top_p
    builtin = types.ModuleType("vllm.v1.sample.logits_processor.builtin")
    builtin.MinPLogitsProcessor = MinPLogitsProcessor
    vllm_sampler = types.ModuleType("vllm.v1.sample.sampler")
    vllm_sampler.Sampler = type("Sampler", (), {"apply_penalties": staticmethod(lambda logits, *_: logits)})
    tree = {m.__name__: m for m in (ascend, topk, builtin, vllm_sampler)}
    for name, module in tree.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(state, "ORIGINALS", {})
    return tree


def _rollout(tree, logits, labels, prompt, temperature, k, p, min_p, kw) -> torch.Tensor:
    """vllm-ascend's V1 sampler step by step, one request, one decode step per row."""
    ascend = tree[sampler.ASCEND_SAMPLER_MODULE]
    topk_topp = ascend.AscendTopKTopPSampler()
    vocab = logits.shape[-1]
    rows = []
    for t in range(logits.shape[0]):
        metadata = SimpleNamespace(
            no_penalties=False,
            prompt_token_ids=torch.tensor([[*prompt, vocab]]),
            presence_penalties=torch.tensor([kw["presence_penalty"]]),
            frequency_penalties=torch.tensor([kw["frequency_penalty"]]),
            repetition_penalties=torch.tensor([kw["repetition_penalty"]]),
        )
        z = ascend.AscendSampler.apply_penalties(
            logits[t : t + 1].to(torch.float32, copy=True), metadata, [labels[:t].tolist()]
        )
        z = z.div_(torch.tensor([[temperature]]))
        z = MinPLogitsProcessor(min_p).apply(z)
        k_t = None if k is None else torch.tensor([k])
        p_t = None if p is None else torch.tensor([p])
        with samepath.batch_invariant():
            rows.append(topk_topp.processed_logprobs(z, k_t, p_t)[0, labels[t]])
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("dtype", "k", "p", "min_p"),
    [(torch.bfloat16, None, 0.9, 0.0), (torch.float16, 7, None, 0.05), (torch.float32, 11, 0.8, 0.02)],
)
def test_edits_equal_processed_logprobs(fake_tree, dtype, k, p, min_p) -> None:
    steps, vocab = 6, 37  # unaligned vocabulary
    g = torch.Generator().manual_seed(int(vocab * 1000 + steps + (k or 0)))
    logits = (torch.randn(steps, vocab, generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, (steps,), generator=g)
    logits[torch.arange(steps), labels] = (logits.float().amax(-1) + 1.0).to(dtype)  # sampled tokens kept
    prompt = [3, 5, 5, 30]
    kw = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.25)
    trainer = samepath.processed_logprobs(
        logits, labels, 0.7, top_k=k, top_p=p, min_p=min_p or None, prompt_token_ids=prompt, **kw
    )
    assert torch.isfinite(trainer).all()
    stock = _rollout(fake_tree, logits, labels, prompt, 0.7, k, p, min_p, kw)
    assert not torch.equal(stock, trainer), "negative control: vllm-ascend's own steps differ"
    patcher = Patcher()
    assert sampler.patch_sampling_edits(patcher)
    try:
        got = _rollout(fake_tree, logits, labels, prompt, 0.7, k, p, min_p, kw)
    finally:
        patcher.restore()
    assert torch.equal(got, trainer)
    assert torch.equal(_rollout(fake_tree, logits, labels, prompt, 0.7, k, p, min_p, kw), stock), "restored"


def test_reduce_sample_is_refused(fake_tree) -> None:
    patcher = Patcher()
    assert sampler.patch_sampling_edits(patcher)
    try:
        apply = fake_tree[sampler.ASCEND_SAMPLER_MODULE].AscendTopKTopPSampler().apply_top_k_top_p
        with pytest.raises(NotImplementedError, match="enable_reduce_sample"):
            apply(torch.zeros(1, 4), None, torch.tensor([0.9]), None)
    finally:
        patcher.restore()


def test_missing_patch_point_patches_nothing(fake_tree, monkeypatch: pytest.MonkeyPatch) -> None:
    ascend = fake_tree[sampler.ASCEND_SAMPLER_MODULE]
    monkeypatch.delattr(ascend, "apply_top_k_top_p")
    stock = ascend.AscendSampler.__dict__["apply_penalties"]
    assert sampler.patch_sampling_edits(Patcher()) is False
    assert ascend.AscendSampler.__dict__["apply_penalties"] is stock and not state.ORIGINALS


@pytest.mark.parametrize("edits", [True, False])
def test_request_refusals_follow_what_is_patched(monkeypatch: pytest.MonkeyPatch, edits: bool) -> None:
    processor = types.ModuleType("vllm.v1.engine.input_processor")
    processor.InputProcessor = type("InputProcessor", (), {"_validate_params": lambda self, params, tasks: None})
    monkeypatch.setitem(sys.modules, processor.__name__, processor)
    monkeypatch.setattr(state, "ORIGINALS", {})
    monkeypatch.setattr(sampler, "INSTALLED", [sampler.EDITS_GROUP] if edits else [])
    patcher = Patcher()
    assert sampler.patch_sampling_refusals(patcher)
    try:
        owner = processor.InputProcessor()
        owner.vllm_config = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="processed_logprobs"))
        base = dict(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, repetition_penalty=1.0)
        edited = SimpleNamespace(**{**base, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.2})
        if edits:
            owner._validate_params(edited, ())
        else:
            with pytest.raises(ValueError, match=r"repetition_penalty=1\.2.*top_p=0\.9.*min_p=0\.1"):
                owner._validate_params(edited, ())
        with pytest.raises(ValueError, match="bad_words"):
            owner._validate_params(SimpleNamespace(**base, bad_words=["x"]), ())
    finally:
        patcher.restore()


@pytest.mark.parametrize("reduce_sample", [None, False, True])
def test_reduce_sample_config_is_refused(monkeypatch: pytest.MonkeyPatch, reduce_sample: bool | None) -> None:
    """0.23's AscendConfig.enable_reduce_sample (vocabulary-sharded logits) refused where the config
    is built; 0.18's config has no such attribute (None here) and passes; restored after."""

    class AscendConfig:
        def __init__(self, vllm_config):
            if reduce_sample is not None:
                self.enable_reduce_sample = reduce_sample

    module = types.ModuleType("vllm_ascend.ascend_config")
    module.AscendConfig = AscendConfig
    monkeypatch.setitem(sys.modules, module.__name__, module)
    patcher = Patcher()
    assert sampler.patch_reduce_sample_refusal(patcher)
    try:
        if reduce_sample:
            with pytest.raises(NotImplementedError, match="enable_reduce_sample"):
                AscendConfig(None)
        else:
            AscendConfig(None)
    finally:
        patcher.restore()
    AscendConfig(None)
