"""vllm-ascend integration: AscendMetadata → samepath's paged kernel, the version gate, the patches.

What runs on the CPU: a simulated vllm-ascend step — a paged KV cache with vllm-ascend's block
size 128 (and 16), shuffled block tables, a mixed batch with decodes first and chunked
prefills (some with a cached prefix) after them, plus the dummy padding request vllm-ascend
appends — translated by :func:`samepath.integrations.vllm_ascend.paged_inputs` and attended by
:func:`samepath.paged_attention`; every sequence's rows must be ``torch.equal`` to the trainer's
:func:`samepath.varlen_attention` over the whole sequence. Negative controls: a wrong
``seq_lens`` and a decode/prefill order mix-up give different rows. The metadata object is a
``SimpleNamespace`` with AscendMetadata's field names and, when vllm-ascend imports, the real
``AscendMetadata``. The version/API gate and the install/uninstall bookkeeping run against a
fake module tree carrying vllm-ascend 0.23's class and method names; against the real package
they need vllm-ascend (torch_npu, CANN) and are skipped here.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import itertools
import random
import sys
import types
from typing import Any

import pytest
import torch

from samepath.integrations import vllm_ascend
from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache

NEEDS_VLLM_ASCEND = "needs vllm-ascend (torch_npu, CANN)"
HEADS, KV_HEADS, HEAD_SIZE = 2, 1, 64
SCALE = HEAD_SIZE**-0.5


def _vllm_ascend_importable() -> bool:
    if importlib.util.find_spec("torch_npu") is None or importlib.util.find_spec("vllm_ascend") is None:
        return False
    try:
        import vllm_ascend.attention.attention_v1  # noqa: F401
    except Exception:
        return False
    return True


HAVE_VLLM_ASCEND = _vllm_ascend_importable()


class AscendAttentionState(enum.Enum):
    """vllm-ascend 0.23's enum (``vllm_ascend.attention.attention_v1``), for the namespace metadata."""

    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


def _namespace_metadata(state: str, **fields: Any) -> Any:
    return types.SimpleNamespace(attn_state=AscendAttentionState[state], **fields)


def _real_metadata(state: str, **fields: Any) -> Any:
    from vllm_ascend.attention.attention_v1 import AscendAttentionState as RealState
    from vllm_ascend.attention.attention_v1 import AscendMetadata

    return AscendMetadata(attn_state=RealState[state], **fields)


METADATA_KINDS = [
    pytest.param(_namespace_metadata, id="namespace"),
    pytest.param(
        _real_metadata, id="AscendMetadata", marks=pytest.mark.skipif(not HAVE_VLLM_ASCEND, reason=NEEDS_VLLM_ASCEND)
    ),
]


# ----------------------------------------------------------------------------------------------
# A simulated vllm-ascend step
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One engine step over ``seqs`` = [(cached tokens, new tokens)], decodes first."""

    seqs: list[tuple[int, int]]
    num_decodes: int
    q_full: list[torch.Tensor]  # per sequence [length, heads, head_size]
    k_full: list[torch.Tensor]
    v_full: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # a zero row appended for the padding request
    pad: int

    @property
    def lengths(self) -> list[int]:
        return [c + q for c, q in self.seqs]

    def new_rows(self, which: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t[c:] for t, (c, _) in zip(which, self.seqs, strict=True)])

    def slots(self, seq: int, positions: range) -> list[int]:
        block = self.key_cache.shape[1]
        return [int(self.block_tables[seq, p // block]) * block + p % block for p in positions]

    def metadata_fields(self) -> dict[str, Any]:
        q_lens = [q for _, q in self.seqs]
        ends, total = [], 0
        for q in q_lens:
            total += q
            ends.append(total)
        ends.append(total + self.pad)  # the dummy padding request vllm-ascend appends
        seq_lens = [*self.lengths, 1]
        slots = [s for i, (c, q) in enumerate(self.seqs) for s in self.slots(i, range(c, c + q))]
        return dict(
            num_actual_tokens=total,
            num_decode_tokens=sum(q_lens[: self.num_decodes]),
            num_decodes=self.num_decodes,
            num_prefills=len(self.seqs) - self.num_decodes,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens_list=seq_lens,
            actual_seq_lengths_q=ends,
            query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),
            max_query_len=max(q_lens),
            block_tables=self.block_tables,
            slot_mapping=torch.tensor(slots + [-1] * self.pad, dtype=torch.int32),
            causal=True,
        )

    def padded(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        noise = torch.randn(self.pad, *rows.shape[1:], generator=torch.Generator().manual_seed(seed)).to(rows.dtype)
        return torch.cat([rows, noise])


def make_step(
    seed: int, block_size: int, dtype: torch.dtype, decodes: int = 2, prefills: int = 2, pad: int = 3
) -> Step:
    """Random lengths; the cached prefix of each sequence already written to shuffled pages."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # The first decode's context reaches the second page; the new token may open it.
    seqs = [(rng.randint(block_size if i == 0 else 1, block_size + 40), 1) for i in range(decodes)]
    seqs += [(rng.choice([0, rng.randint(1, block_size + 20)]), rng.randint(2, 24)) for _ in range(prefills)]
    pages = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(pages) + 1
    table = torch.zeros(len(seqs) + 1, width, dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]

    def rand(heads: int, length: int) -> torch.Tensor:
        return torch.randn(length, heads, HEAD_SIZE, generator=gen).to(dtype)

    shape = (num_blocks, block_size, KV_HEADS, HEAD_SIZE)
    step = Step(
        seqs=seqs,
        num_decodes=decodes,
        q_full=[rand(HEADS, c + q) for c, q in seqs],
        k_full=[rand(KV_HEADS, c + q) for c, q in seqs],
        v_full=[rand(KV_HEADS, c + q) for c, q in seqs],
        key_cache=torch.randn(shape, generator=gen).to(dtype),  # garbage where nothing was written
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=table,
        pad=pad,
    )
    for i, (c, _) in enumerate(seqs):  # earlier steps' keys and values
        slots = torch.tensor(step.slots(i, range(c)), dtype=torch.int32)
        write_kv_cache(step.k_full[i][:c], step.v_full[i][:c], step.key_cache, step.value_cache, slots)
    return step


