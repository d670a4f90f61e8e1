"""``packed_attention`` over a truncated KV (``kv_start``): what a sliding-window cache keeps.

Hugging Face's sliding-window cache keeps a sequence's last ``sliding_window - 1`` keys plus the
new ones; ``kv_start`` tells the kernel at which absolute position they start, so its KV tiles
stay anchored at the sequence's position 0. The rows must equal, bit for bit, those of
``varlen_attention`` over the whole sequence (the trainer) — tiles partly before ``kv_start``,
segment boundaries inside the kept keys, GQA, head sizes 64 and 80.
"""

from __future__ import annotations

import pytest
import torch
from attention_harness import lengths_to_cu, make_batch

from samepath.kernels.attention import packed_attention, varlen_attention

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

#: (sequence length, queries, keys kept). The CPU table's tile_n is 32 and seg 64: the kept keys
#: start inside a tile (45 - 12 = 33, 33 - 12 = 21: a window across the tile at 32; 70 - 13 = 57: a
#: window across the segment at 64), on a tile boundary (96 - 32 = 64), or at 0 (nothing dropped).
SEQUENCES = [(45, 1, 12), (33, 1, 12), (70, 2, 13), (7, 2, 7), (96, 3, 32), (90, 3, 20)]
WINDOW = 12


def truncated(batch, sequences):
    """The queries, kept keys/values, cumulative lengths and kv_start of ``sequences``, and the
    full-sequence rows of those queries' tokens in ``batch``."""
    queries, keys, values, q_lens, kv_lens, starts, rows = [], [], [], [], [], [], []
    for begin, (length, q_len, kept) in zip(batch.starts(), sequences, strict=True):
        first = length - kept
        end = begin + length
        queries.append(batch.query[end - q_len : end])
        keys.append(batch.key[begin + first : end])
        values.append(batch.value[begin + first : end])
        rows.append(torch.arange(end - q_len, end))
        q_lens.append(q_len)
        kv_lens.append(kept)
        starts.append(first)
    return (
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        lengths_to_cu(q_lens),
        lengths_to_cu(kv_lens),
        torch.tensor(starts),
        torch.cat(rows),
    )


@pytest.mark.parametrize(
    "head_size,num_heads,num_kv_heads,dtype",
    [(64, 4, 2, torch.float32), (80, 6, 2, torch.bfloat16), (64, 2, 2, torch.float16)],
    ids=str,
)
def test_truncated_kv_with_kv_start_equals_the_full_sequence(head_size, num_heads, num_kv_heads, dtype) -> None:
    """Both execution schedules (split segments + merge, serial) give the full sequences' rows;
    negative controls: kv_start off by one, and no kv_start at all (tiles anchored at the first
    kept key), give other rows."""
    lengths = [length for length, _, _ in SEQUENCES]
    batch = make_batch(lengths, num_heads, num_kv_heads, head_size, dtype, seed=head_size + num_heads)
    scale = head_size**-0.5
    full = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, sliding_window=WINDOW)
    q, k, v, cu_q, cu_kv, kv_start, rows = truncated(batch, SEQUENCES)
    expected = full[rows]
    for split_kv in (True, False, None):
        out = packed_attention(
            q, k, v, cu_q, cu_kv, scale, sliding_window=WINDOW, kv_start=kv_start.to(torch.int32), split_kv=split_kv
        )
        assert torch.equal(out, expected), split_kv
    out = packed_attention(q, k, v, cu_q, cu_kv, scale, sliding_window=WINDOW, kv_start=kv_start)  # int64
    assert torch.equal(out, expected)

    # Off by one: every truncated sequence's keys one position earlier. Where a kept window
    # straddles a tile or segment boundary (sequences 1 and 2) the tiles split it elsewhere.
    shifted = torch.where(kv_start > 0, kv_start - 1, kv_start)
    off_by_one = packed_attention(q, k, v, cu_q, cu_kv, scale, sliding_window=WINDOW, kv_start=shifted)
    assert not torch.equal(off_by_one, expected)
    anchored_at_cache = packed_attention(q, k, v, cu_q, cu_kv, scale, sliding_window=WINDOW)
    assert not torch.equal(anchored_at_cache, expected)


