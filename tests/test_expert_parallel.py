"""Expert parallelism (gloo processes on the CPU): EP = k equals the one-process experts bit for bit."""

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
from samepath.kernels.grouped_matmul import routed_pair_outputs

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
        with pytest.raises(NotImplementedError, match="forward only"):
            expert_parallel_experts(
                layer["hidden"].requires_grad_(), layer["gate_up"], layer["down"], layer["index"], layer["weights"], 8
            )
        with torch.no_grad():
            alone = expert_parallel_experts(
                layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], EXPERTS
            )
        assert torch.equal(alone, _one_process(layer))
    finally:
        dist.destroy_process_group()
