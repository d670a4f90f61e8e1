"""Paged decode costs what the context costs, not what the block table's width costs.

vLLM passes a block table as wide as ``max_model_len``. The split schedule's work list
(:func:`samepath.kernels.attention.plan.segment_work`, built on the device) holds only the
segments that hold a sequence's keys, the persistent grid has a fixed, device-sized number of
programs and the merge folds each row's own segments: a table 64x wider than the context runs the
same launches, the same work items and gives the same bits. Counted by wrapping the kernels'
CPU replays (the launch grid and the kernel's own work count, read from its arguments).
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_harness import lengths_to_cu, make_batch

from samepath.kernels import dispatch
from samepath.kernels.attention import LaunchPlan, paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.attention import batch as attention_batch
from samepath.kernels.attention import plan as attention_plan

FORWARD = "samepath.kernels.attention.forward._attention_fwd_kernel"
MERGE = "samepath.kernels.attention.merge._attention_merge_kernel"
PAGE = 16
WIDER = 64


def _work_items(p: dict) -> int:
    """The forward kernel's work count, as it computes it from its arguments."""
    per_block = p["num_kv_heads"] * p["NUM_CHUNKS"]
    mapped = p["num_programs_mapped"]
    if p["SPLIT"]:
        return int(p["segment_work"][mapped - 1]) * per_block
    return min(int(p["num_blocks"][0]), mapped) * per_block


