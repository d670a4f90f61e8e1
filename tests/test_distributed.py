"""Tensor parallelism with samepath's invariant (issue 9): a TP-S forward over gloo processes gives
token logprobs ``torch.equal`` to one process running the S-slice kernels.

The model is a tiny Qwen3-like stack built from samepath ops: 2 decoder layers, each an attention
block (RMSNorm; q, k, v column-parallel by heads, GQA; per-head q/k RMSNorm; rotary; packed
varlen attention over 2 sequences; o_proj row-parallel; residual add) and an MLP block (RMSNorm,
gate and up column-parallel, SiLU·mul, down row-parallel, residual add), a final RMSNorm and a
vocab-parallel lm_head + token logprobs. Negative controls: a stock TP run (each rank's bf16 o_proj and
down_proj outputs summed by ``dist.all_reduce``) and the unsharded ``k_slices=1`` trainer (fp32
model) both differ.

Backward (2 processes, one layer, bf16 and fp32): every rank's gradient of its weight shards is the
matching slice of the one-process S-slice trainer's gradient, and the input and replicated-weight
gradients are equal, bit for bit. Negative controls: the trainer with linear's own input gradient
for the column-parallel layers (fp32), and stock TP with Megatron-style all-reduces (bf16), differ.
The same processes check ``assert_same_numerics_across_group``: equal S passes, a rank with another
S makes every rank raise.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from samepath.distributed import (
    assert_same_numerics_across_group,
    column_parallel_linear,
    column_sharded_linear,
    row_parallel_linear,
    sharded_token_logprobs,
    sum_partials,
    tensor_parallel_numerics,
    vocab_parallel_token_logprobs,
)
from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import NumericsMismatchError, RowReduceConfig
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


def _trainer(
    w: dict[str, torch.Tensor], k_slices: int, vocab_shards: int, column_shards: int = 1, layers: int = LAYERS
) -> torch.Tensor:
    """The unsharded trainer: full weights on one process, S-slice kernels (``column_shards``: the
    slices of the column-parallel layers' input gradient; the forward does not depend on it)."""

    def column(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return column_sharded_linear(h, weight, num_shards=column_shards)

    x = w["x"]
    for i in range(layers):
        h = rms_norm(x, w[f"attn_norm{i}"])
        attn = _attention(w, i, column(h, w[f"q{i}"]), column(h, w[f"k{i}"]), column(h, w[f"v{i}"]))
        x = x + linear(attn, w[f"o{i}"], k_slices=k_slices)
        h = rms_norm(x, w[f"norm{i}"])
        a = silu_mul(column(h, w[f"gate{i}"]), column(h, w[f"up{i}"]))
        x = x + linear(a, w[f"down{i}"], k_slices=k_slices)
    logits = column(rms_norm(x, w["norm_f"]), w["lm_head"])
    return sharded_token_logprobs(logits, w["labels"], vocab_shards, TEMPERATURE, config=CHUNK)


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].contiguous()


class _AllReduceSum(torch.autograd.Function):
    """Megatron's row-parallel reduction: the ranks' outputs (model dtype) summed by all_reduce."""

    @staticmethod
    def forward(ctx, out):
        out = out.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's column-parallel input: identity forward, all_reduce of the input gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _row(a: torch.Tensor, w_shard: torch.Tensor, stock: bool) -> torch.Tensor:
    if not stock:
        return row_parallel_linear(a, w_shard)
    return _AllReduceSum.apply(linear(a, w_shard))


def _column(h: torch.Tensor, w_shard: torch.Tensor, stock: bool) -> torch.Tensor:
    if not stock:
        return column_parallel_linear(h, w_shard)
    return linear(_CopyToTensorParallel.apply(h), w_shard)


#: Parameters sharded by tensor parallelism: the dimension split across ranks.
SHARD_DIM = {"q": 0, "k": 0, "v": 0, "gate": 0, "up": 0, "o": 1, "down": 1, "lm_head": 0}
#: The sharded weights of layer 0 (the backward test runs one layer).
SHARD_DIM_0 = tuple(f"{p}0" for p in SHARD_DIM if p != "lm_head")


def _local_weights(w: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's weights: its shards of the TP-sharded matrices, the rest replicated."""
    local = {}
    for name, value in w.items():
        dim = SHARD_DIM.get(name.rstrip("0123456789"))
        local[name] = value if dim is None else _shard(value, dim, rank, world)
    return local


def _tp_forward(w: dict[str, torch.Tensor], rank: int, world: int, stock: bool, layers: int = LAYERS) -> torch.Tensor:
    """This rank's TP forward; ``w`` holds this rank's shards (:func:`_local_weights`)."""
    x = w["x"]
    for i in range(layers):
        h = rms_norm(x, w[f"attn_norm{i}"])
        q, k, v = (_column(h, w[f"{p}{i}"], stock) for p in "qkv")
        attn = _attention(w, i, q, k, v)  # this rank's HEADS / world query heads
        x = x + _row(attn, w[f"o{i}"], stock)
        h = rms_norm(x, w[f"norm{i}"])
        a = silu_mul(_column(h, w[f"gate{i}"], stock), _column(h, w[f"up{i}"], stock))  # INTER / world columns
        x = x + _row(a, w[f"down{i}"], stock)
    logits_shard = column_parallel_linear(rms_norm(x, w["norm_f"]), w["lm_head"])
    return vocab_parallel_token_logprobs(logits_shard, w["labels"], None, TEMPERATURE, config=CHUNK)


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _worker(rank: int, world: int, port: int, models: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    _init(rank, world, port)
    try:
        with torch.no_grad():
            result = {
                (name, kind): _tp_forward(_local_weights(w, rank, world), rank, world, stock=kind == "stock")
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


#: Weights that get no gradient in the backward test: the per-head q/k norms act inside the TP
#: region on a rank's heads only, so a rank's gradient of them is partial (summing those is the
#: trainer's business, outside samepath's TP helpers).
FROZEN = ("q_norm", "k_norm")


def _leaves(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = {}
    for name, value in w.items():
        trained = value.is_floating_point() and name != "adv" and not name.startswith(FROZEN)
        leaves[name] = value.detach().clone().requires_grad_(trained)
    return leaves


def _loss_and_grads(w: dict[str, torch.Tensor], logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    (logprobs * w["adv"]).sum().backward()
    grads = {name: t.grad for name, t in w.items() if t.grad is not None}
    return {"logprobs": logprobs.detach(), **grads}


def _grad_worker(rank: int, world: int, port: int, models: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    _init(rank, world, port)
    try:
        result: dict = {}
        for name, w in models.items():
            for kind in ("samepath", "stock") if name == "bf16" else ("samepath",):
                local = _leaves(_local_weights(w, rank, world))
                logprobs = _tp_forward(local, rank, world, stock=kind == "stock", layers=1)
                result[name, kind] = _loss_and_grads(local, logprobs)
        assert_same_numerics_across_group(world)
        try:  # rank 0 claims the TP degree, the other ranks say they run k_slices=1
            assert_same_numerics_across_group(world if rank == 0 else 1)
        except NumericsMismatchError as exc:
            result["mismatch"] = str(exc)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp_backward_equals_one_process_s_slice_trainer_and_group_checks_numerics(tmp_path):
    world = 2
    models = {"bf16": _weights(torch.bfloat16, seed=4), "fp32": _weights(torch.float32, seed=4)}
    for w in models.values():
        w["adv"] = torch.randn(TOKENS, generator=torch.Generator().manual_seed(5))
    mp.spawn(_grad_worker, args=(world, _free_port(), models, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    def trainer(name: str, column_shards: int) -> dict[str, torch.Tensor]:
        w = _leaves(models[name])
        logprobs = _trainer(w, k_slices=world, vocab_shards=world, column_shards=column_shards, layers=1)
        return _loss_and_grads(w, logprobs)

    for name in models:
        expected = trainer(name, column_shards=world)
        assert set(expected) == {"logprobs", "x", "attn_norm0", "norm0", "norm_f", "lm_head", *SHARD_DIM_0}
        for rank, res in enumerate(results):
            got = res[name, "samepath"]
            assert set(got) == set(expected)
            for key, full in expected.items():
                assert torch.isfinite(full).all()
                dim = SHARD_DIM.get(key.rstrip("0123456789"))
                want = full if dim is None else _shard(full, dim, rank, world)
                assert torch.equal(got[key], want), f"rank {rank}: {name} gradient of {key} differs"
        if name == "fp32":
            # Negative control: the column-parallel input gradient summed in one serial loop over
            # N (linear's own backward) instead of the ranks' fp32 partials in rank order.
            plain = trainer(name, column_shards=1)
            assert torch.equal(plain["logprobs"], expected["logprobs"])
            assert not torch.equal(plain["x"], expected["x"])
        else:
            # Negative control: stock TP (Megatron-style all-reduces of bf16 outputs and input gradients).
            assert not torch.equal(results[0][name, "stock"]["x"], expected["x"])
    for res in results:
        assert "tensor_parallel_size 2" in res["mismatch"] and "tensor_parallel_size 1" in res["mismatch"]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_logprobs_gradient_is_close_to_fp64_and_one_shard_equals_token_logprobs(dtype):
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(2, 3, 128, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 128, (2, 3), generator=gen)
    labels[1, 0] = -100
    weights = torch.randn(2, 3, generator=gen)
    (one,) = torch.autograd.grad(
        (sharded_token_logprobs(logits, labels, 1, TEMPERATURE, config=CHUNK) * weights).sum(), logits
    )
    (stock,) = torch.autograd.grad((token_logprobs(logits, labels, TEMPERATURE, config=CHUNK) * weights).sum(), logits)
    assert one.dtype == dtype and torch.equal(one, stock)
    ref_logits = logits.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_logits / TEMPERATURE, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    (ref_grad,) = torch.autograd.grad((ref * (labels != -100) * weights).sum(), ref_logits)
    for shards in (2, 4):
        (got,) = torch.autograd.grad(
            (sharded_token_logprobs(logits, labels, shards, TEMPERATURE, config=CHUNK) * weights).sum(), logits
        )
        assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))  # ignore_index: no gradient
        assert (got.double() - ref_grad).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_column_sharded_linear_input_gradient_is_the_rank_order_sum():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen).requires_grad_()
    weight = (torch.randn(256, 64, generator=gen) * 0.1).requires_grad_()
    bias = torch.randn(256, generator=gen).requires_grad_()
    grad_out = torch.randn(5, 256, generator=gen)
    out = column_sharded_linear(x, weight, bias, num_shards=2)
    grads = torch.autograd.grad(out, (x, weight, bias), grad_out)
    plain_out = linear(x, weight, bias)
    plain = torch.autograd.grad(plain_out, (x, weight, bias), grad_out)
    assert torch.equal(out, plain_out) and torch.equal(grads[1], plain[1]) and torch.equal(grads[2], plain[2])
    shards = zip(grad_out.chunk(2, -1), weight.detach().chunk(2, 0), strict=True)
    partials = [matmul(g, w, out_dtype=torch.float32) for g, w in shards]
    assert torch.equal(grads[0], sum_partials(partials, None, torch.float32))
    assert (grads[0].double() - grad_out.double() @ weight.detach().double()).abs().max() < 1e-5
    # Negative control: linear's own backward (one serial loop over N = 256, 8 block_k tiles) differs.
    assert not torch.equal(grads[0], plain[0])


def test_tensor_parallel_numerics_and_argument_errors():
    assert tensor_parallel_numerics(4) == {
        "tensor_parallel_size": 4,
        "k_slices": 4,
        "vocab_shards": 4,
        "grad_input_slices": 4,
    }
    assert tensor_parallel_numerics(1) != tensor_parallel_numerics(2)
    for bad in (0, -2, True, 2.0, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            tensor_parallel_numerics(bad)
    with pytest.raises(ValueError, match="num_shards"):
        column_sharded_linear(torch.randn(2, 8), torch.randn(6, 8), num_shards=4)
    with pytest.raises(ValueError, match="w_shard"):
        row_parallel_linear(torch.randn(2, 8), torch.randn(6, 4))
    with pytest.raises(ValueError, match="x_shard"):
        row_parallel_linear(torch.tensor(1.0), torch.randn(6, 4))