def trainer_rows(step: Step) -> list[torch.Tensor]:
    """The trainer's attention (varlen over whole sequences), each sequence's new rows."""
    cu = torch.tensor([0, *itertools.accumulate(step.lengths)], dtype=torch.int32)
    out = varlen_attention(torch.cat(step.q_full), torch.cat(step.k_full), torch.cat(step.v_full), cu, SCALE)
    return [out[int(cu[i]) + c : int(cu[i + 1])] for i, (c, _) in enumerate(step.seqs)]


def rollout(step: Step, metadata: Any) -> torch.Tensor:
    """vllm-ascend's step on samepath: write this step's K/V by the translated slot mapping, then
    the patched ``forward_impl``'s attention over the padded batch."""
    inputs = vllm_ascend.paged_inputs(metadata)
    write_kv_cache(
        step.new_rows(step.k_full), step.new_rows(step.v_full), step.key_cache, step.value_cache, inputs.slot_mapping
    )
    query = step.padded(step.new_rows(step.q_full), seed=7)
    output = torch.full_like(query, float("nan"))
    vllm_ascend.paged_attention_from_metadata(
        query, step.key_cache, step.value_cache, metadata, SCALE, output, validate=True
    )
    return output


def per_sequence(step: Step, output: torch.Tensor) -> list[torch.Tensor]:
    rows, start = [], 0
    for _, q in step.seqs:
        rows.append(output[start : start + q])
        start += q
    return rows


# ----------------------------------------------------------------------------------------------
# Consistency with the trainer
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step128() -> tuple[Step, list[torch.Tensor]]:
    """vllm-ascend's page size, bf16: two decodes (one past a page boundary), two chunked
    prefills (one with a cached prefix); with the trainer's rows (shared by the tests below)."""
    step = make_step(seed=128, block_size=128, dtype=torch.bfloat16)
    return step, trainer_rows(step)


def _assert_equal_to_trainer(step: Step, output: torch.Tensor, want: list[torch.Tensor]) -> None:
    for i, (got, expected) in enumerate(zip(per_sequence(step, output), want, strict=True)):
        assert torch.equal(got, expected), f"sequence {i} {step.seqs[i]} differs from the trainer"


@pytest.mark.parametrize("make_metadata", METADATA_KINDS)
def test_mixed_batch_rows_equal_trainer(make_metadata, step128) -> None:
    step, want = step128
    assert step.seqs[0][0] >= 128, "a decode must read a second page"
    metadata = make_metadata("ChunkedPrefill", **step.metadata_fields())
    inputs = vllm_ascend.paged_inputs(metadata)
    assert inputs.num_seqs == len(step.seqs) and inputs.num_tokens == sum(q for _, q in step.seqs)
    output = rollout(step, metadata)
    _assert_equal_to_trainer(step, output, want)
    assert torch.isnan(output[inputs.num_tokens :]).all(), "padding rows must not be written"


