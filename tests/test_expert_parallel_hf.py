"""An FSDP2 + EP trainer of a Hugging Face Qwen3-MoE (two gloo processes on the CPU): each rank
holds half the experts (``samepath.integrations.expert_parallel.shard_experts``, the all-to-all
exchange with each rank's own tokens) and FSDP2 (``fully_shard``) shards the rest. In fp32 and
bf16, each rank's logits and log-probs equal the one-process model's on its micro-batch, and after
the backward the dense gradients (FSDP's average over the ranks) and each rank's expert gradients
equal a one-process trainer accumulating the two micro-batches in rank order, bit for bit."""

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


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG))
    with torch.no_grad():  # spread the logits out
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model.to(dtype)


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
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for key, dtype in DTYPES.items():
            model = _model(dtype).train()
            integrations.patch_all(model)
            experts = set(shard_experts(model))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, ignored_params=experts)
            fully_shard(model, mesh=mesh, ignored_params=experts)
            result = results[key] = _step(model, _batches()[rank])
            for name, param in model.named_parameters():
                grad = param.grad
                result["d" + name] = grad if _is_expert(name) else grad.full_tensor()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        integrations.unpatch_all()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_process(dtype: torch.dtype) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The one-process trainer: each rank's micro-batch in rank order, gradients accumulated; and
    the expert gradients of one micro-batch holding both ranks' tokens."""
    batches = _batches()
    model, concatenated = _model(dtype).train(), _model(dtype).train()
    with integrations.patched(model):
        one = [_step(model, batch) for batch in batches]
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    with integrations.patched(concatenated):
        _step(concatenated, {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]})
    one_batch = {name: param.grad for name, param in concatenated.named_parameters() if _is_expert(name)}
    return one, grads, one_batch


def test_fsdp_and_expert_parallel_trainer_equals_one_process(tmp_path, monkeypatch) -> None:
    """fp32 and bf16. Negative controls: the previous combine (a token's pairs added in the
    activation dtype), and the stock Hugging Face model, give other log-probs; one micro-batch of
    both ranks' tokens gives other expert gradients."""
    from samepath.integrations import moe
    from samepath.kernels import grouped_matmul

    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    local = EXPERTS // WORLD
    for key, dtype in DTYPES.items():
        one, grads, one_batch = _one_process(dtype)
        assert len(grads) == len(results[0][key]) - 2 and all(torch.isfinite(g).all() for g in grads.values())
        for rank, result in enumerate(r[key] for r in results):
            for out in ("logits", "logprobs"):
                assert torch.equal(result[out], one[rank][out]), f"{key} rank {rank}: {out} differ"
            for name, grad in grads.items():
                if _is_expert(name):  # the sum over the micro-batches: this rank's experts
                    want = grad[rank * local : (rank + 1) * local]
                else:  # FSDP's average over the ranks: exact halving
                    want = grad / WORLD
                assert torch.equal(result["d" + name], want), f"{key} rank {rank}: d{name} differs"
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(one_batch[name][:local], results[0][key]["d" + name]), key
    batch = _batches()[0]
    stock = _model(torch.bfloat16).train()
    stock.set_experts_implementation("eager")
    stock_lp = samepath.token_logprobs(stock(input_ids=batch["ids"]).logits, batch["labels"])
    assert not torch.equal(stock_lp.detach(), results[0]["bf16"]["logprobs"])

    def activation_dtype_combine(expert_out, top_k_weights, top_k_index, dtype):
        terms = (expert_out * top_k_weights.reshape(-1, 1)).to(dtype)
        return grouped_matmul.combine_in_expert_order(terms, top_k_index)

    monkeypatch.setattr(grouped_matmul, "expert_sum", activation_dtype_combine)
    monkeypatch.setattr(moe, "expert_sum", activation_dtype_combine)
    model = _model(torch.bfloat16)
    with integrations.patched(model), torch.no_grad():
        previous = samepath.token_logprobs(model(input_ids=batch["ids"]).logits, batch["labels"])
    assert not torch.equal(previous, results[0]["bf16"]["logprobs"])


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
