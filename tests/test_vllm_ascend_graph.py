"""ACL graph mode for samepath's vllm-ascend attention (:mod:`samepath.integrations.vllm_ascend.graph`).

The same sync-counting harness as vLLM's ``test_vllm_decode_step_host_work`` (``tests/host_counts.py``):
a decode step's attention in graph mode — the builder hook filling samepath's fixed-size buffers, then
every layer's kernel on them, as captured — reads nothing from the device, and its aten ops do not grow
with the context; the buffers keep their addresses from step to step; its rows equal the eager path's
and the trainer's.

Faked here (no NPU): the device (CPU tensors; the host copy is pinned only off the CPU), the capture
itself (``torch.npu.NPUGraph``: the forward runs with vllm-ascend's ``_EXTRA_CTX.capturing`` set, as under
``ACLGraphWrapper``, but nothing is recorded or replayed), and vllm-ascend's builder, metadata and forward
context (``SimpleNamespace`` / module stand-ins with 0.23's attribute names).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm_ascend import attention, graph
from samepath.integrations.vllm_ascend.state import ORIGINALS, set_original
from samepath.kernels.attention import varlen_attention

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 64, 16
CAPTURE_SIZE = 4  # the padded batch: 2 real decode tokens, 2 of the dummy padding request


def _builder(max_num_seqs: int = 6, max_blocks: int = 32, mode: str = "NONE", cudagraph: str = "FULL_DECODE_ONLY"):
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=types.SimpleNamespace(enforce_eager=False),
        compilation_config=types.SimpleNamespace(
            mode=types.SimpleNamespace(name=mode), cudagraph_mode=types.SimpleNamespace(name=cudagraph)
        ),
    )
    return types.SimpleNamespace(vllm_config=config, max_num_blocks_per_req=max_blocks)


def _decode_step(context: int, seed: int = 0):
    """Two sequences (``context`` and ``context - 5`` cached tokens, one new each), vllm-ascend's dummy
    padding request after them (2 tokens, seq_lens 1, block-table row 0; its query rows NaN, standing for
    whatever the padded batch holds: no real row may read them), a shuffled paged cache.
    Returns ``(metadata, query, key_cache, value_cache, full (q, k, v) per sequence)``."""
    gen = torch.Generator().manual_seed(seed + context)
    lens = [context + 1, context - 4]
    pages = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(pages) + 1, generator=gen).int()
    table = torch.zeros(3, 32, dtype=torch.int32)
    table[0, : pages[0]], table[1, : pages[1]] = order[: pages[0]], order[pages[0] : sum(pages)]
    kc = torch.zeros(sum(pages) + 1, BLOCK, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    full = []
    for s, n in enumerate(lens):
        q, k, v = (torch.randn(n, h, HEAD_SIZE, generator=gen).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
        for p in range(n):
            kc[table[s, p // BLOCK], p % BLOCK], vc[table[s, p // BLOCK], p % BLOCK] = k[p], v[p]
        full.append((q, k, v))
    padding = torch.full((2, HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
    query = torch.cat([full[0][0][-1:], full[1][0][-1:], padding])
    metadata = types.SimpleNamespace(
        num_actual_tokens=2,
        actual_seq_lengths_q=[1, 2, CAPTURE_SIZE],
        seq_lens_list=[*lens, 1],
        query_start_loc=torch.tensor([0, 1, 2, CAPTURE_SIZE], dtype=torch.int32),
        seq_lens=torch.tensor([*lens, 1], dtype=torch.int32),
        block_tables=table,
        slot_mapping=None,
        num_decodes=2,
        num_decode_tokens=2,
        num_prefills=0,
        attn_state=types.SimpleNamespace(name="DecodeOnly"),
        causal=True,
    )
    return metadata, query, kc, vc, full


def _graph_step(counter_cls, context: int, layers: int, builder=None, width: int = 32):
    """One graph-mode step: the builder hook, then ``layers`` layers' attention as captured (the block table
    ``width`` columns wide). Returns the hook's counter, the layers' counter, the output and the metadata."""
    builder = builder or _builder()
    metadata, query, kc, vc, full = _decode_step(context)
    metadata.block_tables = metadata.block_tables[:, :width]
    warm = types.SimpleNamespace(**vars(metadata))  # a warm-up step of the same layout (Triton's caches)
    graph.attach(builder, warm, None)
    graph.graph_paged_attention(query, kc, vc, warm, HEAD_SIZE**-0.5, torch.zeros_like(query))
    with counter_cls() as fill:
        graph.attach(builder, metadata, None)
    output = torch.full((CAPTURE_SIZE, HEADS, HEAD_SIZE), 7.0, dtype=torch.bfloat16)
    with counter_cls() as layer_ops:
        for _ in range(layers):
            graph.graph_paged_attention(query, kc, vc, metadata, HEAD_SIZE**-0.5, output)
    return fill, layer_ops, output, metadata, (query, kc, vc, full)


@pytest.fixture(autouse=True)
def _fresh_buffers():
    graph.reset()
    yield
    graph.reset()


def test_graph_step_reads_nothing_from_the_device_and_does_not_grow(monkeypatch) -> None:
    """The sync-counting test of vLLM's decode step, on the graph path: no device-to-host reads or copies
    (``.item()``, ``tolist``, ``numpy``, ``.cpu()``, data-dependent shapes) in the builder hook or in any
    layer, and the aten ops do not grow with the context (80 vs 200 cached tokens) — one plan per step,
    not per layer (4 layers cost what 2 do, plus the kernels)."""
    from host_counts import counting

    counter_cls = counting(monkeypatch, copies=True)
    fill_short, short, _, _, _ = _graph_step(counter_cls, context=80, layers=2)
    fill_long, long, _, _, _ = _graph_step(counter_cls, context=200, layers=2)
    _, deep, _, _, _ = _graph_step(counter_cls, context=80, layers=4)
    assert short.reads == long.reads == deep.reads == 0, (short.ops, long.ops, deep.ops)
    assert fill_short.reads == fill_long.reads == 0, fill_short.ops
    assert fill_short.ops == fill_long.ops, (fill_short.ops, fill_long.ops)  # two copies, whatever the context
    assert abs(long.total - short.total) <= 4, (short.ops, long.ops)
    per_layer = deep.total - short.total
    assert per_layer <= short.total, (short.ops, deep.ops)


def test_negative_control_the_eager_path_without_host_lists_reads_the_device(monkeypatch) -> None:
    """The counter sees a read: the eager path, given metadata without its host lists (as vllm-ascend 0.18's
    builder leaves ``actual_seq_lengths_q`` unset), copies ``query_start_loc`` to the host."""
    from host_counts import counting

    counter_cls = counting(monkeypatch, copies=True)
    metadata, query, kc, vc, _ = _decode_step(80)
    metadata.actual_seq_lengths_q = None
    output = torch.zeros(CAPTURE_SIZE, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    attention.paged_attention_from_metadata(query, kc, vc, metadata, HEAD_SIZE**-0.5, output)
    metadata, query, kc, vc, _ = _decode_step(80)
    metadata.actual_seq_lengths_q = None
    with counter_cls() as counter:
        attention.paged_attention_from_metadata(query, kc, vc, metadata, HEAD_SIZE**-0.5, output)
    assert counter.reads > 0, counter.ops


def test_graph_rows_equal_the_eager_path_and_the_trainer_and_buffers_keep_their_addresses(monkeypatch) -> None:
    """Three steps of one builder through the same buffers — different lengths, a narrower block table — and
    the rows of the real requests equal the eager path's and the trainer's (the padding request's NaN query
    rows reach none of them; the rows of no request carry no contract: vllm-ascend drops them)."""
    from host_counts import counting

    counter_cls = counting(monkeypatch)
    builder = _builder()
    addresses = []
    for context, width in ((80, 32), (37, 32), (37, 4)):
        _, _, output, metadata, (query, kc, vc, full) = _graph_step(counter_cls, context, 1, builder, width)
        buffers = getattr(metadata, graph.ATTRIBUTE)
        assert buffers is getattr(builder, graph.BUFFERS)
        addresses.append((buffers.packed.data_ptr(), buffers.block_table.data_ptr(), buffers.block_table.shape))
        assert buffers.query_start_loc.tolist()[:4] == [0, 1, 2, 2]  # the padding request: no tokens, no keys
        assert buffers.seq_lens.tolist()[:3] == [context + 1, context - 4, 0]
        eager = torch.zeros_like(output)
        attention.paged_attention_from_metadata(query, kc, vc, metadata, HEAD_SIZE**-0.5, eager)
        assert torch.equal(output[:2], eager[:2])
        for s, (q, k, v) in enumerate(full):
            cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
            assert torch.equal(output[s], varlen_attention(q, k, v, cu, HEAD_SIZE**-0.5)[-1])
    assert addresses[0] == addresses[1] == addresses[2] == (*addresses[0][:2], (6 + graph.EXTRA_ROWS, 32))
    other = _builder()  # another KV-cache group's builder: its own buffers, not this one's block table
    graph.attach(other, _decode_step(37)[0], None)
    assert getattr(other, graph.BUFFERS).block_table.data_ptr() != addresses[0][1]


def test_graph_inputs_refuse_what_does_not_fit() -> None:
    metadata, query, kc, vc, _ = _decode_step(40)
    small = graph.GraphInputs.allocate(2, 32, torch.device("cpu"), torch.int32)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        small.fill([0, 1, 2, 4], [5, 6, 1], metadata.block_tables)
    narrow = graph.GraphInputs.allocate(8, 4, torch.device("cpu"), torch.int32)
    with pytest.raises(ValueError, match="block_tables"):
        narrow.fill([0, 1, 2], [5, 6], metadata.block_tables)
    bad = types.SimpleNamespace(**vars(metadata))
    bad.seq_lens_list = [0, 1, 1]
    with pytest.raises(ValueError, match="seq_lens"):
        graph.attach(_builder(), bad, None)
    # The buffers are sized from the engine's limits, never from a step: a limit missing, or a step past them.
    with pytest.raises(ValueError, match="2 requests exceed the graph buffers' max_num_seqs = 1"):
        graph.attach(_builder(max_num_seqs=1), types.SimpleNamespace(**vars(metadata)), None)
    no_blocks = _builder()
    del no_blocks.max_num_blocks_per_req
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        graph.attach(no_blocks, types.SimpleNamespace(**vars(metadata)), None)
    no_seqs = _builder()
    del no_seqs.vllm_config.scheduler_config.max_num_seqs
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph.attach(no_seqs, types.SimpleNamespace(**vars(metadata)), None)
    with pytest.raises(ValueError, match="block_tables"):  # wider than max_num_blocks_per_req
        graph.attach(_builder(max_blocks=8), types.SimpleNamespace(**vars(metadata)), None)
    builder = _builder()
    buffers = graph.attach(builder, types.SimpleNamespace(**vars(metadata)), None)
    wide = types.SimpleNamespace(**vars(metadata))
    wide.block_tables = metadata.block_tables.long()
    with pytest.raises(ValueError, match="never reallocated"):
        graph.attach(builder, wide, None)
    assert getattr(builder, graph.BUFFERS) is buffers
    with pytest.raises(RuntimeError, match="carries no graph inputs"):
        graph.graph_paged_attention(query, kc, vc, metadata, 0.125, torch.zeros(CAPTURE_SIZE, HEADS, HEAD_SIZE))


def test_graph_mode_takes_host_copies_and_refuses_device_tensors_by_name() -> None:
    """The graph hook reads host values only: ``seq_lens_cpu`` (vllm-ascend's host copy) when there is no
    ``seq_lens_list``; a device tensor (here on ``meta``) in place of a host value is refused by name, not read
    back (a sync per step). The eager path's device read is the negative control of the counting test above."""
    metadata, _, _, _, _ = _decode_step(40)
    host = types.SimpleNamespace(**vars(metadata))
    host.seq_lens_list = None
    host.seq_lens_cpu = metadata.seq_lens.clone()
    host.seq_lens = metadata.seq_lens.to("meta")
    buffers = graph.attach(_builder(), host, None)
    assert buffers.seq_lens.tolist()[:3] == [41, 36, 0]
    device_lens = types.SimpleNamespace(**vars(host))
    device_lens.seq_lens_cpu = None
    with pytest.raises(ValueError, match=r"attn_metadata.seq_lens is on meta.*host values only"):
        graph.attach(_builder(), device_lens, None)
    device_ends = types.SimpleNamespace(**vars(metadata))
    device_ends.actual_seq_lengths_q = torch.tensor(metadata.actual_seq_lengths_q, device="meta")
    with pytest.raises(ValueError, match=r"attn_metadata.actual_seq_lengths_q is on meta"):
        graph.attach(_builder(), device_ends, None)
    common = types.SimpleNamespace(num_reqs=3, query_start_loc_cpu=metadata.query_start_loc.to("meta"))
    device_ends.actual_seq_lengths_q = None
    with pytest.raises(ValueError, match=r"query_start_loc_cpu is on meta"):
        graph.attach(_builder(), device_ends, common)


@pytest.fixture
def fake_ascend(monkeypatch):
    """The vllm-ascend modules forward_impl imports, with a capture flag and a builder to hook."""
    context = types.ModuleType("vllm_ascend.ascend_forward_context")
    context._EXTRA_CTX = types.SimpleNamespace(capturing=False)
    backend = types.ModuleType("vllm.v1.attention.backend")
    backend.AttentionType = types.SimpleNamespace(DECODER="decoder")
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_forward_context", context)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backend", backend)
    return context._EXTRA_CTX


