"""An FSDP2 + EP trainer of a Hugging Face Qwen3-MoE (two gloo processes on the CPU): each rank
holds half the experts (``samepath.integrations.expert_parallel.shard_experts``, the all-to-all
exchange with each rank's own tokens) and FSDP2 (``fully_shard``) shards the rest. Each rank's
logits and log-probs equal the one-process model's on its micro-batch, and after the backward the
dense gradients (FSDP's average over the ranks) and each rank's expert gradients equal a one-process
trainer accumulating the two micro-batches in rank order, bit for bit."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import samepath
from samepath import integrations

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")

WORLD, BATCH, SEQ, EXPERTS = 2, 2, 7, 8
CONFIG = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=EXPERTS,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG))
    with torch.no_grad():  # spread the logits out
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {
            "ids": torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen),
            "labels": torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen),
            "upstream": torch.randn(BATCH, SEQ, generator=gen),
        }
        for _ in range(WORLD)
    ]


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward (logits, token log-probs) and backward of ``(logprobs * upstream).sum()``."""
    logits = model(input_ids=batch["ids"]).logits
    logprobs = samepath.token_logprobs(logits, batch["labels"])
    (logprobs * batch["upstream"]).sum().backward()
    return {"logits": logits.detach(), "logprobs": logprobs.detach()}


def _is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from samepath.integrations.expert_parallel import shard_experts

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model().train()
        integrations.patch_all(model)
        experts = set(shard_experts(model))
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=experts)
        fully_shard(model, mesh=mesh, ignored_params=experts)
        result = _step(model, _batches()[rank])
        for name, param in model.named_parameters():
            grad = param.grad
            result["d" + name] = grad if _is_expert(name) else grad.full_tensor()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        integrations.unpatch_all()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_fsdp_and_expert_parallel_trainer_equals_one_process(tmp_path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    model = _model().train()
    batches = _batches()
    with integrations.patched(model):
        one = [_step(model, batch) for batch in batches]  # gradients accumulate over the micro-batches
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        concatenated = _model().train()
        integrations.patch_all(concatenated)
        both = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
        _step(concatenated, both)
    local = EXPERTS // WORLD
    assert len(grads) == len(results[0]) - 2 and all(torch.isfinite(g).all() for g in grads.values())
    for rank, result in enumerate(results):
        for key in ("logits", "logprobs"):
            assert torch.equal(result[key], one[rank][key]), f"rank {rank}: {key} differ"
        for name, grad in grads.items():
            if _is_expert(name):  # the sum over the micro-batches: this rank's experts
                want = grad[rank * local : (rank + 1) * local]
            else:  # FSDP's average over the ranks: exact halving
                want = grad / WORLD
            assert torch.equal(result["d" + name], want), f"rank {rank}: d{name} differs"
    # Negative controls: the stock Hugging Face experts (bf16-free, fp32 here: the combine adds
    # into the activations with index_add_ in the slot order of each expert's loop) give other
    # log-probs; one micro-batch of both ranks' tokens gives other expert gradients.
    stock = _model().train()
    stock.set_experts_implementation("eager")
    stock_lp = samepath.token_logprobs(stock(input_ids=batches[0]["ids"]).logits, batches[0]["labels"])
    assert not torch.equal(stock_lp.detach(), results[0]["logprobs"])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    one_batch = dict(concatenated.named_parameters())[name].grad
    assert not torch.equal(one_batch[:local], results[0]["d" + name])


def test_shard_experts_refuses_what_it_cannot_reproduce(tmp_path) -> None:
    """By name, before any weight is cut: an unpatched model (the stock loop would run on the
    shard), an unknown token layout, a model without experts, an expert count the group size does
    not divide, expert biases, a module sharded twice."""
    from samepath.integrations.expert_parallel import expert_shard, shard_experts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        with pytest.raises(ValueError, match="patch_all"):
            shard_experts(model)
        with integrations.patched(model):
            with pytest.raises(ValueError, match="tokens = 'sharded'"):
                shard_experts(model, tokens="sharded")
            dense = transformers.Qwen3ForCausalLM(
                transformers.Qwen3Config(**{k: v for k, v in CONFIG.items() if "expert" not in k and "moe" not in k})
            )
            with pytest.raises(ValueError, match="no experts module"):
                shard_experts(dense)
            experts = model.model.layers[0].mlp.experts
            last = model.model.layers[-1].mlp.experts
            last.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * CONFIG["moe_intermediate_size"]))
            with pytest.raises(ValueError, match="expert biases \\(gate_up_proj_bias\\)"):
                shard_experts(model)
            assert expert_shard(experts) is None, "nothing is cut when a later module is refused"
            last.gate_up_proj_bias = None
            params = shard_experts(model)  # one rank: every expert stays, the exchange runs
            assert len(params) == 2 * CONFIG["num_hidden_layers"] and expert_shard(experts).num_experts == EXPERTS
            with pytest.raises(ValueError, match="already sharded"):
                shard_experts(model)
    finally:
        dist.destroy_process_group()
    group_of_three = type("Group", (), {})()
    model = _model()
    with integrations.patched(model), pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "get_world_size", lambda group=None: 3)
        patch.setattr(dist, "get_rank", lambda group=None: 0)
        with pytest.raises(ValueError, match="num_experts = 8 is not a multiple of the group size 3"):
            shard_experts(model, group_of_three)