def test_small_pages_fp32_rows_equal_trainer() -> None:
    step = make_step(seed=16, block_size=16, dtype=torch.float32, decodes=3, prefills=2)
    _assert_equal_to_trainer(
        step, rollout(step, _namespace_metadata("ChunkedPrefill", **step.metadata_fields())), trainer_rows(step)
    )


@pytest.mark.parametrize("make_metadata", METADATA_KINDS)
def test_decode_only_and_prefill_no_cache_states(make_metadata) -> None:
    decode = make_step(seed=3, block_size=16, dtype=torch.bfloat16, decodes=3, prefills=0, pad=0)
    output = rollout(decode, make_metadata("DecodeOnly", **decode.metadata_fields()))
    _assert_equal_to_trainer(decode, output, trainer_rows(decode))

    prefill = make_step(seed=4, block_size=16, dtype=torch.bfloat16, decodes=0, prefills=2, pad=2)
    prefill.seqs = [(0, c + q) for c, q in prefill.seqs]  # nothing cached: the whole sequence is new
    output = rollout(prefill, make_metadata("PrefillNoCache", **prefill.metadata_fields()))
    _assert_equal_to_trainer(prefill, output, trainer_rows(prefill))


def test_negative_control_wrong_seq_lens(step128) -> None:
    step, want = step128
    fields = step.metadata_fields()
    fields["seq_lens_list"] = [n + 1 for n in fields["seq_lens_list"]]  # one garbage key too many
    output = rollout(step, _namespace_metadata("ChunkedPrefill", **fields))
    for i, (got, expected) in enumerate(zip(per_sequence(step, output), want, strict=True)):
        assert not torch.equal(got, expected), f"sequence {i}: a wrong seq_lens went unnoticed"


def test_negative_control_decode_prefill_order_mixup(step128) -> None:
    """The metadata lists decodes first, but the query rows arrive prefills first."""
    step, want = step128
    metadata = _namespace_metadata("ChunkedPrefill", **step.metadata_fields())
    inputs = vllm_ascend.paged_inputs(metadata)
    write_kv_cache(
        step.new_rows(step.k_full), step.new_rows(step.v_full), step.key_cache, step.value_cache, inputs.slot_mapping
    )
    rows = [t[c:] for t, (c, _) in zip(step.q_full, step.seqs, strict=True)]
    query = torch.cat([rows[2], rows[3], rows[0], rows[1]])
    output = torch.empty_like(query)
    vllm_ascend.paged_attention_from_metadata(query, step.key_cache, step.value_cache, metadata, SCALE, output)
    assert not any(torch.equal(g, w) for g, w in zip(per_sequence(step, output), want, strict=True))


def test_padding_request_must_be_dropped() -> None:
    """Without dropping vllm-ascend's dummy request (q = pad, seq_lens 1) the kernel refuses it."""
    step = make_step(seed=8, block_size=16, dtype=torch.float32, pad=4)
    fields = step.metadata_fields()
    query = step.padded(step.new_rows(step.q_full), seed=1)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(
            query,
            step.key_cache,
            step.value_cache,
            fields["block_tables"],
            fields["query_start_loc"],
            fields["seq_lens"],
            SCALE,
        )


# ----------------------------------------------------------------------------------------------
# Metadata checks
# ----------------------------------------------------------------------------------------------


def _fields(step: Step) -> dict[str, Any]:
    return step.metadata_fields()


@pytest.fixture(scope="module")
def small_step() -> Step:
    return make_step(seed=9, block_size=16, dtype=torch.float32)


def test_translation_values(small_step: Step) -> None:
    fields = _fields(small_step)
    inputs = vllm_ascend.paged_inputs(_namespace_metadata("ChunkedPrefill", **fields))
    n = len(small_step.seqs)
    assert inputs.query_start_loc.tolist() == [0, *fields["actual_seq_lengths_q"][:n]]
    assert inputs.seq_lens.tolist() == small_step.lengths
    assert inputs.query_start_loc.dtype == inputs.seq_lens.dtype == torch.int32
    assert torch.equal(inputs.block_table, small_step.block_tables[:n])
    assert torch.equal(inputs.slot_mapping, fields["slot_mapping"][: inputs.num_tokens])
    # Tensors instead of host lists give the same translation.
    fields.update(actual_seq_lengths_q=None, seq_lens_list=None)
    again = vllm_ascend.paged_inputs(_namespace_metadata("ChunkedPrefill", **fields))
    assert torch.equal(again.query_start_loc, inputs.query_start_loc) and torch.equal(again.seq_lens, inputs.seq_lens)


