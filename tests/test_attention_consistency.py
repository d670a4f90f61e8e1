"""Bit equality of a token's attention row across training, prefill, chunked prefill and decode."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from attention_harness import (
    make_batch,
    mismatched_rows,
    random_chunks,
    run_schedule,
)

from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import attention_config

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_SIZES = [64, 128, 80]
# Unaligned lengths; the longest crosses two KV-tile boundaries (tile_n = 32 on the CPU).
LENS = [70, 19, 3, 33]


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_rows_equal_paged_rows(dtype: torch.dtype, head_size: int) -> None:
    batch = make_batch(LENS, num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, seed=head_size)
    scale = head_size**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale)

    # (a) one full prefill per sequence, all sequences in one batch, page size 16.
    full = run_schedule(batch, [[n] for n in batch.lens], page_size=16, seed=1, scale=scale)
    assert mismatched_rows(trained, full) == []

    # (b)+(c)+(d) random chunked prefill then decode, sequences shuffled in every step,
    # (e) a different page size and shuffled block table.
    rng = random.Random(head_size)
    chunks = [random_chunks(n, rng) for n in batch.lens]
    for page_size, seed in ((16, 2), (7, 3)):
        served = run_schedule(batch, chunks, page_size=page_size, seed=seed, scale=scale)
        assert mismatched_rows(trained, served) == [], f"page_size={page_size}, chunks={chunks}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_every_token_one_at_a_time(dtype: torch.dtype) -> None:
    batch = make_batch([41, 9], num_heads=2, num_kv_heads=1, head_size=64, dtype=dtype, seed=7)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    decoded = run_schedule(batch, [[1] * n for n in batch.lens], page_size=128, seed=5, scale=64**-0.5)
    assert mismatched_rows(trained, decoded) == []


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 1)])
def test_mha_and_mqa(num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch([37, 12], num_heads, num_kv_heads, head_size=96, dtype=torch.bfloat16, seed=11)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    chunks = [[20, 10, 1, 1, 1, 1, 1, 1, 1], [5, 1, 6]]
    served = run_schedule(batch, chunks, page_size=16, seed=4, scale=96**-0.5)
    assert mismatched_rows(trained, served) == []


@pytest.mark.parametrize("sliding_window", [1, 20, 40])
def test_sliding_window(sliding_window: int) -> None:
    batch = make_batch([75, 30], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, seed=3)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sliding_window=sliding_window)
    chunks = [[33, 17, 20, 1, 1, 1, 1, 1], [30]]
    served = run_schedule(batch, chunks, page_size=16, seed=6, scale=64**-0.5, sliding_window=sliding_window)
    assert mismatched_rows(trained, served) == []


def test_non_causal_prefill() -> None:
    batch = make_batch([45, 8], num_heads=2, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=9)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, causal=False)
    served = run_schedule(batch, [[45], [8]], page_size=16, seed=8, scale=64**-0.5, causal=False)
    assert mismatched_rows(trained, served) == []


# ---- negative controls: the same harness must see a different schedule --------------------------


def test_negative_control_shifted_tile_boundary() -> None:
    """Decoding with KV tiles of 16 instead of the frozen 32 moves tile boundaries; the harness
    that reports zero mismatches above must report them here."""
    dtype = torch.float32
    batch = make_batch([70, 33], num_heads=2, num_kv_heads=1, head_size=64, dtype=dtype, seed=21)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    frozen = attention_config(64, dtype, batch.query.device)
    shifted = dataclasses.replace(frozen, tile_n=frozen.tile_n // 2)
    chunks = [[40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [33]]
    served = run_schedule(batch, chunks, page_size=16, seed=2, scale=64**-0.5, config=shifted)
    mismatches = mismatched_rows(trained, served)
    assert len(mismatches) > 0
    # and the same harness with the frozen schedule is clean
    served = run_schedule(batch, chunks, page_size=16, seed=2, scale=64**-0.5)
    assert mismatched_rows(trained, served) == []
