"""Expert parallelism (gloo processes on the CPU, the all-to-all exchange): EP = k equals the
one-process experts bit for bit, forward and backward, with replicated tokens (the gradients of the
hidden states, the routing weights and every rank's expert weights equal the one-process grouped
backward's for the same experts) and with each rank's own tokens (the one-process layer on them, the
expert-weight gradients accumulated over the ranks' micro-batches); a tiny MoE block on
TP x EP layouts equals one device (logits, log-probs, gradients); the EP formulas are in the
fingerprint."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import samepath
from samepath.distributed import (
    column_parallel_linear,
    column_sharded_linear,
    expert_parallel_experts,
    expert_parallel_splits,
    row_parallel_linear,
    sharded_token_logprobs,
    token_chunks,
    vocab_parallel_token_logprobs,
)
from samepath.integrations import moe
from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import OP_FORMULAS, NumericsMismatchError, RowReduceConfig
from samepath.kernels.grouped_matmul import (
    GroupedExpertsFunction,
    combine_in_expert_order,
    expert_projections,
    expert_sum,
    grouped_linear,
)
from samepath.kernels.matmul import linear
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul_backward

EXPERTS, TOP_K, TOKENS, HIDDEN, INTER = 8, 4, 19, 40, 24


def _layer(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    router_logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    index, weights = moe.topk_softmax_routing(router_logits, TOP_K, renormalize=True, dtype=dtype)
    return {
        "hidden": torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype),
        "gate_up": (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype),
        "down": (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5).to(dtype),
        "index": index,
        "weights": weights,
    }


def _one_process(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    with samepath.batch_invariant(), torch.no_grad():
        return moe.experts_forward(layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


GRAD_NAMES = ("hidden", "weights", "gate_up", "down")

#: ``tokens="local"``: how many of the layer's tokens each rank holds (in rank order; a rank with none).
LOCAL_TOKENS = {2: [11, 8], 4: [7, 0, 5, 7]}


def _rows(world: int, rank: int) -> slice:
    sizes = LOCAL_TOKENS[world]
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _leaves(
    layer: dict[str, torch.Tensor], experts: slice = slice(None), rows: slice = slice(None)
) -> dict[str, torch.Tensor]:
    """The layer's differentiable inputs (``experts``: this rank's expert weights; ``rows``: its
    tokens) as fresh leaves."""
    leaves = {name: layer[name][rows].detach().clone().requires_grad_() for name in ("hidden", "weights")}
    for name in ("gate_up", "down"):
        leaves[name] = layer[name][experts].detach().clone().requires_grad_()
    return leaves


def _grads(out: torch.Tensor, leaves: dict[str, torch.Tensor], upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    (out.float() * upstream).sum().backward()
    return {"out": out.detach(), **{name: leaves[name].grad for name in GRAD_NAMES}}


def _one_process_grads(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = _leaves(layer)
    with samepath.batch_invariant():
        out = GroupedExpertsFunction.apply(
            leaves["hidden"], leaves["gate_up"], leaves["down"], layer["index"], leaves["weights"]
        )
    return _grads(out, leaves, layer["upstream"])


def _one_process_micro_batches(layer: dict[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    """One process, all experts, the ranks' tokens as micro-batches in rank order with the expert
    weights' gradients accumulated by autograd (what an FSDP + EP trainer's one-device twin runs):
    per micro-batch its output and its tokens' gradients, the accumulated weight gradients in each."""
    experts = {name: layer[name].detach().clone().requires_grad_() for name in ("gate_up", "down")}
    results = []
    for rank in range(world):
        rows = _rows(world, rank)
        leaves = {**_leaves(layer, rows=rows), **experts}
        if rows.stop == rows.start:  # an empty micro-batch adds nothing
            results.append({"out": layer["hidden"][rows], "hidden": leaves["hidden"], "weights": leaves["weights"]})
            continue
        with samepath.batch_invariant():
            out = GroupedExpertsFunction.apply(
                leaves["hidden"], experts["gate_up"], experts["down"], layer["index"][rows], leaves["weights"]
            )
        results.append(_grads(out, leaves, layer["upstream"][rows]))
    for result in results:
        result.update({name: experts[name].grad for name in ("gate_up", "down")})
    return results