@pytest.mark.parametrize(
    ("state", "change", "message"),
    [
        ("ChunkedPrefill", {"num_decode_tokens": 5}, "decodes must come first"),
        ("DecodeOnly", {}, "DecodeOnly"),
        ("PrefillNoCache", {}, "PrefillNoCache"),
        ("ChunkedPrefill", {"num_actual_tokens": 3}, "num_actual_tokens"),
        ("ChunkedPrefill", {"seq_lens_list": [1, 1, 1, 1, 1]}, r"seq_lens\[\d\]"),
        ("ChunkedPrefill", {"block_tables": torch.zeros(2, 4, dtype=torch.int32)}, "block_tables"),
        ("ChunkedPrefill", {"actual_seq_lengths_q": [3, 2, 9]}, "non-decreasing"),
        ("ChunkedPrefill", {"causal": torch.tensor([True])}, "causal"),
    ],
)
def test_inconsistent_metadata_is_refused(small_step: Step, state: str, change: dict, message: str) -> None:
    fields = {**_fields(small_step), **change}
    with pytest.raises(ValueError, match=message):
        vllm_ascend.paged_inputs(_namespace_metadata(state, **fields))


# ----------------------------------------------------------------------------------------------
# Version / API gate and install bookkeeping, on a fake module tree with vllm-ascend 0.23's names
# ----------------------------------------------------------------------------------------------


def _fake_tree(drop: str | None = None) -> dict[str, types.ModuleType]:
    """One module per :data:`REQUIRED_API` entry, each class with the listed methods (recorded
    originals are plain functions), AscendMetadata a dataclass with the real field names."""
    modules: dict[str, types.ModuleType] = {}
    for module_name, paths in vllm_ascend.REQUIRED_API.items():
        module = types.ModuleType(module_name)
        for path in paths:
            if f"{module_name}.{path}" == drop:
                continue
            owner_name, _, attr = path.partition(".")
            owner = getattr(module, owner_name, None)
            if owner is None:
                owner = type(owner_name, (), {"__module__": module_name})
                setattr(module, owner_name, owner)
            if attr:
                setattr(owner, attr, lambda *args, **kwargs: "stock")
        modules[module_name] = module
    fused = modules["vllm_ascend.ops.fused_moe.fused_moe"]  # derives from vLLM's UnquantizedFusedMoEMethod
    own = {k: v for k, v in vars(fused.AscendUnquantizedFusedMoEMethod).items() if not k.startswith("__")}
    base = type("UnquantizedFusedMoEMethod", (), {"process_weights_after_loading": lambda self, layer: None})
    fused.AscendUnquantizedFusedMoEMethod = type("AscendUnquantizedFusedMoEMethod", (base,), own)
    attention = modules["vllm_ascend.attention.attention_v1"]
    fields = [name for name in vllm_ascend.METADATA_FIELDS if f"AscendMetadata.{name}" != drop]
    attention.AscendMetadata = dataclasses.make_dataclass("AscendMetadata", [(n, Any, None) for n in fields])
    attention.AscendAttentionState = AscendAttentionState
    attention.fences = []
    attention.record_attention_compute_start = lambda: attention.fences.append(1)
    modules["vllm_ascend.ascend_forward_context"]._EXTRA_CTX = types.SimpleNamespace(capturing=False)
    prefetched: list[torch.Tensor] = []
    prefetch = types.SimpleNamespace(maybe_prefetch_mlp_weight_postprocess=prefetched.append, calls=prefetched)
    modules["vllm_ascend.utils"].get_weight_prefetch_method = lambda: prefetch
    backend = types.ModuleType("vllm.v1.attention.backend")
    backend.AttentionType = types.SimpleNamespace(DECODER="decoder")
    modules["vllm.v1.attention.backend"] = backend
    return modules


def test_version_gate() -> None:
    tree = _fake_tree()
    vllm_ascend.check_compatibility("0.23.0.post1", tree.__getitem__)
    vllm_ascend.check_compatibility("0.23.1rc1", tree.__getitem__)
    for version in (None, "0.22.1rc1", "0.25.1rc1", "1.23.0", "main"):
        with pytest.raises(vllm_ascend.UnsupportedVllmAscendError, match="vllm-ascend"):
            vllm_ascend.check_compatibility(version, tree.__getitem__)


