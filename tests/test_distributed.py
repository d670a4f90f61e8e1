"""Tensor parallelism with samepath's invariant (issue 9): a TP-S forward over gloo processes gives
token logprobs ``torch.equal`` to one process running the S-slice kernels.

The model is a tiny Qwen3-like stack built from samepath ops: 2 decoder layers, each an attention
block (RMSNorm; q, k, v column-parallel by heads, GQA; per-head q/k RMSNorm; rotary; packed
varlen attention over 2 sequences; o_proj row-parallel; residual add) and an MLP block (RMSNorm,
gate and up column-parallel, SiLU·mul, down row-parallel, residual add), a final RMSNorm and a
vocab-parallel lm_head + token logprobs. Negative controls: a stock TP run (each rank's bf16 o_proj and
down_proj outputs summed by ``dist.all_reduce``) and the unsharded ``k_slices=1`` trainer (fp32
model) both differ.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from samepath.distributed import (
    column_parallel_linear,
    row_parallel_linear,
    sharded_token_logprobs,
    sum_partials,
    vocab_parallel_token_logprobs,
)
from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import RowReduceConfig
from samepath.kernels.logprobs import token_logprobs
from samepath.kernels.matmul import linear, matmul
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul

HIDDEN, INTER, VOCAB, TOKENS, LAYERS = 64, 256, 256, 6, 2
HEADS, KV_HEADS, HEAD_DIM, ROPE_BASE = 8, 4, 32, 10000.0
#: Two packed sequences of 4 and 2 tokens; positions start at 0 in each.
CU_SEQLENS = torch.tensor([0, 4, 6], dtype=torch.int32)
POSITIONS = torch.tensor([0, 1, 2, 3, 0, 1])
TEMPERATURE = 0.7
#: A small vocab chunk so every shard is folded in several chunks (the frozen CPU chunk is 4096).
CHUNK = RowReduceConfig(vocab_chunk=32)


def _weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    w = {"x": randn(TOKENS, HIDDEN, scale=1.0), "labels": torch.randint(0, VOCAB, (TOKENS,), generator=gen)}
    w["labels"][2] = -100  # an ignored position
    for i in range(LAYERS):
        for name, size in (("attn_norm", HIDDEN), ("norm", HIDDEN), ("q_norm", HEAD_DIM), ("k_norm", HEAD_DIM)):
            w[f"{name}{i}"] = (1 + torch.randn(size, generator=gen) * 0.1).to(dtype)
        w[f"q{i}"] = randn(HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5)
        w[f"k{i}"] = randn(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5)
        w[f"v{i}"] = randn(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5)
        w[f"o{i}"] = randn(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5)
        w[f"gate{i}"] = randn(INTER, HIDDEN, scale=HIDDEN**-0.5)
        w[f"up{i}"] = randn(INTER, HIDDEN, scale=HIDDEN**-0.5)
        w[f"down{i}"] = randn(HIDDEN, INTER, scale=INTER**-0.5)
    w["norm_f"] = (1 + torch.randn(HIDDEN, generator=gen) * 0.1).to(dtype)
    w["lm_head"] = randn(VOCAB, HIDDEN, scale=HIDDEN**-0.5 * 4)
    return w


def _attention(w: dict[str, torch.Tensor], i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Qwen3 attention on (this rank's) heads: per-head q/k RMSNorm, rotary, packed causal attention."""
    q = rms_norm(q.view(TOKENS, -1, HEAD_DIM), w[f"q_norm{i}"])
    k = rms_norm(k.view(TOKENS, -1, HEAD_DIM), w[f"k_norm{i}"])
    cos, sin = rotary_cos_sin(POSITIONS, HEAD_DIM, ROPE_BASE, q.dtype)
    q, k = apply_rotary(q, k, cos, sin)
    out = varlen_attention(q, k, v.view(TOKENS, -1, HEAD_DIM), CU_SEQLENS)
    return out.reshape(TOKENS, -1)


def _trainer(w: dict[str, torch.Tensor], k_slices: int, vocab_shards: int) -> torch.Tensor:
    """The unsharded trainer: full weights on one process, S-slice kernels."""
    x = w["x"]
    for i in range(LAYERS):
        h = rms_norm(x, w[f"attn_norm{i}"])
        attn = _attention(w, i, linear(h, w[f"q{i}"]), linear(h, w[f"k{i}"]), linear(h, w[f"v{i}"]))
        x = x + linear(attn, w[f"o{i}"], k_slices=k_slices)
        h = rms_norm(x, w[f"norm{i}"])
        a = silu_mul(linear(h, w[f"gate{i}"]), linear(h, w[f"up{i}"]))
        x = x + linear(a, w[f"down{i}"], k_slices=k_slices)
    logits = linear(rms_norm(x, w["norm_f"]), w["lm_head"])
    return sharded_token_logprobs(logits, w["labels"], vocab_shards, TEMPERATURE, config=CHUNK)


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].contiguous()


def _row(a: torch.Tensor, w_shard: torch.Tensor, stock: bool) -> torch.Tensor:
    if not stock:
        return row_parallel_linear(a, w_shard)
    # Megatron-style: each rank's bf16 (or fp32) output, summed by an all-reduce.
    out = linear(a, w_shard)
    dist.all_reduce(out)
    return out


