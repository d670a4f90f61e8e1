"""End to end on Hugging Face transformers: generate's log-probs equal the trainer's, bit for bit.

The rollout is transformers' own ``generate`` (KV cache, left padding, greedy or sampled); the
trainer is a plain forward of the finished sequences — right-padded, packed into one row with
restarting ``position_ids`` (as verl sends them), and each sequence alone. Tiny random-weight
models are built from configs (no hub).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.check.harness import DEFAULT_MODEL_CONFIG  # noqa: E402
from samepath.kernels.matmul import batch_invariant_enabled  # noqa: E402


def tiny_model(arch: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    common = {key: value for key, value in DEFAULT_MODEL_CONFIG.items() if key != "head_dim"}
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, **common
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "llama":
        config = transformers.LlamaConfig(head_dim=16, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":  # Mistral v0.2+ / Nemo: no sliding window
        config = transformers.MistralConfig(head_dim=32, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj
        config = transformers.Phi3Config(**common)
        cls = transformers.Phi3ForCausalLM
    elif arch == "mixtral":  # routing weights kept in fp32
        config = transformers.MixtralConfig(
            head_dim=32, sliding_window=None, num_local_experts=4, num_experts_per_tok=2, **common
        )
        cls = transformers.MixtralForCausalLM
    elif arch == "gemma3_text":
        config = gemma3_config(common)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise AssertionError(arch)
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():  # random init of this size gives near-uniform logits; spread them out
        for name, param in model.named_parameters():
            if arch == "gemma3_text" and name.endswith("norm.weight"):  # (1 + w) norms: w starts at 0
                param.copy_(0.5 * torch.randn(param.shape))
            else:
                param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def gemma3_config(common: dict, **overrides):
    """A tiny Gemma 3 text config: a local (sliding, rope base 10^4) and a global (full, rope base
    10^6 with linear scaling) layer, query_pre_attn_scalar != head_dim, GELU-tanh MLP."""
    kwargs = dict(
        head_dim=32,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    )
    return transformers.Gemma3TextConfig(**{**common, **kwargs, **overrides})


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=gen).tolist() for n in lengths]


def rollout(model, prompts, new_tokens: int, temperature: float | None, seed: int = 0):
    """Left-padded ``generate``; returns the generated tokens and their log-probs [B, new_tokens]."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **({"do_sample": False} | sampling),
        )
    generated = out.sequences[:, width:]
    step_logits = torch.stack(out.logits, 1)
    return generated, samepath.logprobs(step_logits, generated, temperature or 1.0)


def _completions(prompts, generated):
    return [torch.tensor(p + g.tolist()) for p, g in zip(prompts, generated, strict=True)]


def trainer_padded(model, prompts, generated, temperature: float, grad: bool = False) -> torch.Tensor:
    """Right-padded batch forward (the rollout used left padding)."""
    seqs = _completions(prompts, generated)
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    n = generated.shape[1]
    rows = []
    for row, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        start = len(prompt) - 1
        rows.append(samepath.logprobs(logits[row, start : start + n], seq[len(prompt) :], temperature))
    return torch.stack(rows)


def trainer_packed(model, prompts, generated, temperature: float, grad: bool = False) -> torch.Tensor:
    """All sequences in one row, position_ids restarting at each, no mask, no cache."""
    seqs = _completions(prompts, generated)
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    n, rows, offset = generated.shape[1], [], 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        start = offset + len(prompt) - 1
        rows.append(samepath.logprobs(logits[start : start + n], seq[len(prompt) :], temperature))
        offset += len(seq)
    return torch.stack(rows)


def trainer_alone(model, prompts, generated, temperature: float) -> torch.Tensor:
    rows = []
    for prompt, seq in zip(prompts, _completions(prompts, generated), strict=True):
        with torch.no_grad():
            logits = model(input_ids=seq[None], use_cache=False).logits[0]
        rows.append(samepath.logprobs(logits[len(prompt) - 1 : -1], seq[len(prompt) :], temperature))
    return torch.stack(rows)