@pytest.mark.parametrize(
    "drop",
    [
        "vllm_ascend.ops.layernorm.AscendRMSNorm.forward_oot",
        "vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl.forward_impl",
        "vllm_ascend.attention.attention_v1.AscendMetadata.actual_seq_lengths_q",
        "vllm_ascend.ops.fused_moe.fused_moe.AscendUnquantizedFusedMoEMethod.apply",
    ],
)
def test_missing_api_is_named(drop: str) -> None:
    tree = _fake_tree(drop=drop.replace("vllm_ascend.attention.attention_v1.AscendMetadata.", "AscendMetadata."))
    with pytest.raises(vllm_ascend.UnsupportedVllmAscendError, match=drop.rsplit(".", 1)[-1]):
        vllm_ascend.check_compatibility("0.23.0", tree.__getitem__)


def test_missing_module_and_v2_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _fake_tree()
    del tree["vllm_ascend.ops.activation"]

    def importer(name: str) -> types.ModuleType:
        if name not in tree:
            raise ImportError(f"No module named {name!r}")
        return tree[name]

    with pytest.raises(vllm_ascend.UnsupportedVllmAscendError, match=r"vllm_ascend\.ops\.activation"):
        vllm_ascend.check_compatibility("0.23.0", importer)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(vllm_ascend.UnsupportedVllmAscendError, match="VLLM_USE_V2_MODEL_RUNNER"):
        vllm_ascend.check_compatibility("0.23.0", _fake_tree().__getitem__)