@pytest.fixture
def launches(monkeypatch):
    """Records ``(kernel, programs, work items)`` of every attention forward and merge launch."""
    dispatch.replay_for("")
    record: list[tuple[str, int, int]] = []
    for key in (FORWARD, MERGE):
        original = dispatch._replays[key]

        def wrapped(grid, _original=original, _key=key, **p):
            work = _work_items(p) if _key == FORWARD else -(-p["num_rows"] // p["BLOCK_R"])
            record.append((_key.rsplit(".", 1)[1], grid[0] * grid[1] * grid[2], work))
            return _original(grid, **p)

        monkeypatch.setitem(dispatch._replays, key, wrapped)
    return record


def _decode_case(lens: list[int], dtype: torch.dtype, seed: int, heads: int = 4, kv_heads: int = 2):
    """Sequences ``lens`` written to a paged cache with shuffled pages; the decode step's query
    (each sequence's last token), a tight and a 64x wider block table (its extra columns hold
    page ids inside the cache, which must not be read), and the trainer's rows to compare with."""
    batch = make_batch(lens, heads, kv_heads, 64, dtype, seed=seed)
    rng = random.Random(seed)
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages) + 2
    order = list(range(num_pages))
    rng.shuffle(order)
    tight = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(pages):
        tight[seq, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    wide = torch.randint(0, num_pages, (len(lens), tight.shape[1] * WIDER), dtype=torch.int32)
    wide[:, : tight.shape[1]] = tight
    kc = torch.full((num_pages, PAGE, kv_heads, 64), float("nan"), dtype=dtype)
    vc = kc.clone()
    slots = torch.cat([tight[s, torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE for s, n in enumerate(lens)])
    write_kv_cache(batch.key, batch.value, kc, vc, slots)
    last = torch.tensor([start + n - 1 for start, n in zip(batch.starts(), lens, strict=True)])
    with torch.no_grad():
        trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)[last]
    query = batch.query[last].contiguous()
    qsl = lengths_to_cu([1] * len(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return query, kc, vc, tight, wide, qsl, seq_lens, trained


def _decode(query, kc, vc, table, qsl, seq_lens, **kwargs) -> torch.Tensor:
    """One decode step's attention as vLLM's integration calls it: a plan, no per-step validation."""
    plan = LaunchPlan(qsl, query.shape[0])
    return paged_attention(query, kc, vc, table, qsl, seq_lens, 64**-0.5, validate=False, plan=plan, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wide_table_runs_the_same_programs_and_bits(launches, dtype) -> None:
    """Batch 3, contexts 37 / 96 / 150 (unaligned, crossing segments), GQA 4 q / 2 KV heads: the
    table 64x wider launches the same grids with the same work items and gives the same bits,
    which are the trainer's rows."""
    query, kc, vc, tight, wide, qsl, seq_lens, trained = _decode_case([37, 96, 150], dtype, seed=5)
    launches.clear()
    out_tight = _decode(query, kc, vc, tight, qsl, seq_lens)
    tight_launches = list(launches)
    launches.clear()
    out_wide = _decode(query, kc, vc, wide, qsl, seq_lens)
    assert [kernel for kernel, _, _ in launches] == ["_attention_fwd_kernel", "_attention_merge_kernel"]
    assert launches == tight_launches
    # the work is the context's: 2 KV heads x (1 + 2 + 3) segments of 64 positions
    assert launches[0][2] == 2 * (1 + 2 + 3)
    assert torch.equal(out_wide, out_tight)
    assert torch.equal(out_wide, trained)


def test_wide_table_under_the_interpreter(launches) -> None:
    """The same through the Triton source (``verify``: the interpreter and the replay, bit for bit,
    every tensor argument, the work list and the merge's per-row counts included)."""
    query, kc, vc, tight, wide, qsl, seq_lens, trained = _decode_case([20, 70], torch.float16, seed=8, heads=8)
    launches.clear()
    with dispatch.cpu_executor("verify"):
        out_wide = _decode(query, kc, vc, wide, qsl, seq_lens)
        out_tight = _decode(query, kc, vc, tight, qsl, seq_lens)
    assert launches[:2] == launches[2:]
    assert torch.equal(out_wide, out_tight) and torch.equal(out_wide, trained)


def test_negative_controls(launches, monkeypatch) -> None:
    """The harness sees a schedule whose work follows the table's width (every block owning all
    the workspace's segments, the old enumeration: the same bits, 64x the work), and a wide table
    that points one page of the context elsewhere (different bits)."""
    query, kc, vc, tight, wide, qsl, seq_lens, _ = _decode_case([37, 96, 150], torch.float32, seed=5)
    launches.clear()
    out_tight = _decode(query, kc, vc, tight, qsl, seq_lens)
    tight_work = launches[0][2]

    def width_work(program_seq, num_blocks, seq_lens, kv_first_pos, max_kv_len, seg, max_segments):
        real = torch.arange(program_seq.numel()) < num_blocks
        return torch.cumsum(real.to(torch.int64) * max_segments, 0).to(torch.int32)

    with monkeypatch.context() as patch:
        patch.setattr(attention_plan, "segment_work", width_work)
        patch.setattr(attention_batch, "segment_work", width_work)  # the LaunchPlan's
        launches.clear()
        out_width = _decode(query, kc, vc, wide, qsl, seq_lens)
    assert torch.equal(out_width, out_tight)
    assert launches[0][2] >= WIDER * tight_work // 2, "the counter did not see the width-sized work"

    moved = wide.clone()
    moved[2, 1] = wide[0, 0]
    assert not torch.equal(_decode(query, kc, vc, moved, qsl, seq_lens), out_tight)


def test_segment_work_on_the_device() -> None:
    """The work list: per block of the program map, cumulative counts of the segments holding its
    sequence's keys (clamped to the workspace), none for the map's unused entries."""
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    program_seq, _, num_blocks = attention_plan.program_map(qsl, 1, 4)
    seq_lens = torch.tensor([1, 64, 65, 10**6], dtype=torch.int32)
    work = attention_plan.segment_work(program_seq, num_blocks, seq_lens, None, 640, 64, 10)
    assert work.dtype == torch.int32 and work.tolist() == [1, 2, 4, 14, 14, 14, 14, 14]
    first = torch.tensor([0, 60, 64, 130], dtype=torch.int32)
    work = attention_plan.segment_work(program_seq, num_blocks, torch.tensor([1, 8, 1, 5]), first, 640, 64, 11)
    assert work.tolist() == [1, 3, 4, 5, 5, 5, 5, 5]