def _worker(rank: int, world: int, port: int, layers: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    """Each layer on this rank: ``tokens="replicated"`` forward (no grad, the rollout's call) and
    forward + backward, and ``tokens="local"`` forward + backward on this rank's tokens."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = EXPERTS // world
        experts = slice(rank * local, (rank + 1) * local)
        result = {}
        for name, w in layers.items():
            with torch.no_grad():
                result["no_grad", name] = expert_parallel_experts(
                    w["hidden"], w["gate_up"][experts], w["down"][experts], w["index"], w["weights"], EXPERTS
                )
            leaves = _leaves(w, experts)
            out = expert_parallel_experts(
                leaves["hidden"], leaves["gate_up"], leaves["down"], w["index"], leaves["weights"], EXPERTS
            )
            result["replicated", name] = _grads(out, leaves, w["upstream"])
            rows = _rows(world, rank)
            leaves = _leaves(w, experts, rows)
            out = expert_parallel_experts(
                leaves["hidden"],
                leaves["gate_up"],
                leaves["down"],
                w["index"][rows],
                leaves["weights"],
                EXPERTS,
                tokens="local",
            )
            result["local", name] = _grads(out, leaves, w["upstream"][rows])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _layers() -> dict[str, dict[str, torch.Tensor]]:
    layers = {"bf16": _layer(torch.bfloat16, 5), "fp32": _layer(torch.float32, 6)}
    for seed, layer in enumerate(layers.values()):
        layer["upstream"] = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + seed))
    layers["bf16"]["index"][3] = layers["bf16"]["index"][3, 0]  # a token routed top_k times to one expert
    return layers


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world: int, tmp_path) -> None:
    """EP = 2 and 4 over gloo through the all-to-all, one spawn: with replicated tokens the output
    (with and without autograd), the hidden-state and routing-weight gradients equal the one-process
    grouped layer's on every rank and each rank's expert-weight gradients are its slice of the
    one-process ones; with each rank's own tokens (one rank without any at EP = 4) its output and
    its tokens' gradients equal the one-process layer on them, the expert-weight gradients the
    one-process accumulation over the ranks' micro-batches."""
    layers = _layers()
    mp.spawn(_worker, args=(world, _free_port(), layers, str(tmp_path)), nprocs=world, join=True)
    local = EXPERTS // world
    for name, layer in layers.items():
        want = _one_process_grads(layer)
        assert torch.equal(want["out"], _one_process(layer)), "the recorded forward is the inference forward"
        micro = _one_process_micro_batches(layer, world)
        assert all(torch.isfinite(g).all() for g in want.values())
        for rank in range(world):
            result = torch.load(tmp_path / f"rank{rank}.pt")
            experts = slice(rank * local, (rank + 1) * local)
            assert torch.equal(result["no_grad", name], want["out"]), f"EP-{world} rank {rank} {name}: no-grad out"
            got = result["replicated", name]
            for key in ("out", "hidden", "weights"):
                assert torch.equal(got[key], want[key]), f"EP-{world} rank {rank} {name}: {key} differs"
            for key in ("gate_up", "down"):
                assert torch.equal(got[key], want[key][experts]), f"EP-{world} rank {rank} {name}: d{key} differs"
            got = result["local", name]
            assert got["out"].shape[0] == LOCAL_TOKENS[world][rank]
            assert torch.equal(got["out"], want["out"][_rows(world, rank)]), "a row does not depend on the batch"
            for key in ("out", "hidden", "weights"):
                assert torch.equal(got[key], micro[rank][key]), f"EP-{world} local rank {rank} {name}: {key} differs"
            for key in ("gate_up", "down"):
                expected = micro[rank][key][experts]
                assert torch.equal(got[key], expected), f"EP-{world} local rank {rank} {name}: d{key} differs"


def test_negative_controls_other_combines() -> None:
    """The harness can fail: adding a token's pairs in the activation dtype (the previous formula),
    in slot order, or each rank's pairs first and the ranks' partial sums after (an all_reduce of
    bf16 partials, vLLM's stock EP) gives other bits than the one-process fp32 combine; and the
    local layout's expert-weight gradient, folded over all ranks' tokens at once (one micro-batch),
    differs from the accumulation over the ranks' micro-batches."""
    layer = _layer(torch.bfloat16, 3)
    want = _one_process(layer)
    with torch.no_grad():
        proj = expert_projections(layer["hidden"], layer["gate_up"], layer["down"], layer["index"])
    bf16_terms = (proj.expert_out * layer["weights"].reshape(-1, 1)).to(torch.bfloat16)
    assert torch.equal(expert_sum(proj.expert_out, layer["weights"], layer["index"], torch.bfloat16), want)
    assert not torch.equal(combine_in_expert_order(bf16_terms, layer["index"]), want)
    per_slot = bf16_terms.view(TOKENS, TOP_K, HIDDEN)
    slot_order = torch.zeros(TOKENS, HIDDEN)
    for slot in range(TOP_K):
        slot_order = slot_order + per_slot[:, slot].float()
    assert not torch.equal(slot_order.to(torch.bfloat16), want)
    owner = layer["index"] // (EXPERTS // 2)
    rank_partials = [torch.zeros_like(want), torch.zeros_like(want)]
    for slot in range(TOP_K):
        for rank in (0, 1):
            rank_partials[rank] = rank_partials[rank] + torch.where(owner[:, slot, None] == rank, per_slot[:, slot], 0)
    assert not torch.equal(rank_partials[0] + rank_partials[1], want)
    layer = _layers()["bf16"]
    accumulated, one_batch = _one_process_micro_batches(layer, 2)[-1], _one_process_grads(layer)
    assert not torch.equal(accumulated["gate_up"], one_batch["gate_up"])


def test_expert_parallel_splits_count_the_routed_pairs() -> None:
    """The exchange's split sizes: entry [o, c] counts the pairs of chunk c's tokens routed to rank
    o's experts (brute force), and the replicated layout moves fewer bytes than an all_gather of
    every rank's pair rows."""
    layer = _layer(torch.bfloat16, 11)
    for world in (1, 2, 4):
        splits = expert_parallel_splits(layer["index"], EXPERTS, world)
        sizes = token_chunks(TOKENS, world)
        assert sum(sizes) == TOKENS and splits.sum() == TOKENS * TOP_K
        for owner in range(world):
            for chunk in range(world):
                tokens = layer["index"][sum(sizes[:chunk]) : sum(sizes[: chunk + 1])]
                assert splits[owner, chunk] == int((tokens // (EXPERTS // world) == owner).sum())
        moved = splits.sum() - splits.diagonal().sum()  # pair rows that leave their rank
        assert moved < (world - 1) * world * TOKENS * TOP_K or world == 1


def test_bad_arguments_are_named(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = _layer(torch.float32, 4)
        with pytest.raises(ValueError, match="num_experts"):
            expert_parallel_experts(
                layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], 0
            )
        with pytest.raises(ValueError, match="this rank's 8 experts"):
            expert_parallel_experts(
                layer["hidden"], layer["gate_up"][:4], layer["down"], layer["index"], layer["weights"], EXPERTS
            )
        with torch.no_grad():
            alone = expert_parallel_experts(
                layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], EXPERTS
            )
        assert torch.equal(alone, _one_process(layer))
        with pytest.raises(ValueError, match="tokens = 'sharded'"):
            expert_parallel_experts(
                layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], 8, tokens="sharded"
            )
        with torch.no_grad():
            alone = expert_parallel_experts(
                layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], 8, tokens="local"
            )
        assert torch.equal(alone, _one_process(layer))
    finally:
        dist.destroy_process_group()