@pytest.mark.parametrize("value", ["1", " 1", "2"])
def test_engine_batch_invariant_mode_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """vllm-ascend's VLLM_BATCH_INVARIANT registers aten::mm / sum / softmax itself: refused, named."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
    with pytest.raises(vllm_ascend.UnsupportedVllmAscendError, match=r"VLLM_BATCH_INVARIANT.*unset"):
        vllm_ascend.check_compatibility("0.23.0", _fake_tree().__getitem__)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    vllm_ascend.check_compatibility("0.23.0", _fake_tree().__getitem__)


@pytest.fixture
def fake_vllm_ascend(monkeypatch: pytest.MonkeyPatch):
    if HAVE_VLLM_ASCEND or importlib.util.find_spec("vllm") is not None:
        pytest.skip("the fake module tree would shadow the installed vLLM / vllm-ascend")
    tree = _fake_tree()
    processor = types.ModuleType("vllm.v1.engine.input_processor")
    processor.InputProcessor = type(
        "InputProcessor", (), {"_validate_params": lambda self, params, supported_tasks: None}
    )
    tree[processor.__name__] = processor
    for name, module in tree.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv(vllm_ascend.FINGERPRINT_ENV_VAR, raising=False)
    yield tree
    vllm_ascend.uninstall()


def _attributes(tree: dict[str, types.ModuleType]) -> dict[str, Any]:
    out = {}
    for module_name, paths in vllm_ascend.REQUIRED_API.items():
        for path in paths:
            owner_name, _, attr = path.partition(".")
            if attr and isinstance(getattr(tree[module_name], owner_name), type):
                out[f"{module_name}.{path}"] = vars(getattr(tree[module_name], owner_name)).get(attr)
    return out


def test_install_uninstall_fake_tree(fake_vllm_ascend, step128, monkeypatch: pytest.MonkeyPatch) -> None:
    stock = _attributes(fake_vllm_ascend)
    monkeypatch.setattr(vllm_ascend.plugin, "installed_version", lambda: "0.22.0")
    with pytest.raises(vllm_ascend.UnsupportedVllmAscendError):
        vllm_ascend.install()
    assert not vllm_ascend.installed() and _attributes(fake_vllm_ascend) == stock, "a refused install patched"

    monkeypatch.setattr(vllm_ascend.plugin, "installed_version", lambda: "0.23.0")
    vllm_ascend.install()
    vllm_ascend.install()
    assert vllm_ascend.installed()
    assert vllm_ascend.INSTALLED == [
        "attention", "rms_norm", "rotary", "silu_mul", "linear", "moe", "sampler_logprobs", "sampling_refusals"
    ]  # fmt: skip
    # vllm-ascend's own top-p kernel is not samepath's: a processed-logprobs request with top_p is refused
    processor = fake_vllm_ascend["vllm.v1.engine.input_processor"].InputProcessor()
    processor.vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(logprobs_mode="processed_logprobs", logits_processors=None),
        speculative_config=None,
        use_v2_model_runner=False,
    )
    request = types.SimpleNamespace(top_p=0.9, top_k=0, min_p=0.0, min_tokens=0)
    with pytest.raises(ValueError, match=r"top_p=0.9"):
        processor._validate_params(request, ())
    processor.vllm_config.model_config.logprobs_mode = "raw_logprobs"
    processor._validate_params(request, ())
    patched = _attributes(fake_vllm_ascend)
    changed = {name for name in stock if patched[name] is not stock[name]}
    assert {
        "vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl.forward_impl",
        "vllm_ascend.ops.layernorm.AscendRMSNorm.forward_oot",
        "vllm_ascend.ops.activation.AscendSiluAndMul.forward_oot",
        "vllm_ascend.ops.rotary_embedding.AscendRotaryEmbedding.forward_oot",
        "vllm_ascend.ops.linear.AscendUnquantizedLinearMethod.apply",
        "vllm_ascend.ops.fused_moe.fused_moe.AscendUnquantizedFusedMoEMethod.apply",
        "vllm.v1.sample.sampler.Sampler.compute_logprobs",
    } <= changed
    assert "vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl.reshape_and_cache" not in changed

    # The patched forward_impl on a vllm-ascend-shaped impl: caches from kv_cache, output rows.
    step, want = step128
    fields = step.metadata_fields()
    write_kv_cache(
        step.new_rows(step.k_full),
        step.new_rows(step.v_full),
        step.key_cache,
        step.value_cache,
        fields["slot_mapping"][: fields["num_actual_tokens"]],
    )
    impl_cls = fake_vllm_ascend["vllm_ascend.attention.attention_v1"].AscendAttentionBackendImpl
    impl = impl_cls()
    impl.__dict__.update(
        attn_type="decoder", num_heads=HEADS, head_size=HEAD_SIZE, scale=SCALE, sliding_window=None,
        alibi_slopes=None, sinks=None, kv_cache_dtype="auto", key_cache=None, value_cache=None,
    )  # fmt: skip
    query = step.padded(step.new_rows(step.q_full), seed=2)
    output = torch.zeros_like(query)
    impl.forward_impl(
        query, None, None, (step.key_cache, step.value_cache), _namespace_metadata("ChunkedPrefill", **fields), output
    )
    _assert_equal_to_trainer(step, output, want)
    assert fake_vllm_ascend["vllm_ascend.attention.attention_v1"].fences == [1], "the KV-pool fence must be kept"
    impl.logits_soft_cap = 50.0  # Gemma 2's attention soft-capping: not this integration's, refused by name
    with pytest.raises(NotImplementedError, match="logits soft-capping"):
        impl.forward_impl(query, None, None, (step.key_cache, step.value_cache), None, output)
    impl.logits_soft_cap = None
    impl.sinks = torch.zeros(HEADS)
    with pytest.raises(NotImplementedError, match="sinks"):
        impl.forward_impl(query, None, None, (step.key_cache, step.value_cache), None, output)

    vllm_ascend.uninstall()
    vllm_ascend.uninstall()
    assert not vllm_ascend.installed() and vllm_ascend.INSTALLED == []
    assert _attributes(fake_vllm_ascend) == stock


@pytest.mark.skipif(not HAVE_VLLM_ASCEND, reason=NEEDS_VLLM_ASCEND)
def test_install_uninstall_real_package() -> None:
    from vllm.v1.sample.sampler import Sampler
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl
    from vllm_ascend.ops.activation import AscendSiluAndMul
    from vllm_ascend.ops.layernorm import AscendRMSNorm

    stock = (
        vars(AscendAttentionBackendImpl)["forward_impl"],
        vars(AscendRMSNorm)["forward_oot"],
        vars(AscendSiluAndMul)["forward_oot"],
        vars(Sampler)["compute_logprobs"],
    )
    try:
        vllm_ascend.install()
        vllm_ascend.install()
        assert vllm_ascend.installed()
        assert vars(AscendAttentionBackendImpl)["forward_impl"] is not stock[0]
        assert vars(AscendRMSNorm)["forward_oot"] is not stock[1]
        assert "model_audit" in vllm_ascend.INSTALLED, "the load-time audit must wrap vLLM's model loaders"
    finally:
        vllm_ascend.uninstall()
        vllm_ascend.uninstall()
    assert (
        vars(AscendAttentionBackendImpl)["forward_impl"],
        vars(AscendRMSNorm)["forward_oot"],
        vars(AscendSiluAndMul)["forward_oot"],
        vars(Sampler)["compute_logprobs"],
    ) == stock


def test_patched_ops_fake_tree(fake_vllm_ascend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op patches' wiring: samepath's kernels on plain layers, vllm-ascend's op otherwise."""
    import samepath

    monkeypatch.setattr(vllm_ascend.plugin, "installed_version", lambda: "0.23.0")
    vllm_ascend.install()
    tree = fake_vllm_ascend
    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(5, 96, generator=gen).to(torch.bfloat16) for _ in range(2))

    norm = tree["vllm_ascend.ops.layernorm"].AscendRMSNorm()
    norm.__dict__.update(weight=torch.randn(96, generator=gen).to(torch.bfloat16), variance_epsilon=1e-6, bias=None)
    y, s = norm.forward_oot(x, residual)
    want_y, want_s = samepath.rms_norm(x, norm.weight, 1e-6, residual=residual)
    assert torch.equal(s, want_s) and torch.equal(y, want_y)
    assert torch.equal(s, x + residual), "the residual sum is rounded once, in the model dtype"
    assert torch.equal(norm.forward_oot(x), samepath.rms_norm(x, norm.weight, 1e-6))
    prefetched = tree["vllm_ascend.utils"].get_weight_prefetch_method().calls
    assert len(prefetched) == 1 and prefetched[0] is not x, "the norm without residual keeps the prefetch step"
    norm.bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"norm bias.*SAMEPATH_ALLOW_UNCOVERED"):
        norm.forward_oot(x, residual)
    monkeypatch.setenv("SAMEPATH_ALLOW_UNCOVERED", "rms_norm")
    assert norm.forward_oot(x, residual) == "stock", "opted out: vllm-ascend's op runs"
    monkeypatch.delenv("SAMEPATH_ALLOW_UNCOVERED")

    act = tree["vllm_ascend.ops.activation"].AscendSiluAndMul()
    assert torch.equal(act.forward_oot(x), samepath.swiglu(x))

    rope = tree["vllm_ascend.ops.rotary_embedding"].AscendRotaryEmbedding()
    rope.__dict__.update(is_neox_style=True, rotary_dim=32, base=10000.0, head_size=32, use_mtp=False)
    positions = torch.tensor([0, 7, 130, 3, 4])
    q, k = (torch.randn(5, n * 32, generator=gen).to(torch.bfloat16) for n in (HEADS, KV_HEADS))
    got_q, got_k = rope.forward_oot(positions, q, k)
    cos, sin = samepath.rotary_cos_sin(positions, 32, 10000.0, torch.bfloat16)
    want_q, want_k = samepath.apply_rotary(q.view(5, HEADS, 32), k.view(5, KV_HEADS, 32), cos, sin, unsqueeze_dim=1)
    assert torch.equal(got_q, want_q.view(5, -1)) and torch.equal(got_k, want_k.view(5, -1))
    with pytest.raises(NotImplementedError, match="GPT-J"):  # refused, not left on vllm-ascend's formula
        rope.forward_oot(positions, q, k, is_neox_style_override=False)
    rope.use_mtp = True  # the MTP draft layers keep vllm-ascend's op
    assert rope.forward_oot(positions, q, k) == "stock"

    method = tree["vllm_ascend.ops.linear"].AscendUnquantizedLinearMethod()
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(48, 96, generator=gen).to(torch.bfloat16), requires_grad=False)
    assert method.apply(layer, x) == "stock", "a layer loaded before install keeps vllm-ascend's gemm"
    layer.samepath_linear = True
    assert torch.equal(method.apply(layer, x), samepath.linear(x, layer.weight))

    sampler = tree["vllm.v1.sample.sampler"].Sampler
    logits = torch.randn(3, 1000, generator=gen)
    assert torch.equal(sampler.compute_logprobs(logits), samepath.log_softmax(logits))


