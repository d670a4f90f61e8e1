"""The CPU replays of the attention forward, its segment merge and the KV cache write
(:mod:`samepath.kernels.replay.attention_forward`) against Triton's interpreter, bit for bit.

Every call runs under the ``"verify"`` executor: each launch runs the interpreter on copies of its
arguments and the replay on the arguments, and any differing bit of any tensor argument (outputs,
log-sum-exp, the split schedule's partial states, the caches) raises :class:`ReplayMismatch`. The
launches come from the public APIs the integrations call: the trainer's ``varlen_attention``, Hugging
Face's padded / cached layouts through ``attention_forward`` and ``packed_attention`` (``kv_start``),
and vLLM's ``write_kv_cache`` + ``paged_attention`` for chunked prefill and decode.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from attention_harness import lengths_to_cu, make_batch, make_paged_cache

from samepath.integrations import hf
from samepath.kernels.attention import packed_attention, paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.dispatch import ReplayMismatch, cpu_executor
from samepath.kernels.replay import attention_forward as replay_module

#: The CPU table: query tiles of 16 rows, KV tiles of 32 positions, segments of 64.
TILE_N, SEG = 32, 64


@pytest.fixture(autouse=True)
def _verify():
    with cpu_executor("verify"):
        yield


#: (lengths, heads, KV heads, head size, dtype, causal, sliding window)
VARLEN_CASES = [
    ([1, 37, 70], 4, 2, 64, torch.float32, True, None),
    ([3 * SEG + 5, 9], 2, 1, 80, torch.bfloat16, True, None),
    ([50, 17], 8, 1, 128, torch.float16, True, 9),
    ([33, 2 * SEG + 1], 3, 3, 80, torch.float32, False, None),
    ([SEG, 1, 40], 6, 2, 64, torch.bfloat16, True, TILE_N + 3),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[0]}-{c[1]}q{c[2]}kv-d{c[3]}-{c[4]}".replace(" ", ""))
def test_varlen_forward(case) -> None:
    """The trainer's forward (serial segments, log-sum-exp stored): packed sequences of different
    lengths, GQA, head sizes 64 / 80 / 128, causal, windowed and non-causal."""
    lens, heads, kv_heads, head_size, dtype, causal, window = case
    batch = make_batch(lens, heads, kv_heads, head_size, dtype, seed=sum(lens))
    with torch.no_grad():
        out = varlen_attention(
            batch.query, batch.key, batch.value, batch.cu_seqlens, causal=causal, sliding_window=window
        )
    assert torch.isfinite(out).all()


def test_varlen_forward_under_autograd() -> None:
    """Inputs that require grad (the trainer's): the replay reads them detached."""
    batch = make_batch([20, 45], 4, 2, 64, torch.bfloat16, seed=3)
    leaves = [t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    out = varlen_attention(*leaves, batch.cu_seqlens)
    assert out.requires_grad


@pytest.mark.parametrize("split_kv", [True, False], ids=["split", "serial"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_with_cached_prefix_and_kv_start(split_kv: bool, dtype: torch.dtype) -> None:
    """``packed_attention``: new queries over a cached prefix, keys truncated by a sliding-window
    cache (``kv_start`` inside a tile, across a segment, at 0), both segment schedules."""
    window = 12
    # (full length, queries, keys kept)
    sequences = [(45, 1, 12), (70, 2, 13), (7, 2, 7), (96, 3, 32)]
    batch = make_batch([s[0] for s in sequences], 4, 2, 80, dtype, seed=11)
    queries, keys, values, q_lens, kv_lens, starts = [], [], [], [], [], []
    for begin, (length, q_len, kept) in zip(batch.starts(), sequences, strict=True):
        end = begin + length
        queries.append(batch.query[end - q_len : end])
        keys.append(batch.key[end - kept : end])
        values.append(batch.value[end - kept : end])
        q_lens.append(q_len)
        kv_lens.append(kept)
        starts.append(length - kept)
    q, k, v = torch.cat(queries), torch.cat(keys), torch.cat(values)
    cu_q, cu_kv = lengths_to_cu(q_lens), lengths_to_cu(kv_lens)
    kv_start = torch.tensor(starts, dtype=torch.int32)
    packed_attention(q, k, v, cu_q, cu_kv, 80**-0.5, sliding_window=window, split_kv=split_kv, kv_start=kv_start)
    packed_attention(q, k, v, cu_q, cu_kv, 80**-0.5, split_kv=split_kv)


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window"])
def test_hugging_face_padded_batches(window: int | None) -> None:
    """Hugging Face's calls: a left-padded prefill (padding sequences of their own, an unpadded row)
    and a cached decode step, whose sliding-window cache has dropped the first keys (``kv_start``)."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, head_size, length = 3, 4, 2, 64, 40
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :12] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)

    def rand(heads: int, slots: int) -> torch.Tensor:
        return torch.randn(batch, heads, slots, head_size, generator=gen).to(torch.bfloat16)

    layer = _Layer()
    hf.attention_forward(layer, rand(heads, length), rand(kv_heads, length), rand(kv_heads, length), mask,
                         sliding_window=window, position_ids=position_ids)  # fmt: skip
    # The step after 20 generated tokens; a windowed cache keeps the last window - 1 keys + the new one.
    generated = 20
    step_mask = torch.cat([mask, torch.ones(batch, generated + 1, dtype=torch.long)], 1)
    kv_len = step_mask.shape[1] if window is None else window
    step_positions = position_ids[:, -1:] + generated + 1
    out, _ = hf.attention_forward(layer, rand(heads, 1), rand(kv_heads, kv_len), rand(kv_heads, kv_len), step_mask,
                                  sliding_window=window, position_ids=step_positions)  # fmt: skip
    assert torch.isfinite(out).all()


def _serve(batch, chunks, page_size: int, seed: int, attend_from: int = 0, **kwargs) -> None:
    """vLLM's schedule: per step, ``write_kv_cache`` of the step's tokens (padding slots included),
    then (from step ``attend_from`` on) one ``paged_attention`` over the step's sequences in
    shuffled order."""
    rng = random.Random(seed)
    cache = make_paged_cache(batch, page_size, rng)
    starts, done = batch.starts(), [0] * len(batch.lens)
    for step in range(max(len(c) for c in chunks)):
        active = [i for i, c in enumerate(chunks) if step < len(c)]
        rng.shuffle(active)
        index, slots, q_lens, kv_lens = [], [], [], []
        for seq in active:
            positions = range(done[seq], done[seq] + chunks[seq][step])
            index += [starts[seq] + p for p in positions]
            slots += cache.slots(seq, positions)
            q_lens.append(len(positions))
            done[seq] += len(positions)
            kv_lens.append(done[seq])
        pad = batch.key[: 1 + step % 2]  # padded tokens (slot -1) that must not be written
        write_kv_cache(
            torch.cat([batch.key[index], pad]),
            torch.cat([batch.value[index], pad]),
            cache.key_cache,
            cache.value_cache,
            torch.tensor(slots + [-1] * pad.shape[0]),
        )
        if step < attend_from:
            continue
        out = paged_attention(
            batch.query[index],
            cache.key_cache,
            cache.value_cache,
            cache.block_table[torch.tensor(active)],
            lengths_to_cu(q_lens),
            torch.tensor(kv_lens, dtype=torch.int32),
            batch.query.shape[-1] ** -0.5,
            **kwargs,
        )
        assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "dtype, head_size, heads, kv_heads, split_kv, window",
    [
        (torch.bfloat16, 128, 8, 1, None, None),
        (torch.float16, 80, 4, 2, True, 20),
        (torch.float32, 64, 6, 3, False, 40),
    ],
    ids=["bf16-d128-gqa8", "fp16-d80-split-window", "fp32-d64-serial-window"],
)
def test_paged_chunked_prefill_and_decode(dtype, head_size, heads, kv_heads, split_kv, window) -> None:
    """Chunked prefill mixed with decode steps over a shuffled block table, the sequences crossing
    several segments; the launcher's choice of schedule (``None``), split + merge, and serial."""
    batch = make_batch([SEG + 42, 30, 5], heads, kv_heads, head_size, dtype, seed=head_size + heads)
    chunks = [[60, 44, 1, 1], [20, 8, 1, 1], [2, 1, 1, 1]]
    _serve(batch, chunks, page_size=16, seed=heads, split_kv=split_kv, sliding_window=window)


def test_paged_decode_over_long_contexts() -> None:
    """Decode (one query per sequence) over paged contexts of different lengths (the cache filled by
    one write), the hot path: split segments and their merge, a table wider than the longest sequence."""
    lens = [4 * SEG + 3, 2 * SEG, 77, 2]
    batch = make_batch(lens, 8, 2, 128, torch.bfloat16, seed=19)
    chunks = [[n - 2, 1, 1] for n in lens]
    _serve(batch, chunks, page_size=32, seed=2, attend_from=1)


def test_fully_masked_rows_and_unchecked_metadata() -> None:
    """Unchecked metadata (``validate=False``): a sequence whose pages all lie outside the cache sees
    no key (rows of zeros, an empty state in every segment), another runs past the block table."""
    page_size = 16
    q = torch.randn(4, 4, 64)
    kc, vc = torch.randn(6, page_size, 2, 64), torch.randn(6, page_size, 2, 64)
    table = torch.tensor([[0, 1, 2], [100, -3, 7], [3, 4, 5]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3, 4], dtype=torch.int32)
    seq_lens = torch.tensor([40, 30, 10**6], dtype=torch.int32)
    for split_kv in (True, False):
        out = paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125, validate=False, split_kv=split_kv)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_overlapping_sequences_keep_the_last_write() -> None:
    """Unchecked cumulative lengths that make two sequences share query rows (``[0, 6, 3, 8]``): the
    rows (and, split, the partial states) hold what the interpreter stores last."""
    batch = make_batch([8], 4, 2, 64, torch.float32, seed=13)
    with torch.no_grad():
        varlen_attention(batch.query, batch.key, batch.value, torch.tensor([0, 6, 3, 8]), validate=False)
    kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    table = torch.tensor([[0, 1, 2], [1, 2, 3], [3, 0, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 30, 35], dtype=torch.int32)
    for split_kv in (True, False):
        paged_attention(
            batch.query[:4], kc, vc, table, torch.tensor([0, 3, 1, 4]), seq_lens, 0.125, validate=False,
            split_kv=split_kv,
        )  # fmt: skip


def test_write_kv_cache_padding_and_repeated_slots() -> None:
    """Padding slots are skipped, slots past the caches too (``validate=False``), and a slot given
    twice keeps the later token, as the interpreter writes them."""
    key, value = torch.randn(6, 2, 80).to(torch.float16), torch.randn(6, 2, 80).to(torch.float16)
    kc, vc = torch.randn(3, 8, 2, 80).to(torch.float16), torch.randn(3, 8, 2, 80).to(torch.float16)
    write_kv_cache(key, value, kc, vc, torch.tensor([5, -1, 23, 5, 1000, 0]), validate=False)
    assert torch.equal(kc[0, 5], key[3]) and torch.equal(vc[0, 0], value[5])


def test_negative_control() -> None:
    """The harness catches a replay that finishes with ``acc * (1 / l)`` instead of ``acc / l``,
    and one that casts P to bf16 by truncation."""
    batch = make_batch([37, 70], 4, 2, 64, torch.float32, seed=23)
    original = replay_module._finish

    def reciprocal_finish(m, l_sum, acc, store_lse):
        _, lse = original(m, l_sum, acc, store_lse)
        l_safe = np.where(l_sum == 0, np.float32(1), l_sum)
        return acc * (np.float32(1) / l_safe)[..., None], lse

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "_finish", reciprocal_finish)
        with pytest.raises(ReplayMismatch, match="_attention_fwd_kernel"):
            varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)

    bf16 = make_batch([70, 9], 4, 2, 64, torch.bfloat16, seed=29)
    cast = replay_module._as_interpreted_cast

    def truncating_cast(values, dtype):
        if dtype.itemsize == 2 and dtype.kind == "u":
            return (values.view("uint32") & 0xFFFF0000).view("float32")
        return cast(values, dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "_as_interpreted_cast", truncating_cast)
        with pytest.raises(ReplayMismatch):
            varlen_attention(bf16.query, bf16.key, bf16.value, bf16.cu_seqlens)