def test_zero_kv_start_has_the_bits_of_no_kv_start() -> None:
    """kv_start = 0 everywhere (the keys are whole sequences) changes no bit of packed_attention,
    with or without a window, in both schedules; and equals the trainer's rows."""
    lengths, q_lens = [37, 5, 70], [4, 5, 1]
    batch = make_batch(lengths, 4, 1, 64, torch.bfloat16, seed=3)
    full = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, 0.125, sliding_window=9)
    rows = torch.cat([torch.arange(b + n - m, b + n) for b, n, m in zip(batch.starts(), lengths, q_lens, strict=True)])
    cu_q = lengths_to_cu(q_lens)
    zeros = torch.zeros(len(lengths), dtype=torch.int64)
    for window in (None, 9):
        for split_kv in (True, False):
            args = (batch.query[rows], batch.key, batch.value, cu_q, batch.cu_seqlens, 0.125)
            kw = dict(sliding_window=window, split_kv=split_kv)
            plain = packed_attention(*args, **kw)
            assert torch.equal(packed_attention(*args, **kw, kv_start=zeros), plain)
            if window is not None:
                assert torch.equal(plain, full[rows])


def test_bad_kv_start_is_refused() -> None:
    batch = make_batch([20, 15], 2, 1, 64, torch.float32, seed=5)
    q = batch.query[[19, 34]]
    # Sequence 0 keeps 12 keys (8..19), sequence 1 all 15; NaN guard rows on either side.
    guarded = torch.full((2, 31, 1, 64), float("nan"))
    guarded[0, 2:-2], guarded[1, 2:-2] = batch.key[8:], batch.value[8:]
    k, v = guarded[0, 2:-2], guarded[1, 2:-2]
    cu_q, cu_kv = lengths_to_cu([1, 1]), lengths_to_cu([12, 15])

    def call(kv_start, **kw):
        kw.setdefault("sliding_window", 8)
        return packed_attention(q, k, v, cu_q, cu_kv, 0.125, kv_start=kv_start, **kw)

    with pytest.raises(ValueError, match=r"kv_start must be non-negative, kv_start\[1\] = -1"):
        call(torch.tensor([8, -1]))
    with pytest.raises(ValueError, match="kv_start must have 2 entries"):
        call(torch.tensor([8]))
    with pytest.raises(ValueError, match="kv_start must be a 1-D int32/int64 tensor"):
        call(torch.tensor([8.0, 0.0]))
    with pytest.raises(ValueError, match="kv_start must be a 1-D int32/int64 tensor"):
        call(torch.tensor([[8, 0]]))
    with pytest.raises(ValueError, match=r"kv_start must be a 1-D int32/int64 torch\.Tensor"):
        call([8, 0])
    # A window wider than the kept keys: the query at 19 would see position 7, which is gone.
    with pytest.raises(ValueError, match=r"kv_start\[0\] = 8: .*position 19\) sees positions from 7"):
        call(torch.tensor([8, 0]), sliding_window=13)
    with pytest.raises(ValueError, match=r"kv_start\[0\] = 8: .*sliding_window \(now None\)"):
        call(torch.tensor([8, 0]), sliding_window=None)
    expected = call(torch.tensor([8, 0]))
    # Unchecked values stay memory-safe: no guard row is read (the output is finite).
    for garbage in ([-1000, 5], [2**30, 3], [-(2**31), 2**31 - 1]):
        out = call(torch.tensor(garbage, dtype=torch.int32), validate=False)
        assert torch.isfinite(out).all()
    assert torch.equal(call(torch.tensor([8, 0]), validate=False), expected)