def test_vllm_install_refuses_engine_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM plugin refuses vLLM's own VLLM_BATCH_INVARIANT too, before patching anything."""
    from samepath.integrations import vllm as vllm_plugin
    from samepath.integrations.vllm import env as vllm_env

    if vllm_plugin.installed():
        pytest.skip("samepath's vLLM plugin is already installed in this process")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(vllm_env.EngineBatchInvariantModeError, match="vLLM's own batch-invariant mode"):
        vllm_plugin.install()
    assert not vllm_plugin.installed() and not vllm_plugin.INSTALLED


# ----------------------------------------------------------------------------------------------
# MoE at tensor / expert parallelism on vllm-ascend (wiring on the fake tree; the rollout needs an NPU)
# ----------------------------------------------------------------------------------------------


class MoECommType(enum.Enum):
    """vllm-ascend 0.23's ``vllm_ascend.ascend_forward_context.MoECommType``."""

    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    FUSED_MC2 = 3


def test_ascend_moe_parallel_wiring_fake_tree(fake_vllm_ascend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed, samepath makes vllm-ascend pick the ALLGATHER MoE communication (every token on
    every TP rank: samepath's exchange replaces MC2 / all-to-all dispatch), refuses a TP / EP layer
    under any other communication or flash-comm by name, and refuses at load a layout its formulas
    cannot reproduce; uninstalled, vllm-ascend's selection is back."""
    from samepath.integrations.vllm_ascend.layers import check_allgather_comm

    context = fake_vllm_ascend["vllm_ascend.ascend_forward_context"]
    stock = lambda num_tokens, vllm_config, is_draft_model=False: None if num_tokens == 0 else MoECommType.MC2  # noqa: E731
    monkeypatch.setattr(context, "MoECommType", MoECommType)
    monkeypatch.setattr(context, "select_moe_comm_method", stock)
    monkeypatch.setattr(vllm_ascend.plugin, "installed_version", lambda: "0.23.0")
    vllm_ascend.install()
    try:
        assert context.select_moe_comm_method(64, None) is MoECommType.ALLGATHER
        assert context.select_moe_comm_method(0, None) is None, "a dense model keeps no MoE communication"
        layer = types.SimpleNamespace(layer_name="model.layers.3.mlp.experts")
        context._EXTRA_CTX = types.SimpleNamespace(moe_comm_type=MoECommType.ALLGATHER, flash_comm_v1_enabled=False)
        check_allgather_comm(layer)
        for comm in (MoECommType.MC2, MoECommType.ALLTOALL, MoECommType.FUSED_MC2):
            context._EXTRA_CTX.moe_comm_type = comm
            with pytest.raises(NotImplementedError, match=rf"model\.layers\.3\.mlp\.experts.*not {comm}"):
                check_allgather_comm(layer)
        context._EXTRA_CTX = types.SimpleNamespace(moe_comm_type=MoECommType.ALLGATHER, flash_comm_v1_enabled=True)
        with pytest.raises(NotImplementedError, match="flash-comm v1"):
            check_allgather_comm(layer)

        method_cls = fake_vllm_ascend["vllm_ascend.ops.fused_moe.fused_moe"].AscendUnquantizedFusedMoEMethod
        method = method_cls()
        method.moe, method.dynamic_eplb = types.SimpleNamespace(has_bias=False, is_act_and_mul=True), False
        parallel = dict(dp_size=1, pcp_size=1, is_sequence_parallel=False, enable_eplb=False, use_ep=True)
        moe = types.SimpleNamespace(
            num_experts=6,
            num_logical_experts=6,
            intermediate_size=32,
            moe_parallel_config=types.SimpleNamespace(**parallel, ep_size=4, ep_rank=0, tp_size=1),
        )
        experts = types.SimpleNamespace(
            layer_name="model.layers.3.mlp.experts", activation="silu", apply_router_weight_on_input=False,
            moe_config=moe, w13_weight=torch.empty(2, 64, 8, dtype=torch.bfloat16), w2_weight=torch.empty(2, 8, 32),
            _expert_map=torch.tensor([0, 1, -1, -1, -1, -1]),
        )  # fmt: skip
        with pytest.raises(NotImplementedError, match=r"6 experts are not divisible by the expert-parallel size 4"):
            method.process_weights_after_loading(experts)
        moe.num_experts = moe.num_logical_experts = 8
        experts._expert_map = torch.tensor([-1, -1, 0, 1, -1, -1, -1, -1])  # rank 0 given experts 2, 3
        with pytest.raises(NotImplementedError, match=r"rank 0's expert map is not the contiguous block"):
            method.process_weights_after_loading(experts)
    finally:
        vllm_ascend.uninstall()
    assert context.select_moe_comm_method is stock


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_ascend_all_reduce_carries_rank_zeros_bits_in_any_order(dtype: torch.dtype) -> None:
    """vllm-ascend all-reduces the routed output over the TP group after samepath's exchange has put
    the whole layer on every rank: rank 0 hands in its bits, the others -0.0, and any order or
    accumulation precision of that sum returns rank 0's bits (+0.0 and -0.0 included). Negative
    control: +0.0 from the other ranks turns rank 0's -0.0 into +0.0."""
    from samepath.integrations.vllm_ascend.layers import for_the_all_reduce

    out = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    out[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")], dtype=dtype)
    shares = [for_the_all_reduce(out, rank) for rank in range(4)]
    assert torch.equal(shares[0], out) and all(
        torch.equal(s.view(torch.uint8), shares[1].view(torch.uint8)) for s in shares[1:]
    )
    for order in itertools.permutations(range(4)):
        for acc in (dtype, torch.float32):
            total = shares[order[0]].to(acc)
            for rank in order[1:]:
                total = total + shares[rank].to(acc)
            assert torch.equal(total.to(dtype).view(torch.uint8), out.view(torch.uint8)), (order, acc)
    plus = out + torch.zeros_like(out)
    assert not torch.equal(plus.view(torch.uint8), out.view(torch.uint8))