def _impl(builder):
    impl = types.SimpleNamespace(
        attn_type="decoder", num_heads=HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5, sliding_window=None,
        alibi_slopes=None, sinks=None, logits_soft_cap=None, kv_cache_dtype="auto", key_cache=None, value_cache=None,
        vllm_config=builder.vllm_config,
    )  # fmt: skip
    return impl


def test_forward_impl_in_capture_and_the_builder_hook(fake_ascend) -> None:
    """Through the patched methods: the builder hook (a stand-in ``AscendAttentionMetadataBuilder`` whose
    ``build`` returns vllm-ascend's metadata) fills the buffers in graph mode and not in eager mode;
    ``forward_impl`` under capture runs the graph path (rows equal the eager path's), refuses a step built
    without the hook, and ``update_graph_params`` has nothing to update."""
    builder_config = _builder()
    metadata, query, kc, vc, _ = _decode_step(60)

    class Builder:
        vllm_config = builder_config.vllm_config
        max_num_blocks_per_req = 32

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return types.SimpleNamespace(**vars(metadata))

    class Impl:
        @staticmethod
        def update_graph_params(*args):
            raise AssertionError("vllm-ascend's FIA task update ran")

    patcher = Patcher()
    try:
        set_original(patcher, Builder, "build", graph.make_build(Builder))
        set_original(patcher, Impl, "update_graph_params", staticmethod(graph.update_graph_params))
        Impl.update_graph_params(None, None, CAPTURE_SIZE, None)
        built = Builder().build(0, None)
        assert getattr(built, graph.ATTRIBUTE, None) is not None
        forward = attention.make_forward_impl(Impl, fence=None)
        impl = _impl(builder_config)
        fake_ascend.capturing = True
        out = torch.zeros(CAPTURE_SIZE, HEADS * HEAD_SIZE, dtype=torch.bfloat16)
        forward(impl, query, None, None, (kc, vc), built, out)
        eager = torch.zeros(CAPTURE_SIZE, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
        attention.paged_attention_from_metadata(query, kc, vc, metadata, HEAD_SIZE**-0.5, eager)
        assert torch.equal(out.view(CAPTURE_SIZE, HEADS, HEAD_SIZE)[:2], eager[:2])
        with pytest.raises(RuntimeError, match="carries no graph inputs"):
            forward(impl, query, None, None, (kc, vc), types.SimpleNamespace(**vars(metadata)), out)
        Builder.vllm_config = _builder(cudagraph="NONE").vllm_config
        assert getattr(Builder().build(0, None), graph.ATTRIBUTE, None) is None  # eager engine: no buffers
    finally:
        patcher.restore()
        ORIGINALS.pop((Builder, "build"), None)
        ORIGINALS.pop((Impl, "update_graph_params"), None)


def test_compiled_mode_is_refused_by_name_and_acl_graphs_without_it_are_accepted(fake_ascend) -> None:
    attention.check_attention_supported(_impl(_builder(mode="NONE", cudagraph="FULL_DECODE_ONLY")))
    fake_ascend.capturing = True
    attention.check_attention_supported(_impl(_builder(mode="NONE", cudagraph="FULL")))
    with pytest.raises(NotImplementedError, match=r"torch.compile \(compilation_config.mode=VLLM_COMPILE"):
        attention.check_attention_supported(_impl(_builder(mode="VLLM_COMPILE", cudagraph="PIECEWISE")))
