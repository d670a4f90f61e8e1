"""The CUDA table's training tiles (16-bit, head <= 128: 128-row forward query tiles, key-major
backward on 128-key tiles with 32 packed query rows), run on the CPU: a token's forward row is the
same bits trained, chunk-prefilled and decoded; the CPU table's rows are
those bits too (``block_m`` changes no row's KV order). A negative control: another ``tile_n``."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from attention_harness import make_batch, mismatched_rows, random_chunks, run_schedule

from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import ATTENTION_TABLE

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

#: Unaligned; the longest crosses the 256-position segment of the CUDA row and several 64-key tiles.
LENS = [270, 6]


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)], ids=str)
def test_cuda_training_tiles_keep_every_caller_bit_identical(dtype: torch.dtype) -> None:
    config = ATTENTION_TABLE["cuda", {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], 64]
    assert config.block_m == 128 and config.bwd_block_n == 128
    batch = make_batch(LENS, num_heads=4, num_kv_heads=1, head_size=64, dtype=dtype, seed=21)
    scale = 64**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=config)
    rng = random.Random(5)
    chunks = [random_chunks(n, rng, max_chunk=160, decode_tail=2) for n in batch.lens]
    served = run_schedule(batch, chunks, page_size=16, seed=2, scale=scale, config=config)
    assert mismatched_rows(trained, served) == []
    # 16 query rows instead of 128 (the CPU's block_m) with the same KV tiles and segments: the same bits.
    narrow = varlen_attention(
        batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=dataclasses.replace(config, block_m=16)
    )
    assert torch.equal(narrow, trained)
    # Negative control: 32-key tiles fold the softmax state in another order.
    other = varlen_attention(
        batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=dataclasses.replace(config, tile_n=32)
    )
    assert mismatched_rows(trained, other)