def test_negative_control_rank_partials_of_the_input_gradient() -> None:
    """The harness can fail: each rank's pairs' input-gradient rows summed first (fp32, what an
    all_reduce / reduce_scatter of per-rank partials computes) and the two partials added after
    gives other bits than each token's pairs added in ascending expert order."""
    layer = _layers()["fp32"]
    want = _one_process_grads(layer)["hidden"]
    with torch.no_grad():
        proj = expert_projections(layer["hidden"], layer["gate_up"], layer["down"], layer["index"])
        grad_expert_out = layer["upstream"].repeat_interleave(TOP_K, 0) * layer["weights"].reshape(-1, 1)
        grad_act = grouped_linear(grad_expert_out, layer["down"].transpose(1, 2), proj.plan, rows_per_pair=True)
        gate, up = proj.gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(proj.gate_up)
        silu_mul_backward(gate, up, grad_act, *grad_gate_up.chunk(2, dim=-1))
        rows = grouped_linear(grad_gate_up, layer["gate_up"].transpose(1, 2), proj.plan, rows_per_pair=True)
    assert torch.equal(combine_in_expert_order(rows, layer["index"]), want), "the pairs' rows are the backward's"
    owner = (layer["index"] // (EXPERTS // 2)).reshape(-1, 1)
    partials = [combine_in_expert_order(torch.where(owner == rank, rows, 0), layer["index"]) for rank in (0, 1)]
    assert not torch.equal(partials[0] + partials[1], want)


# ----------------------------------------------------------------------------------------------
# Tensor x expert parallelism: a tiny MoE block on a TP x EP grid, and mismatched layouts
# ----------------------------------------------------------------------------------------------

#: The block: attention (q, k, v column-parallel by heads, GQA, rotary, packed varlen attention,
#: o_proj row-parallel), a replicated router, the routed experts (expert-parallel), lm_head
#: (vocab-parallel) and token logprobs. Two packed sequences of 7 and 5 tokens.
B_TOKENS, B_HIDDEN, B_HEADS, B_KV_HEADS, B_HEAD_DIM, B_VOCAB = 12, 48, 4, 2, 32, 128
B_CU_SEQLENS = torch.tensor([0, 7, 12], dtype=torch.int32)
B_POSITIONS = torch.tensor([*range(7), *range(5)])
B_CHUNK = RowReduceConfig(vocab_chunk=32)
B_SHARD_DIM = {"q": 0, "k": 0, "v": 0, "o": 1, "lm_head": 0}


def _block_weights(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    q_width, kv_width = B_HEADS * B_HEAD_DIM, B_KV_HEADS * B_HEAD_DIM
    return {
        "x": randn(B_TOKENS, B_HIDDEN, scale=1.0),
        "labels": torch.randint(0, B_VOCAB, (B_TOKENS,), generator=gen),
        "attn_norm": (1 + torch.randn(B_HIDDEN, generator=gen) * 0.1).to(dtype),
        "norm": (1 + torch.randn(B_HIDDEN, generator=gen) * 0.1).to(dtype),
        "norm_f": (1 + torch.randn(B_HIDDEN, generator=gen) * 0.1).to(dtype),
        "q": randn(q_width, B_HIDDEN, scale=B_HIDDEN**-0.5),
        "k": randn(kv_width, B_HIDDEN, scale=B_HIDDEN**-0.5),
        "v": randn(kv_width, B_HIDDEN, scale=B_HIDDEN**-0.5),
        "o": randn(B_HIDDEN, q_width, scale=q_width**-0.5),
        "router": randn(EXPERTS, B_HIDDEN, scale=B_HIDDEN**-0.5),
        "gate_up": randn(EXPERTS, 2 * INTER, B_HIDDEN, scale=B_HIDDEN**-0.5),
        "down": randn(EXPERTS, B_HIDDEN, INTER, scale=INTER**-0.5),
        "lm_head": randn(B_VOCAB, B_HIDDEN, scale=B_HIDDEN**-0.5 * 4),
    }


def _block(
    w: dict[str, torch.Tensor],
    column: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    experts: Callable[..., torch.Tensor],
    logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [tokens, V], logprobs [tokens])`` of the block; ``w`` holds whichever shards the
    layout gives this process, the four callables run its dense, expert and logprob layers."""
    x = w["x"]
    h = rms_norm(x, w["attn_norm"])
    q, k, v = (column(h, w[p]).view(B_TOKENS, -1, B_HEAD_DIM) for p in "qkv")
    cos, sin = rotary_cos_sin(B_POSITIONS, B_HEAD_DIM, 10000.0, q.dtype)
    q, k = apply_rotary(q, k, cos, sin)
    x = x + row(varlen_attention(q, k, v, B_CU_SEQLENS).reshape(B_TOKENS, -1), w["o"])
    h = rms_norm(x, w["norm"])
    index, weights = moe.topk_softmax_routing(linear(h, w["router"]), TOP_K, renormalize=True, dtype=h.dtype)
    x = x + experts(h, w["gate_up"], w["down"], index, weights)
    logits = column(rms_norm(x, w["norm_f"]), w["lm_head"])
    return logits, logprobs(logits, w["labels"])


def _leaves_and_grads(local: dict[str, torch.Tensor], upstream: torch.Tensor | None):
    """``local`` as fresh leaves (floating ones differentiable when ``upstream`` is given) and a
    function that back-propagates ``(logprobs * upstream).sum()`` and returns their gradients."""
    if upstream is None:
        return local, lambda logprobs: {}
    leaves = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in local.items()}

    def grads(logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
        (logprobs * upstream).sum().backward()
        return {f"d{name}": t.grad for name, t in leaves.items() if t.grad is not None}

    return leaves, grads


def _block_trainer(
    w: dict[str, torch.Tensor], k_slices: int, upstream: torch.Tensor | None = None, column_shards: int | None = None
) -> dict:
    """One process, all weights: the S-slice kernels of a TP-S rollout (and of its backward:
    ``column_sharded_linear``, ``column_shards`` default S), the one-process experts.
    ``{"logits", "logprobs", "d<weight>"...}``."""
    column_shards = k_slices if column_shards is None else column_shards
    leaves, grads = _leaves_and_grads(w, upstream)
    with samepath.batch_invariant(), torch.set_grad_enabled(upstream is not None):
        logits, logprobs = _block(
            leaves,
            lambda h, weight: column_sharded_linear(h, weight, num_shards=column_shards),
            lambda a, weight: linear(a, weight, k_slices=k_slices),
            moe.experts_forward,
            lambda logits, labels: sharded_token_logprobs(logits, labels, k_slices, 0.7, config=B_CHUNK),
        )
        return {"logits": logits.detach(), "logprobs": logprobs.detach(), **grads(logprobs)}


def _layout_slices(tp_rank: int, tp_size: int, ep_rank: int, ep_size: int) -> dict[str, Callable]:
    """How this rank's copy of each weight is cut from the full one (absent: replicated)."""
    cuts: dict[str, Callable] = {}
    if tp_size > 1:
        for name, dim in B_SHARD_DIM.items():
            cuts[name] = lambda t, dim=dim: t.chunk(tp_size, dim=dim)[tp_rank].contiguous()
    experts = slice(ep_rank * EXPERTS // ep_size, (ep_rank + 1) * EXPERTS // ep_size)
    cuts["gate_up"] = cuts["down"] = lambda t: t[experts].contiguous()
    return cuts


def _block_parallel(
    w: dict[str, torch.Tensor],
    tp_group,
    ep_group,
    tp_size: int,
    ep_size: int,
    k_slices: int,
    upstream: torch.Tensor | None = None,
) -> dict:
    """This rank of a TP x EP layout: dense layers tensor-parallel over ``tp_group`` (or, with
    ``tp_size == 1``, the one-process ``k_slices`` kernels), experts over ``ep_group``; with
    ``upstream``, the gradients of this rank's weights too."""
    tp_rank, ep_rank = dist.get_rank(tp_group) if tp_size > 1 else 0, dist.get_rank(ep_group)
    cuts = _layout_slices(tp_rank, tp_size, ep_rank, ep_size)
    local, grads = _leaves_and_grads({n: cuts[n](t) if n in cuts else t for n, t in w.items()}, upstream)

    def run_experts(h, gate_up, down, index, weights):
        return expert_parallel_experts(h, gate_up, down, index, weights, EXPERTS, ep_group)

    with samepath.batch_invariant(), torch.set_grad_enabled(upstream is not None):
        if tp_size == 1:
            logits, logprobs = _block(
                local,
                lambda h, weight: column_sharded_linear(h, weight, num_shards=k_slices),
                lambda a, weight: linear(a, weight, k_slices=k_slices),
                run_experts,
                lambda logits, labels: sharded_token_logprobs(logits, labels, k_slices, 0.7, config=B_CHUNK),
            )
        else:
            logits, logprobs = _block(
                local,
                lambda h, weight: column_parallel_linear(h, weight, group=tp_group),
                lambda a, weight: row_parallel_linear(a, weight, tp_group),
                run_experts,
                lambda logits, labels: vocab_parallel_token_logprobs(logits, labels, tp_group, 0.7, config=B_CHUNK),
            )
            logits = torch.cat(_all_gather(logits.detach(), tp_group), dim=-1)
        return {"logits": logits.detach(), "logprobs": logprobs.detach(), **grads(logprobs)}


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _grid_worker(rank: int, world: int, port: int, models: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    """4 ranks: a 2 x 2 grid (TP groups {0, 1}, {2, 3}; EP groups {0, 2}, {1, 3}). 2 ranks: the
    rollout's TP 2 x EP 1 and the trainer's EP 2 x TP 1 (``k_slices = 2``), in turn."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        if world == 4:
            tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            tp_group, ep_group = tp_groups[rank // 2], ep_groups[rank % 2]
            for name, w in models.items():
                result[name, "tp2xep2"] = _block_parallel(w, tp_group, ep_group, 2, 2, 2, w["upstream"])
        else:
            alone = [dist.new_group([0]), dist.new_group([1])][rank]
            for name, w in models.items():
                result[name, "tp2xep1"] = _block_parallel(w, None, alone, 2, 1, k_slices=2)
                result[name, "ep2xtp1"] = _block_parallel(w, None, None, 1, 2, 2, w["upstream"])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _block_models() -> dict[str, dict[str, torch.Tensor]]:
    models = {"bf16": _block_weights(torch.bfloat16, 8), "fp32": _block_weights(torch.float32, 9)}
    for seed, w in enumerate(models.values()):
        w["upstream"] = torch.randn(B_TOKENS, generator=torch.Generator().manual_seed(20 + seed))
    return models


#: Where each rank of a layout sits: (tp_rank, tp_size, ep_rank, ep_size) by layout and rank.
LAYOUT_RANKS = {
    "tp2xep2": lambda rank: (rank % 2, 2, rank // 2, 2),
    "tp2xep1": lambda rank: (rank, 2, 0, 1),
    "ep2xtp1": lambda rank: (0, 1, rank, 2),
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: ~2 min here
def test_tp_x_ep_layouts_equal_one_device(world: int, tmp_path) -> None:
    """World 4: a 2 x 2 TP x EP grid, forward and backward; world 2: a rollout at TP 2 x EP 1
    (forward) and a trainer at EP 2 x TP 1 running the TP-2 numerics with k_slices=2 (forward and
    backward). Logits, log-probs and every rank's weight gradients (its shard / experts of the
    one-device gradient; replicated weights and the input whole) equal the one-device trainer's,
    so the layouts equal each other."""
    models = _block_models()
    mp.spawn(_grid_worker, args=(world, _free_port(), models, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    layouts = {"tp2xep2"} if world == 4 else {"tp2xep1", "ep2xtp1"}
    assert all(set(res) == {(name, layout) for name in models for layout in layouts} for res in results)
    trained = {
        "dx",
        "dattn_norm",
        "dnorm",
        "dnorm_f",
        "dq",
        "dk",
        "dv",
        "do",
        "drouter",
        "dgate_up",
        "ddown",
        "dlm_head",
    }
    for name, w in models.items():
        want = _block_trainer({n: t for n, t in w.items() if n != "upstream"}, 2, w["upstream"])
        assert torch.isfinite(want["logprobs"]).all() and set(want) == {"logits", "logprobs", *trained}
        for rank, res in enumerate(results):
            for (model, layout), got in res.items():
                if model != name:
                    continue
                cuts = _layout_slices(*LAYOUT_RANKS[layout](rank))
                assert set(got) == (set(want) if layout != "tp2xep1" else {"logits", "logprobs"})
                for key, value in got.items():
                    full = want[key]
                    expected = cuts[key[1:]](full) if key.startswith("d") and key[1:] in cuts else full
                    assert torch.equal(value, expected), f"rank {rank} {layout} {name}: {key} differs"
    # Negative controls (fp32): the unsharded k_slices=1 trainer's log-probs, and the input gradient
    # of a trainer whose column-parallel layers use linear's own backward, differ from the TP-2 layouts'.
    fp32 = {n: t for n, t in models["fp32"].items() if n != "upstream"}
    assert not torch.equal(_block_trainer(fp32, k_slices=1)["logprobs"], _block_trainer(fp32, 2)["logprobs"])
    upstream = models["fp32"]["upstream"]
    plain, want = _block_trainer(fp32, 2, upstream, column_shards=1), _block_trainer(fp32, 2, upstream)
    assert torch.equal(plain["logprobs"], want["logprobs"]) and not torch.equal(plain["dx"], want["dx"])


def test_fingerprint_covers_the_expert_parallel_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE combine (fp32, ascending expert order), the EP exchange and the EP backward are
    fingerprinted (and no EP degree is: EP = k is EP = 1), so a side whose formula differs — its
    pairs added in slot order or in the activation dtype — is refused."""
    changes = {
        ("moe", "combine"): ("ascending expert order", "slot order"),
        ("moe", "backward"): ("ascending expert order", "slot order"),
        ("distributed", "expert_parallel"): ("all_to_all_single", "all_gather"),
        ("distributed", "expert_parallel_backward"): ("ascending expert order", "slot order"),
    }
    assert "fp32" in OP_FORMULAS["moe"]["combine"]
    mine = samepath.fingerprint()
    for (op, key), (was, now) in changes.items():
        assert was in OP_FORMULAS[op][key], (op, key)
        other = dict(OP_FORMULAS[op], **{key: OP_FORMULAS[op][key].replace(was, now)})
        with monkeypatch.context() as patch:
            patch.setitem(OP_FORMULAS, op, other)
            theirs = samepath.fingerprint()
        assert theirs != mine, key
        with pytest.raises(NumericsMismatchError, match="numerics fingerprint mismatch"):
            samepath.assert_same_numerics(theirs)
    samepath.assert_same_numerics(mine)
