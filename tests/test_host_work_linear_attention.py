"""Host work of the patched Gated DeltaNet layer (Qwen3-Next / Qwen3.5 on Hugging Face), and its torch.compile.

The layers' calls run under the counter of tests/host_counts.py (aten ops, host reads of device values:
``.item()`` / ``int()`` / ``bool()``, data-dependent shapes, ``tolist`` / ``numpy`` / ``cpu``). A ``generate``
decode step reads nothing on the host in any Gated DeltaNet layer and its ops do not grow with the context or
the batch (the slot-indexed cache, no per-row Python); a trainer forward reads once per forward, in the first
layer (the checks and the token and sequence counts, which size the launches), not once per layer (without a
mask too: Hugging Face passes position_ids, which may restart). Negative control: the same counter sees the
per-row reads of the list-based continuation."""

from __future__ import annotations

import pytest
import torch
from host_counts import OpCounter, counting

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations  # noqa: E402
from samepath.kernels.gated_delta import CHUNK, gated_delta_continue  # noqa: E402
from tests.test_family_hybrid_linear_attention import random_prompts, tiny_hybrid  # noqa: E402

C = CHUNK


def two_gdn_layers(model_type: str = "qwen3_next") -> torch.nn.Module:
    """The tiny hybrid (Gated DeltaNet, gated attention) with a second Gated DeltaNet layer after them (a copy
    of the first)."""
    import copy

    model = tiny_hybrid(model_type, torch.float32)
    third = copy.deepcopy(model.model.layers[0])
    third.linear_attn.layer_idx = third.layer_idx = 2
    model.model.layers.append(third)
    model.config.num_hidden_layers = 3
    model.config.layer_types = [*model.config.layer_types, "linear_attention"]
    return model


def per_layer_counts(counter_cls, model: torch.nn.Module, **inputs) -> tuple[list[OpCounter], object]:
    """One counter around each Gated DeltaNet layer's call during ``model(**inputs)``."""
    counters: list[OpCounter] = []

    def enter(module, args):
        counters.append(counter_cls())
        counters[-1].__enter__()

    def leave(module, args, out):
        counters[-1].__exit__(None, None, None)

    layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    handles = [h for m in layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert len(counters) == len(layers)
    return counters, out


def left_padded(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    prompts, width = random_prompts(lengths, seed=seed), max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))


def test_a_decode_step_reads_nothing_on_the_host(monkeypatch) -> None:
    counter = counting(monkeypatch, copies=True)
    model = two_gdn_layers()
    with integrations.patched(model):

        def decode(lengths: list[int]) -> list[OpCounter]:
            inputs = left_padded(lengths, seed=len(lengths))
            with torch.no_grad():
                cache = model(**inputs, use_cache=True).past_key_values
            rows = len(lengths)
            step = dict(
                input_ids=torch.full((rows, 1), 7),
                attention_mask=torch.cat([inputs["attention_mask"], torch.ones(rows, 1, dtype=torch.long)], 1),
                position_ids=inputs["position_ids"][:, -1:] + 1,
                cache=cache,
                use_cache=True,
            )
            return per_layer_counts(counter, model, **step)[0]

        short, long, wide = decode([3, 5]), decode([C + 9, 3 * C + 2]), decode([4, C - 1, C, C + 1])
    for counts in (short, long, wide):
        assert [c.reads for c in counts] == [0, 0], [c.ops for c in counts]
    # the same ops whatever the context (a boundary state plus a partial chunk) or the batch (no per-row work)
    for layer in (0, 1):
        assert short[layer].ops == long[layer].ops == wide[layer].ops, (short[layer].ops, wide[layer].ops)


def test_a_trainer_forward_reads_once_per_forward_not_per_layer(monkeypatch) -> None:
    counter = counting(monkeypatch, copies=True)
    model = two_gdn_layers("qwen3_5_text")
    inputs = left_padded([5, C + 3], seed=3)
    with integrations.patched(model):
        masked, _ = per_layer_counts(counter, model, **inputs, use_cache=False)
        assert [c.reads for c in masked] == [1, 0], [c.ops for c in masked]  # memoised for the second layer
        # without a mask Hugging Face passes position_ids (arange): whether they restart (packed sequences) is
        # the same one read
        full = dict(input_ids=inputs["input_ids"], use_cache=False)
        assert [c.reads for c in per_layer_counts(counter, model, **full)[0]] == [1, 0]
        packed = dict(input_ids=inputs["input_ids"][:1], position_ids=torch.tensor([[0, 1, 2, *range(C)]]))
        assert [c.reads for c in per_layer_counts(counter, model, **packed, use_cache=False)[0]] == [1, 0]


