"""Host work of the patched Hugging Face attention path: no per-token work, no per-layer host reads.

A patched forward runs under a ``TorchDispatchMode`` that counts every aten op and every host read
of a device value (``aten._local_scalar_dense`` — ``.item()``, ``int()``, ``bool()`` — ``is_nonzero``,
``equal``, data-dependent shapes such as ``nonzero``; and ``Tensor.tolist`` / ``numpy``, which do not
dispatch on a CPU tensor and are counted by wrapping them). The counts are a property of the
code path, not of this machine, so they hold on a GPU too: the number of ops does not grow with
the tokens, and the reads per forward are a small constant independent of layers and tokens.
"""

from __future__ import annotations

import pytest
import torch
from host_counts import OpCounter, counting

from samepath.kernels.config import attention_config

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations  # noqa: E402

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    attention_dropout=0.0,
)


@pytest.fixture
def counter(monkeypatch):
    return counting(monkeypatch)


@pytest.fixture
def patched():
    integrations.patch_all()
    yield
    integrations.unpatch_all()


def tiny_qwen3(layers: int) -> torch.nn.Module:
    config = transformers.Qwen3Config(num_hidden_layers=layers, **TINY)
    torch.manual_seed(layers)
    return transformers.Qwen3ForCausalLM(config).eval()