def _tp_forward(w: dict[str, torch.Tensor], rank: int, world: int, stock: bool) -> torch.Tensor:
    x = w["x"]
    for i in range(LAYERS):
        h = rms_norm(x, w[f"attn_norm{i}"])
        q, k, v = (column_parallel_linear(h, _shard(w[f"{p}{i}"], 0, rank, world)) for p in "qkv")
        attn = _attention(w, i, q, k, v)  # this rank's HEADS / world query heads
        x = x + _row(attn, _shard(w[f"o{i}"], 1, rank, world), stock)
        h = rms_norm(x, w[f"norm{i}"])
        gate = column_parallel_linear(h, _shard(w[f"gate{i}"], 0, rank, world))
        up = column_parallel_linear(h, _shard(w[f"up{i}"], 0, rank, world))
        a = silu_mul(gate, up)  # this rank's INTER / world columns
        x = x + _row(a, _shard(w[f"down{i}"], 1, rank, world), stock)
    logits_shard = column_parallel_linear(rms_norm(x, w["norm_f"]), _shard(w["lm_head"], 0, rank, world))
    return vocab_parallel_token_logprobs(logits_shard, w["labels"], None, TEMPERATURE, config=CHUNK)


def _worker(rank: int, world: int, port: int, models: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {
            (name, kind): _tp_forward(w, rank, world, stock=kind == "stock")
            for name, w in models.items()
            for kind in ("samepath", "stock")
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_tp_forward_equals_one_process_s_slice_trainer(world, tmp_path):
    models = {"bf16": _weights(torch.bfloat16), "fp32": _weights(torch.float32)}
    mp.spawn(_worker, args=(world, _free_port(), models, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    trainers = {name: _trainer(w, k_slices=world, vocab_shards=world) for name, w in models.items()}
    for name, trainer in trainers.items():
        assert torch.isfinite(trainer).all()
        assert trainer[2] == 0  # ignore_index
        for r, res in enumerate(results):
            assert torch.equal(res[name, "samepath"], trainer), f"rank {r}: TP-{world} {name} logprobs differ"
    # Negative controls. bf16: the stock TP run (each rank's bf16 o/down projections all-reduced)
    # differs. fp32: the unsharded k_slices=1 trainer differs (in bf16 an fp32 last-bit difference
    # of the partial sums rarely survives the cast, so a model this small would not show it).
    # INTER / world spans two block_k tiles: in the interpreter tl.dot(a, b, acc) is acc + a @ b,
    # so a one-tile slice would make k_slices=S and k_slices=1 add the same terms in the same order.
    assert not torch.equal(results[0]["bf16", "stock"], trainers["bf16"])
    assert not torch.equal(_trainer(models["fp32"], k_slices=1, vocab_shards=world), trainers["fp32"])


# ----------------------------------------------------------------------------------------------
# One-process pieces (no processes spawned)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shard_equals_token_logprobs_and_shards_are_close_to_fp64(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, VOCAB, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 5), generator=gen)
    labels[0, 1] = -100
    expected = token_logprobs(logits, labels, TEMPERATURE, config=CHUNK)
    assert torch.equal(sharded_token_logprobs(logits, labels, 1, TEMPERATURE, config=CHUNK), expected)
    ref = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref[0, 1] = 0
    for shards in (2, 4, 8):
        got = sharded_token_logprobs(logits, labels, shards, TEMPERATURE, config=CHUNK)
        assert got.dtype == torch.float32 and got.shape == labels.shape
        assert (got.double() - ref).abs().max() < 1e-5


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_sharded_logprobs_handles_a_fully_masked_shard():
    logits = torch.randn(4, 64)
    logits[:, 32:] = float("-inf")  # the second of two shards sees only -inf (a padded vocabulary)
    labels = torch.tensor([0, 5, 31, 17])
    got = sharded_token_logprobs(logits, labels, 2, 1.0, config=CHUNK)
    expected = token_logprobs(logits[:, :32].contiguous(), labels, 1.0, config=CHUNK)
    assert torch.equal(got, expected)


def test_sharded_logprobs_rejects_bad_arguments():
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="num_shards"):
        sharded_token_logprobs(logits, torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match="outside"):
        sharded_token_logprobs(logits, torch.tensor([0, 64]), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices", [2, 4])
def test_k_slices_equals_partials_summed_in_order(slices, dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=gen).to(dtype)
    weight = (torch.randn(48, 256, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    partials = [
        matmul(xs.contiguous(), ws.t(), out_dtype=torch.float32)
        for xs, ws in zip(x.chunk(slices, -1), weight.chunk(slices, -1), strict=True)
    ]
    expected = linear(x, weight, bias, k_slices=slices)
    assert torch.equal(sum_partials(partials, bias, x.dtype), expected)
    if dtype == torch.float32:
        # Negative control: the plain kernel (one serial K loop) gives other bits. (In bf16 the
        # fp32 last-bit differences rarely survive the cast at this size.)
        assert not torch.equal(linear(x, weight, bias), expected)


def test_column_shards_equal_the_columns_of_the_full_linear():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(128, 64, generator=gen) * 0.1).to(torch.bfloat16)
    full = linear(x, weight)
    for rank in range(4):
        assert torch.equal(linear(x, _shard(weight, 0, rank, 4)), full[:, rank * 32 : (rank + 1) * 32])