@pytest.fixture
def patched():
    integrations.patch_all()
    yield
    integrations.unpatch_all()


CASES = [
    # arch, dtype, prompt lengths, new tokens, temperature (None = greedy); the CI subset covers
    # fp32 and bf16, greedy and sampled, dense and MoE, batch 1 and 4; -m slow adds the rest.
    pytest.param("qwen3", torch.float32, [5, 11, 3, 8], 6, None, marks=pytest.mark.slow),
    ("qwen3", torch.bfloat16, [7, 2, 9, 4], 6, 0.7),
    pytest.param("qwen3", torch.bfloat16, [6], 8, None, marks=pytest.mark.slow),
    ("qwen3_moe", torch.bfloat16, [4, 9, 6, 2], 5, 1.3),
    ("llama", torch.float32, [3, 10, 5, 7], 5, 0.7),
]


@pytest.mark.parametrize("arch,dtype,lengths,new_tokens,temperature", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_generate_logprobs_equal_trainer_logprobs(patched, arch, dtype, lengths, new_tokens, temperature) -> None:
    model = tiny_model(arch, dtype)
    prompts = random_prompts(lengths, seed=len(lengths) + new_tokens)
    generated, rollout_lp = rollout(model, prompts, new_tokens, temperature)
    t = temperature or 1.0
    assert torch.equal(trainer_padded(model, prompts, generated, t), rollout_lp)
    assert torch.equal(trainer_packed(model, prompts, generated, t), rollout_lp)
    assert torch.equal(trainer_alone(model, prompts, generated, t), rollout_lp)


@pytest.mark.slow
def test_long_generation_crosses_kv_tiles(patched) -> None:
    """70 tokens of context: the rollout's decode steps cross two KV-tile boundaries (tile_n = 32)."""
    model = tiny_model("qwen3", torch.bfloat16, seed=3)
    prompts = random_prompts([12, 5], seed=4)
    generated, rollout_lp = rollout(model, prompts, 58, temperature=0.9)
    assert torch.equal(trainer_packed(model, prompts, generated, 0.9), rollout_lp)
    assert torch.equal(trainer_padded(model, prompts, generated, 0.9), rollout_lp)


def test_medium_generation_crosses_a_kv_tile(patched) -> None:
    model = tiny_model("qwen3", torch.float32, seed=5)
    prompts = random_prompts([30], seed=6)
    generated, rollout_lp = rollout(model, prompts, 6, temperature=None)
    assert torch.equal(trainer_packed(model, prompts, generated, 1.0), rollout_lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_negative_control_a_one_sided_change_is_seen(patched, dtype) -> None:
    """The same harness can fail: a trainer whose layer-1 RMSNorm eps differs from the rollout's
    (0.1 instead of 1e-6: a difference that exists on every machine) gives a nonzero logdiff."""
    model = tiny_model("qwen3", dtype)
    prompts = random_prompts([5, 11, 3, 8], seed=10)
    generated, rollout_lp = rollout(model, prompts, 6, temperature=None)
    trainer = copy.deepcopy(model)
    trainer.model.layers[1].input_layernorm.variance_epsilon = 0.1
    assert not torch.equal(trainer_padded(trainer, prompts, generated, 1.0), rollout_lp)
    assert torch.equal(trainer_padded(model, prompts, generated, 1.0), rollout_lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stock_model_is_close(dtype) -> None:
    """Without patch_all() the same harness runs stock kernels. Whether they part generate from the
    forward in the last bit depends on the machine's BLAS and thread count, so only closeness is
    asserted; samepath's claim is the bit equality above."""
    assert not integrations.enabled()
    model = tiny_model("qwen3", dtype)
    prompts = random_prompts([5, 11, 3, 8], seed=10)
    generated, rollout_lp = rollout(model, prompts, 6, temperature=None)
    trained = trainer_padded(model, prompts, generated, 1.0)
    assert (trained - rollout_lp).abs().max() < (1e-3 if dtype == torch.float32 else 0.5)


def test_training_step_matches_stock_within_tolerance() -> None:
    model = tiny_model("qwen3", torch.float32, seed=7)
    stock = copy.deepcopy(model)
    prompts = random_prompts([6, 9], seed=8)
    generated = torch.randint(1, 320, (2, 5), generator=torch.Generator().manual_seed(9))

    def step(m):
        m.zero_grad()
        loss = -trainer_packed(m, prompts, generated, 0.8, grad=True).mean()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in m.named_parameters()}

    stock_loss, stock_grads = step(stock)
    with integrations.patched():
        loss, grads = step(model)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-3, atol=1e-4, msg=name)


def test_unpatch_all_restores_stock_exactly() -> None:
    model = tiny_model("qwen3", torch.bfloat16, seed=11)
    ids = torch.randint(1, 320, (3, 12), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        integrations.patch_all()
        integrations.patch_all()  # idempotent
        assert integrations.enabled() and batch_invariant_enabled()
        during = model(input_ids=ids).logits
        integrations.unpatch_all()
        integrations.unpatch_all()
        after = model(input_ids=ids).logits
    assert not integrations.enabled()
    assert not torch.equal(before, during)
    assert torch.equal(before, after)


def test_patch_all_with_a_built_model_and_bad_inputs(patched) -> None:
    model = tiny_model("llama", torch.float32)
    integrations.patch_all(model)
    assert model.config._attn_implementation == "samepath"
    ids = torch.randint(1, 320, (2, 6), generator=torch.Generator().manual_seed(1))
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="one contiguous run of real tokens"), torch.no_grad():
        model(input_ids=ids, attention_mask=holes)
    with pytest.raises(ValueError, match="no Hugging Face patches for model_type='gpt2'"):
        from samepath.integrations import hf

        hf.apply_to_model_type("gpt2", hf.Patcher())


def test_unpatch_all_restores_a_model_that_patch_all_switched() -> None:
    """``patch_all(model)`` switches the model's attention implementation; ``unpatch_all`` sets
    back the one it had, so the next forward runs (and equals the stock one)."""
    model = tiny_model("qwen3", torch.float32, seed=13)
    model.set_attn_implementation("eager")
    ids = torch.randint(1, 320, (2, 7), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        integrations.patch_all(model)
        assert model.config._attn_implementation == "samepath"
        integrations.unpatch_all()
        assert model.config._attn_implementation == "eager"
        assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("bad", ["x", torch.nn.Linear(2, 2)], ids=["str", "module_without_config"])
def test_a_failed_patch_all_leaves_nothing_behind(bad) -> None:
    with pytest.raises(ValueError, match="model must be a Hugging Face model"):
        integrations.patch_all(bad)
    assert not integrations.enabled() and not batch_invariant_enabled()


def test_a_patch_all_that_fails_on_the_model_undoes_the_process_patch() -> None:
    model = tiny_model("qwen3", torch.float32)
    model.config.model_type = "not_a_model_type"
    from samepath.audit import UncoveredOpsError

    with pytest.raises(UncoveredOpsError, match="model_type 'not_a_model_type' is not covered"):
        integrations.patch_all(model)
    assert not integrations.enabled() and not batch_invariant_enabled()
    assert model.config._attn_implementation != "samepath"


def test_tensor_parallel_numerics_slices_the_row_parallel_linears():
    """``hf.tensor_parallel_numerics(model, S)``: o_proj and down_proj run ``linear(k_slices=S)``
    (what a TP-S vLLM rollout's row-parallel layers compute), the rest is untouched, and leaving
    the block restores the model; a MoE model's experts are sliced too (tests/test_moe_tensor_parallel.py).
    Bad degrees are refused."""
    from samepath.integrations.hf import tensor_parallel_numerics

    # fp32: at this size a bf16 model's fp32 partial sums are exact, so slicing changes no bit there.
    model = tiny_model("qwen3", torch.float32)
    ids = torch.tensor([random_prompts([13], seed=5)[0]])
    with integrations.patched(), torch.no_grad():
        whole = model(input_ids=ids).logits
        o_proj = model.model.layers[0].self_attn.o_proj
        x = torch.randn(5, o_proj.in_features)
        with tensor_parallel_numerics(model, 2):
            sliced = model(input_ids=ids).logits
            assert torch.equal(o_proj(x), samepath.linear(x, o_proj.weight, o_proj.bias, k_slices=2))
        assert not torch.equal(sliced, whole)  # the slices are part of the numerics
        assert torch.equal(model(input_ids=ids).logits, whole)
        assert "forward" not in vars(o_proj)
    with tensor_parallel_numerics(tiny_model("qwen3_moe", torch.bfloat16), 1):  # S = 1: nothing to slice
        pass
    moe_model = tiny_model("qwen3_moe", torch.bfloat16)
    with tensor_parallel_numerics(moe_model, 2):
        assert all("forward" in vars(layer.mlp.experts) for layer in moe_model.model.layers)
    assert not any("forward" in vars(layer.mlp.experts) for layer in moe_model.model.layers)
    with pytest.raises(ValueError, match="not divisible"):
        with tensor_parallel_numerics(model, 5):
            pass
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        with tensor_parallel_numerics(model, 0):
            pass


FAMILY_CASES = [
    # The families beyond Llama/Qwen: each in fp32 and bf16, left-padded, sampled; -m slow adds fp32.
    ("mistral", torch.bfloat16),
    pytest.param("mistral", torch.float32, marks=pytest.mark.slow),
    ("phi3", torch.bfloat16),
    pytest.param("phi3", torch.float32, marks=pytest.mark.slow),
    pytest.param("mixtral", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("mixtral", torch.float32, marks=pytest.mark.slow),
    ("gemma3_text", torch.bfloat16),
    pytest.param("gemma3_text", torch.float32, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,dtype", FAMILY_CASES, ids=str)
def test_model_family_generate_equals_trainer(arch, dtype) -> None:
    """patch_all(model) accepts the family (audited: every module covered), generate's sampled
    log-probs from a left-padded batch equal the trainer's forward bit for bit, and the negative
    control — the same harness with the trainer's layer-1 norm eps changed, a deliberate one-sided
    difference — reports a mismatch."""
    model = tiny_model(arch, dtype)
    prompts = random_prompts([6, 2, 9], seed=21)
    with integrations.patched(model):
        generated, rollout_lp = rollout(model, prompts, 5, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
        trainer = copy.deepcopy(model)
        norm = trainer.model.layers[1].input_layernorm
        setattr(norm, "eps" if arch == "gemma3_text" else "variance_epsilon", 0.1)
        assert not torch.equal(trainer_padded(trainer, prompts, generated, 0.8), rollout_lp)


def windowed_model(arch: str, window: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Two layers with Hugging Face's sliding-window layers: qwen2 / qwen3 with use_sliding_window
    (the layers from max_window_layers = 1 on: one full, one windowed), mistral, phi3 and mixtral
    with sliding_window (every layer windowed)."""
    common = {key: value for key, value in DEFAULT_MODEL_CONFIG.items() if key != "head_dim"}
    if arch in ("qwen2", "qwen3"):
        config_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
        config = config_cls(head_dim=32, use_sliding_window=True, sliding_window=window, max_window_layers=1, **common)
        assert config.layer_types == ["full_attention", "sliding_attention"]
    elif arch == "mistral":
        config = transformers.MistralConfig(head_dim=32, sliding_window=window, **common)
    elif arch == "phi3":
        config = transformers.Phi3Config(sliding_window=window, **common)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            head_dim=32, sliding_window=window, num_local_experts=4, num_experts_per_tok=2, **common
        )
    else:
        raise AssertionError(arch)
    cls = {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
    }[arch]
    torch.manual_seed(1)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


WINDOW_CASES = [
    ("qwen2", torch.float32),
    pytest.param("qwen2", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("qwen3", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("mistral", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("mistral", torch.float32, marks=pytest.mark.slow),
    pytest.param("phi3", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("phi3", torch.float32, marks=pytest.mark.slow),
    pytest.param("mixtral", torch.bfloat16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,dtype", WINDOW_CASES, ids=str)
def test_sliding_window_generate_past_the_window(arch, dtype, monkeypatch) -> None:
    """generate with Hugging Face's sliding-window cache (window 8) far past the window: left-padded
    prompts of 30, 6 and 26 tokens and 10 sampled new ones, so the cache drops the rows' first
    tokens, rows outgrow the window at different steps (one only during the decode), and the
    windows of the long rows cross the KV tile at position 32 (the CPU table's tile_n). The step
    log-probs equal the trainer's full forward (right-padded, and packed with position_ids) bit for
    bit. Negative control (fp32 qwen2): the same rollout with the kernel told nothing about where
    the cached keys start (tiles anchored at the cache's first key) reports a mismatch."""
    from samepath.integrations import hf
    from samepath.kernels.config import attention_config

    assert attention_config(32, dtype, "cpu").tile_n == 32
    prompts = random_prompts([30, 6, 26], seed=31)
    model = windowed_model(arch, window=8, dtype=dtype)
    with integrations.patched(model):
        generated, rollout_lp = rollout(model, prompts, 10, temperature=0.9)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.9), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.9), rollout_lp)
        if (arch, dtype) != ("qwen2", torch.float32):
            return

        def without_kv_start(*args, kv_start=None, **kwargs):
            return packed_attention(*args, **kwargs)

        packed_attention = hf.packed_attention
        monkeypatch.setattr(hf, "packed_attention", without_kv_start)
        generated, anchored_lp = rollout(model, prompts, 10, temperature=0.9)
        assert not torch.equal(trainer_padded(model, prompts, generated, 0.9), anchored_lp)


def test_window_layout_locates_the_cached_keys() -> None:
    """batch_layout of a windowed decode step (q_len 1) over Hugging Face's sliding-window cache:
    each row's kv_start is its position minus the keys before it; a row that has lost nothing
    gets 0, and no row having lost anything gives kv_start None (the launches of a full cache).
    What it cannot attend over exactly is refused: no position_ids, position_ids contradicting the
    mask, a cache holding fewer keys than the window sees."""
    from samepath.integrations.hf import SlidingWindowCacheError, batch_layout

    window, kv_len = 8, 8  # the cache's 7 tokens + the new one
    mask = torch.ones(3, kv_len, dtype=torch.bool)
    mask[2, :3] = False  # row 2: 5 real keys after 3 padding slots (it has lost nothing)
    positions = torch.tensor([[20], [7], [4]])  # rows 0, 1 hold positions 13..20 and 0..7
    layout = batch_layout(mask, positions, 3, 1, kv_len, torch.device("cpu"), sliding_window=window)
    assert layout.kv_start.tolist() == [0, 13, 0, 0, 0, 0, 0, 0, 0]
    assert layout.kv_start.dtype == torch.int32 and layout.cu_kv.tolist()[:4] == [0, 0, 8, 8]
    within = batch_layout(mask, torch.tensor([[7], [7], [4]]), 3, 1, kv_len, torch.device("cpu"), window)
    assert within.kv_start is None and torch.equal(within.cu_kv, layout.cu_kv)
    unpadded = [batch_layout(None, torch.tensor([[p]]), 1, 1, kv_len, torch.device("cpu"), window) for p in (7, 9)]
    assert unpadded[0].kv_start is None and unpadded[1].kv_start.tolist() == [0, 2, 0]
    with pytest.raises(SlidingWindowCacheError, match="without position_ids"):
        batch_layout(mask, None, 3, 1, kv_len, torch.device("cpu"), sliding_window=window)
    with pytest.raises(ValueError, match=r"row 2's position_ids .* contradict its attention_mask"):
        batch_layout(mask, torch.tensor([[20], [7], [9]]), 3, 1, kv_len, torch.device("cpu"), window)
    with pytest.raises(ValueError, match=r"row 1's position_ids .* contradict"):
        batch_layout(mask, torch.tensor([[20], [3], [4]]), 3, 1, kv_len, torch.device("cpu"), window)
    with pytest.raises(SlidingWindowCacheError, match=r"row 0's KV cache starts at position 13 .* sliding_window=9"):
        batch_layout(mask, positions, 3, 1, kv_len, torch.device("cpu"), sliding_window=9)


def test_window_cache_on_the_ascendc_backend_is_refused(monkeypatch) -> None:
    """The Ascend C attention backend takes no kv_start: a windowed call whose cache has dropped a
    row's first tokens raises SlidingWindowCacheError naming the backend (before any kernel)."""
    from samepath.integrations.hf import SlidingWindowCacheError, attention_forward

    monkeypatch.setenv("SAMEPATH_ATTENTION_BACKEND", "ascendc")
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 1, 32, generator=gen)
    key, value = torch.randn(2, 1, 1, 8, 32, generator=gen)
    module = torch.nn.Module()
    with pytest.raises(SlidingWindowCacheError, match="SAMEPATH_ATTENTION_BACKEND=ascendc"):
        attention_forward(module, query, key, value, None, sliding_window=8, position_ids=torch.tensor([[12]]))


def test_mixtral_routing_keeps_fp32_weights() -> None:
    """What the vLLM side must reproduce for Mixtral: samepath's router with fp32 weights
    (routing_weights_fp32) gives the bits of Hugging Face's Mixtral MoE block; the Qwen-MoE
    routing (weights cast to bf16) — the deliberate one-sided difference — does not."""
    from samepath.integrations.moe import experts_forward, topk_softmax_routing
    from samepath.models.formulas import routing_weights_fp32

    model = tiny_model("mixtral", torch.bfloat16)
    assert routing_weights_fp32(model.config) and not routing_weights_fp32(tiny_model("qwen3", torch.float32).config)
    block = model.model.layers[0].mlp
    hidden = torch.randn(13, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with integrations.patched(model), torch.no_grad():
        expected = block(hidden[None])[0]
        logits = torch.nn.functional.linear(hidden, block.gate.weight)
        experts = block.experts
        outputs = {}
        for dtype in (torch.float32, torch.bfloat16):
            index, weights = topk_softmax_routing(logits, 2, True, dtype)
            outputs[dtype] = experts_forward(hidden, experts.gate_up_proj, experts.down_proj, index, weights)
    assert torch.equal(outputs[torch.float32], expected)
    assert not torch.equal(outputs[torch.bfloat16], expected)


def test_gemma3_stock_trainer_differs_and_each_layer_type_has_its_rope() -> None:
    """Negative controls for Gemma 3: the stock Hugging Face trainer (unpatched: torch's norms,
    GELU, attention and matmuls) on the samepath rollout's sequences reports a difference; and
    the patched trainer with the global layer given the local layer's rope (one rope for every
    layer type, what a model resolving rope once would compute) does too."""
    from samepath.integrations import hf

    model = tiny_model("gemma3_text", torch.bfloat16)
    prompts = random_prompts([6, 2, 9], seed=21)
    with integrations.patched(model):
        generated, rollout_lp = rollout(model, prompts, 5, temperature=0.8)
        one_rope = copy.deepcopy(model)
        local = dict(one_rope.config.rope_parameters["sliding_attention"])
        one_rope.config.rope_parameters = {"sliding_attention": local, "full_attention": dict(local)}
        assert not torch.equal(trainer_padded(one_rope, prompts, generated, 0.8), rollout_lp)
        assert type(model.model.rotary_emb).forward is hf.rotary_embedding_forward
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    assert not integrations.enabled()
    assert not torch.equal(trainer_padded(stock, prompts, generated, 0.8), rollout_lp)