def left_padded(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """Two rows of ``tokens``: the first with a quarter of left padding; positions from 0 at each
    row's first real token (as ``generate`` makes them)."""
    ids = torch.randint(1, TINY["vocab_size"], (2, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[0, : tokens // 4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=positions)


def count_forward(counter_cls, model: torch.nn.Module, **inputs) -> OpCounter:
    with torch.no_grad():
        model(**inputs, use_cache=False)  # warm-up: Triton compiles / caches outside the count
        with counter_cls() as counter:
            model(**inputs, use_cache=False)
    return counter


def test_the_counter_sees_per_token_reads(counter) -> None:
    """Negative control: work that walks the tokens on the host is caught by the same counts."""

    def per_token(n: int) -> OpCounter:
        row = torch.arange(n)
        with counter() as c:
            [i for i in range(1, n) if row[i] != row[i - 1] + 1]
            row.tolist()
        return c

    short, long = per_token(8), per_token(64)
    assert long.reads - short.reads == 56 and long.total - short.total > 100


@pytest.mark.parametrize("short,long", [(16, 64), pytest.param(64, 512, marks=pytest.mark.slow)])
def test_hf_forward_host_work_does_not_grow_with_tokens_or_layers(patched, counter, short, long) -> None:
    model = tiny_qwen3(layers=2)
    small = count_forward(counter, model, **left_padded(short, seed=1))
    large = count_forward(counter, model, **left_padded(long, seed=2))
    assert abs(large.total - small.total) <= 4, (small.ops, large.ops)
    assert large.reads == small.reads <= 2, (small.ops, large.ops)
    deeper = count_forward(counter, tiny_qwen3(layers=4), **left_padded(short, seed=1))
    assert deeper.reads == small.reads, (small.ops, deeper.ops)


def test_hf_packed_training_step_host_work(patched, counter) -> None:
    """Forward and backward of sequences packed with restarting position_ids, no mask: the reads
    stay constant and the ops do not grow with the tokens or the number of sequences."""
    model = tiny_qwen3(layers=2)

    def step(lengths: list[int]) -> OpCounter:
        ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        model.zero_grad()
        model(input_ids=ids, position_ids=positions, use_cache=False).logits.float().square().mean().backward()
        model.zero_grad()
        with counter() as c:
            model(input_ids=ids, position_ids=positions, use_cache=False).logits.float().square().mean().backward()
        return c

    small, large = step([5, 11]), step([20, 9, 33, 2])
    assert abs(large.total - small.total) <= 4, (small.ops, large.ops)
    assert large.reads == small.reads <= 2, (small.ops, large.ops)


def test_hf_decode_step_host_work(patched, counter) -> None:
    """One ``generate``-style decode step (KV cache, left padding, q_len = 1) at two context lengths."""
    model = tiny_qwen3(layers=2)

    def decode(context: int) -> OpCounter:
        inputs = left_padded(context, seed=5)
        with torch.no_grad():
            prefill = model(**inputs, use_cache=True)
            step = dict(
                input_ids=prefill.logits[:, -1].argmax(-1, keepdim=True),
                attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1),
                position_ids=inputs["position_ids"][:, -1:] + 1,
            )
            warm = transformers.DynamicCache(config=model.config)
            model(**inputs, cache=warm, use_cache=True)
            model(**step, cache=warm, use_cache=True)
            with counter() as c:
                model(**step, cache=prefill.cache, use_cache=True)
        return c

    # Both contexts span several KV segments (the CPU table's seg is 64), so both run the split
    # decode (one segment kernel and one merge per layer, however many segments): the count may
    # change once where a single segment runs serially, never with the number of tokens.
    seg = attention_config(TINY["head_dim"], torch.float32, "cpu").seg
    assert seg < 80 < 3 * seg
    small, large = decode(80), decode(3 * seg + 16)
    assert abs(large.total - small.total) <= 4, (small.ops, large.ops)
    assert large.reads == small.reads <= 2, (small.ops, large.ops)


def test_hf_windowed_decode_step_host_work(patched, counter) -> None:
    """A decode step past the window of Hugging Face's sliding-window cache (qwen3, window 8: the
    first layer full, the others windowed): locating the cached keys (kv_start) costs one host
    read per forward for all the windowed layers, not one per layer, and nothing grows with the
    context."""

    def decode(layers: int, context: int) -> OpCounter:
        config = transformers.Qwen3Config(
            num_hidden_layers=layers, use_sliding_window=True, sliding_window=8, max_window_layers=1, **TINY
        )
        torch.manual_seed(layers)
        model = transformers.Qwen3ForCausalLM(config).eval()
        inputs = left_padded(context, seed=6)
        with torch.no_grad():
            prefill = model(**inputs, use_cache=True)
            step = dict(
                input_ids=prefill.logits[:, -1].argmax(-1, keepdim=True),
                attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1),
                position_ids=inputs["position_ids"][:, -1:] + 1,
            )
            warm = transformers.DynamicCache(config=model.config)
            model(**inputs, cache=warm, use_cache=True)
            model(**step, cache=warm, use_cache=True)
            fresh = dict(step, position_ids=step["position_ids"].clone())  # no layout memoised from the warm-up
            with counter() as c:
                model(**fresh, cache=prefill.cache, use_cache=True)
        return c

    # Reads: transformers' own check of each mask type (full, sliding), the full layer's layout and
    # the windowed layers' layout with kv_start: one each per forward, whatever the depth or context.
    # Both contexts give the full layer more than one KV segment (split decode, as in the test above).
    seg = attention_config(TINY["head_dim"], torch.float32, "cpu").seg
    assert 2 * 41 > seg and 2 * 73 < 3 * seg
    small, deeper, longer = decode(2, 40), decode(4, 40), decode(2, 72)
    assert small.reads == deeper.reads == longer.reads <= 4, (small.ops, deeper.ops, longer.ops)
    assert abs(longer.total - small.total) <= 4, (small.ops, longer.ops)


def test_launch_plan_gives_the_same_bits_and_checks_its_tensors() -> None:
    """A :class:`LaunchPlan` shared by several calls changes nothing but where the program maps come
    from: forward and backward bits equal the plan-less calls'. Negative control: the same
    comparison against a different KV tile (``tile_n=16``) finds a difference."""
    import dataclasses

    from samepath.kernels.attention import LaunchPlan, packed_attention, varlen_attention
    from samepath.kernels.config import attention_config

    gen = torch.Generator().manual_seed(21)
    cu = torch.tensor([0, 45, 45, 51, 120], dtype=torch.int32)  # an empty sequence, unaligned lengths
    q = torch.randn(120, 4, 32, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(120, 2, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    plan = LaunchPlan(cu, 120)

    def run(**options):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, cu, **options)
        out.float().square().sum().backward()
        return [out.detach(), *(t.grad for t in leaves)]

    want = run()
    for _ in range(2):  # the second call reuses the plan's maps
        assert all(torch.equal(a, b) for a, b in zip(run(plan=plan, validate=False), want, strict=True))
    tile_16 = dataclasses.replace(attention_config(32, torch.bfloat16, q.device), tile_n=16)
    assert not torch.equal(run(config=tile_16)[0], want[0])

    cu_kv = torch.tensor([0, 50, 52, 60, 130], dtype=torch.int32)
    k_long, v_long = (torch.randn(130, 2, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    packed_plan = LaunchPlan(cu, 120, cu_kv)
    assert torch.equal(
        packed_attention(q, k_long, v_long, cu, cu_kv, 32**-0.5, plan=packed_plan),
        packed_attention(q, k_long, v_long, cu, cu_kv, 32**-0.5),
    )

    with pytest.raises(ValueError, match="plan was built from other"):
        varlen_attention(q, k, v, cu.clone(), plan=plan)
    with pytest.raises(ValueError, match="plan was built from other"):
        packed_attention(q, k_long, v_long, cu, cu_kv, 32**-0.5, plan=plan)
    with pytest.raises(ValueError, match="built for 119 query tokens"):
        varlen_attention(q, k, v, cu, plan=LaunchPlan(cu, 119), validate=False)
    with pytest.raises(ValueError, match="num_tokens"):
        LaunchPlan(cu, -1)
