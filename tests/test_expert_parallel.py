"""Expert parallelism (gloo processes on the CPU): EP = k equals the one-process experts bit for bit,
forward and backward (the gradients of the hidden states, the routing weights and every rank's
expert weights equal the one-process grouped backward's for the same experts)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import samepath
from samepath.distributed import expert_parallel_experts
from samepath.integrations import moe
from samepath.kernels.grouped_matmul import (
    GroupedExpertsFunction,
    combine_in_expert_order,
    expert_projections,
    grouped_linear,
    routed_pair_outputs,
)
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


def _worker(rank: int, world: int, port: int, layers: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = EXPERTS // world
        experts = slice(rank * local, (rank + 1) * local)
        with torch.no_grad():
            result = {
                name: expert_parallel_experts(
                    w["hidden"], w["gate_up"][experts], w["down"][experts], w["index"], w["weights"], EXPERTS
                )
                for name, w in layers.items()
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
def test_expert_parallel_equals_one_process(world: int, tmp_path) -> None:
    layers = {"bf16": _layer(torch.bfloat16, 1), "fp32": _layer(torch.float32, 2)}
    mp.spawn(_worker, args=(world, _free_port(), layers, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, layer in layers.items():
            assert torch.equal(result[name], _one_process(layer)), f"EP-{world} rank {rank} {name} differs from EP-1"


def test_negative_controls_other_combine_orders() -> None:
    """The harness can fail: adding a token's pairs in slot order, or each rank's pairs first and
    the ranks' partial sums after (a reduce of bf16 partials), gives other bits than EP = 1."""
    layer = _layer(torch.bfloat16, 3)
    want = _one_process(layer)
    with torch.no_grad():
        pairs = routed_pair_outputs(layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"])
    per_slot = pairs.view(TOKENS, TOP_K, HIDDEN)
    slot_order = torch.zeros_like(want)
    for slot in range(TOP_K):
        slot_order = slot_order + per_slot[:, slot]
    assert not torch.equal(slot_order, want)
    owner = layer["index"] // (EXPERTS // 2)
    rank_partials = [torch.zeros_like(want), torch.zeros_like(want)]
    for slot in range(TOP_K):
        for rank in (0, 1):
            rank_partials[rank] = rank_partials[rank] + torch.where(owner[:, slot, None] == rank, per_slot[:, slot], 0)
    assert not torch.equal(rank_partials[0] + rank_partials[1], want)


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
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

GRAD_NAMES = ("hidden", "weights", "gate_up", "down")


def _leaves(layer: dict[str, torch.Tensor], experts: slice = slice(None)) -> dict[str, torch.Tensor]:
    """The layer's differentiable inputs (``experts``: this rank's expert weights) as fresh leaves."""
    leaves = {name: layer[name].detach().clone().requires_grad_() for name in ("hidden", "weights")}
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


def _grad_worker(rank: int, world: int, port: int, layers: dict[str, dict[str, torch.Tensor]], out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = EXPERTS // world
        result = {}
        for name, layer in layers.items():
            leaves = _leaves(layer, slice(rank * local, (rank + 1) * local))
            out = expert_parallel_experts(
                leaves["hidden"], leaves["gate_up"], leaves["down"], layer["index"], leaves["weights"], EXPERTS
            )
            result[name] = _grads(out, leaves, layer["upstream"])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _grad_layers() -> dict[str, dict[str, torch.Tensor]]:
    layers = {"bf16": _layer(torch.bfloat16, 5), "fp32": _layer(torch.float32, 6)}
    for seed, layer in enumerate(layers.values()):
        layer["upstream"] = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + seed))
    layers["bf16"]["index"][3] = layers["bf16"]["index"][3, 0]  # a token routed top_k times to one expert
    return layers


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_backward_equals_one_process_grouped_backward(world: int, tmp_path) -> None:
    layers = _grad_layers()
    mp.spawn(_grad_worker, args=(world, _free_port(), layers, str(tmp_path)), nprocs=world, join=True)
    local = EXPERTS // world
    for name, layer in layers.items():
        want = _one_process_grads(layer)
        assert all(torch.isfinite(g).all() for g in want.values())
        for rank in range(world):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            experts = slice(rank * local, (rank + 1) * local)
            for key in ("out", "hidden", "weights"):
                assert torch.equal(got[key], want[key]), f"EP-{world} rank {rank} {name}: {key} differs"
            for key in ("gate_up", "down"):
                assert torch.equal(got[key], want[key][experts]), f"EP-{world} rank {rank} {name}: d{key} differs"


def test_negative_control_rank_partials_of_the_input_gradient() -> None:
    """The harness can fail: each rank's pairs' input-gradient rows summed first (fp32, what an
    all_reduce / reduce_scatter of per-rank partials computes) and the two partials added after
    gives other bits than each token's pairs added in ascending expert order."""
    layer = _grad_layers()["fp32"]
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