def test_the_counter_sees_the_list_based_continuation(monkeypatch) -> None:
    """Negative control: the per-row continuation (``gated_delta_continue``, a host list of the tails) is counted."""
    counter = counting(monkeypatch, copies=True)
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 3, C + 4])
    q, k = (torch.randn(C + 4, 1, 16, generator=gen) for _ in range(2))
    v, g, beta = torch.randn(C + 4, 2, 16, generator=gen), -torch.rand(C + 4, 2, generator=gen), torch.rand(C + 4, 2)
    _, cache = gated_delta_continue(q, k, v, g, beta, cu)
    step = torch.arange(3)
    with counter() as c:
        gated_delta_continue(q[:2], k[:2], v[:2], g[:2], beta[:2], step, cache)
    assert c.reads >= 2, c.ops


def _compiled_and_eager(model: torch.nn.Module, runner, grads: bool, backend: str = "aot_eager"):
    """``runner(module)``'s output (and the gradients of its square's mean) eagerly, then under
    ``torch.compile(module, backend=backend)``."""
    results = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        with torch.set_grad_enabled(grads):
            out = runner(torch.compile(model, backend=backend) if compiled else model)
            if grads:
                out.float().square().mean().backward()
        results.append([out.detach(), *(p.grad for p in model.parameters() if grads and p.grad is not None)])
    torch._dynamo.reset()
    return results


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_of_a_gated_deltanet_layer_gives_the_eager_bits(backend: str) -> None:
    """The patched Gated DeltaNet layer under ``torch.compile(backend=backend)``: samepath's conv1d, gates,
    chunked delta rule and gated norm are ``torch.library`` custom ops (Dynamo never traces their launchers;
    Inductor calls them as extern kernels) and the packing's host read runs eagerly (a planning call); output and
    gradients equal eager bit for bit, padding included. Negative control: the stock layer differs."""
    model = tiny_hybrid("qwen3_5_text", torch.float32)
    layer = model.model.layers[0].linear_attn
    hidden = torch.randn(2, C + 3, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, C + 3, dtype=torch.long)
    mask[0, :5] = 0
    stock = layer(hidden, attention_mask=mask).detach()
    with integrations.patched(model):
        eager, compiled = _compiled_and_eager(layer, lambda m: m(hidden, attention_mask=mask), True, backend)
    assert len(eager) == len(compiled) == 1 + len(list(layer.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))
    assert not torch.equal(stock[1], eager[0][1])


@pytest.mark.slow  # about 30 s of Dynamo tracing each on the CPU
@pytest.mark.parametrize(
    ("model_type", "backend"),
    [("qwen3_next", "aot_eager"), ("qwen3_5_text", "aot_eager"), ("qwen3_5_text", "inductor")],
)
def test_torch_compile_of_a_tiny_hybrid_model_gives_the_eager_bits(model_type: str, backend: str) -> None:
    """``torch.compile(model, backend=backend)`` of a tiny Qwen3-Next / Qwen3.5 (Qwen3.5 under Inductor too): the
    padded trainer forward equals eager bit for bit; Qwen3.5's gradients too. (Qwen3-Next's are not compared: the
    MoE block's input feeds four consumers, the router, the experts, the shared expert and its gate, and AOT
    autograd sums their gradients in another order than eager autograd does, Hugging Face's glue, not samepath's
    kernels.)
    Negative control: the stock model's logits differ."""
    model = tiny_hybrid(model_type, torch.float32)
    inputs = left_padded([5, C + 3], seed=11)
    with torch.no_grad():
        stock = model(**inputs, use_cache=False).logits
    grads = model_type == "qwen3_5_text"
    with integrations.patched(model):
        eager, compiled = _compiled_and_eager(model, lambda m: m(**inputs, use_cache=False).logits, grads, backend)
    assert len(eager) == len(compiled) > (10 if grads else 0)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))
    assert not torch.equal(stock, eager[0])
