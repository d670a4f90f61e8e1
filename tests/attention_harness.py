"""Shared harness for the attention tests: random packed batches, a simulated vLLM scheduler
(paged cache, chunked prefill, decode, shuffled batches), and an fp64 reference."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from samepath.kernels.attention import paged_attention, write_kv_cache


@dataclass
class Batch:
    query: torch.Tensor  # [tokens, heads, head_size]
    key: torch.Tensor  # [tokens, kv_heads, head_size]
    value: torch.Tensor
    lens: list[int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return lengths_to_cu(self.lens)

    def starts(self) -> list[int]:
        return self.cu_seqlens.tolist()[:-1]


def lengths_to_cu(lens: list[int]) -> torch.Tensor:
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    return torch.tensor(cu, dtype=torch.int32)


def make_batch(
    lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, head_size, generator=gen).to(dtype)

    return Batch(rand(num_heads), rand(num_kv_heads), rand(num_kv_heads), list(lens))


def reference_attention(
    batch: Batch,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp64 softmax(QK^T * scale) V per sequence, heads grouped as GQA (scores ``cap * tanh(s / cap)``
    with a ``softcap``); with ``sinks`` (``[heads]``) each head's sink logit joins the softmax as a
    last column that is then dropped (GPT-OSS's eager attention). Differentiable in the batch's
    tensors and ``sinks`` (when they require grad)."""
    q, k, v = (t.double() for t in (batch.query, batch.key, batch.value))
    group = q.shape[1] // k.shape[1]
    outs = []
    for start, length in zip(batch.starts(), batch.lens, strict=True):
        qs = q[start : start + length].transpose(0, 1)
        ks = k[start : start + length].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start : start + length].repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        visible = torch.ones(length, length, dtype=torch.bool)
        if causal:
            visible &= j <= i
        if sliding_window is not None:
            visible &= i - j < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.double()[:, None, None].expand(-1, length, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs)


@dataclass
class PagedCache:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor

    def slots(self, seq: int, positions: range) -> list[int]:
        page_size = self.key_cache.shape[1]
        return [int(self.block_table[seq, p // page_size]) * page_size + p % page_size for p in positions]


def make_paged_cache(batch: Batch, page_size: int, rng: random.Random, spare_pages: int = 3) -> PagedCache:
    """An empty cache (filled with NaN, which must never leak into a result) with shuffled pages."""
    pages_per_seq = [(length + page_size - 1) // page_size for length in batch.lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = list(range(num_pages))
    rng.shuffle(order)
    width = max(pages_per_seq) + 1
    table = torch.zeros(len(batch.lens), width, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(pages_per_seq):
        table[seq, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    shape = (num_pages, page_size, batch.key.shape[1], batch.key.shape[2])
    nan = torch.full(shape, float("nan"), dtype=batch.key.dtype)
    return PagedCache(nan, nan.clone(), table)


def run_schedule(
    batch: Batch,
    chunks: list[list[int]],
    page_size: int,
    seed: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    config=None,
    split_kv: bool | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Serve ``batch`` as vLLM would: step ``s`` takes chunk ``s`` of every sequence that still has
    one, writes its KV into a paged cache, and runs one paged_attention call over the step's
    sequences in shuffled order. ``chunks[i]`` are sequence ``i``'s chunk sizes (1 = decode).
    ``split_kv`` is passed to every call (``None``: the launcher's choice).
    Returns the output rows placed back at each token's index in ``batch``."""
    rng = random.Random(seed)
    cache = make_paged_cache(batch, page_size, rng)
    out = torch.full_like(batch.query, float("nan"))
    starts = batch.starts()
    done = [0] * len(batch.lens)
    for step in range(max(len(c) for c in chunks)):
        active = [i for i, c in enumerate(chunks) if step < len(c)]
        rng.shuffle(active)
        token_index, slots, q_lens, kv_lens = [], [], [], []
        for seq in active:
            n = chunks[seq][step]
            positions = range(done[seq], done[seq] + n)
            token_index += [starts[seq] + p for p in positions]
            slots += cache.slots(seq, positions)
            q_lens.append(n)
            done[seq] += n
            kv_lens.append(done[seq])
        index = torch.tensor(token_index)
        write_kv_cache(batch.key[index], batch.value[index], cache.key_cache, cache.value_cache, torch.tensor(slots))
        out[index] = paged_attention(
            batch.query[index],
            cache.key_cache,
            cache.value_cache,
            cache.block_table[torch.tensor(active)],
            lengths_to_cu(q_lens),
            torch.tensor(kv_lens, dtype=torch.int32),
            scale,
            causal=causal,
            sliding_window=sliding_window,
            config=config,
            split_kv=split_kv,
            softcap=softcap,
            sinks=sinks,
        )
    assert done == batch.lens
    return out


def random_chunks(length: int, rng: random.Random, max_chunk: int = 24, decode_tail: int = 3) -> list[int]:
    """Random prefill chunk sizes for the first part of a sequence, then one-token decode steps."""
    tail = min(decode_tail, length - 1)
    chunks, left = [], length - tail
    while left:
        n = rng.randint(1, min(max_chunk, left))
        chunks.append(n)
        left -= n
    return chunks + [1] * tail


def mismatched_rows(expected: torch.Tensor, actual: torch.Tensor) -> list[int]:
    """Token indices whose rows are not bit-identical (NaN counts as a mismatch)."""
    return [i for i in range(expected.shape[0]) if not torch.equal(expected[i], actual[i])]
