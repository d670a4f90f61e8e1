"""Tensor-parallel experts (each expert's intermediate dimension sharded, vLLM's TP MoE): ranks over
gloo equal the one-process ``sliced_experts`` bit for bit; negative controls (another rank order, a
bf16 combine, the plain layer) differ; close to an fp64 reference forward and backward; the
Hugging Face trainer's ``tensor_parallel_numerics`` runs its experts sliced (or, with
``expert_parallel=True``, plain) and names what it refuses."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import samepath
from samepath.distributed import tensor_parallel_experts
from samepath.integrations import moe
from samepath.kernels import expert_slices
from samepath.kernels.expert_slices import expert_slice, expert_slice_partial, sliced_experts, sum_slices

EXPERTS, TOP_K, TOKENS, HIDDEN, INTER = 6, 2, 21, 40, 24


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


def _sliced(layer: dict[str, torch.Tensor], slices: int) -> torch.Tensor:
    with samepath.batch_invariant(), torch.no_grad():
        return sliced_experts(
            layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"], slices
        )


def _worker(rank: int, world: int, port: int, layers: dict, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        with samepath.batch_invariant(), torch.no_grad():
            for name, w in layers.items():
                gate_up, down = expert_slice(w["gate_up"], w["down"], rank, world)
                result[name] = tensor_parallel_experts(w["hidden"], gate_up, down, w["index"], w["weights"])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_experts_equal_the_one_process_slices(world: int, tmp_path) -> None:
    layers = {"bf16": _layer(torch.bfloat16, 1), "fp32": _layer(torch.float32, 2), "fp16": _layer(torch.float16, 3)}
    mp.spawn(_worker, args=(world, _free_port(), layers, str(tmp_path)), nprocs=world, join=True)
    for name, layer in layers.items():
        want = _sliced(layer, world)
        for rank in range(world):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert got.dtype == layer["hidden"].dtype
            assert torch.equal(got, want), (name, rank)


def test_negative_controls_rank_order_bf16_combine_and_the_plain_layer() -> None:
    """The same partials summed in another rank order (fp32, three slices: two adds commute, and a
    bf16 cast hides fp32 ulps), or each rounded to bf16 before the sum, or the one-process plain
    layer (expert outputs rounded before the combine) give other bits."""
    layer = _layer(torch.bfloat16, 4)
    args = (layer["index"], layer["weights"])
    with samepath.batch_invariant(), torch.no_grad():
        partials = {
            s: [
                expert_slice_partial(layer["hidden"], *expert_slice(layer["gate_up"], layer["down"], r, s), *args)
                for r in range(s)
            ]
            for s in (2, 3)
        }
        plain = moe.experts_forward(layer["hidden"], layer["gate_up"], layer["down"], *args)
    for slices, parts in partials.items():
        assert torch.equal(sum_slices(parts, torch.bfloat16), _sliced(layer, slices))
    want = _sliced(layer, 2)
    fp32 = _layer(torch.float32, 4)
    with samepath.batch_invariant(), torch.no_grad():
        three = [
            expert_slice_partial(
                fp32["hidden"], *expert_slice(fp32["gate_up"], fp32["down"], r, 3), *args[:1], fp32["weights"]
            )
            for r in range(3)
        ]
    assert torch.equal(sum_slices(three, torch.float32), _sliced(fp32, 3))
    assert not torch.equal(sum_slices(three[::-1], torch.float32), _sliced(fp32, 3))
    assert not torch.equal(sum_slices([p.to(torch.bfloat16).float() for p in partials[2]], torch.bfloat16), want)
    assert not torch.equal(plain, want)


def _reference(layer: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp64 reference of the layer (any slicing)."""
    hidden, gate_up, down = (layer[k].double() for k in ("hidden", "gate_up", "down"))
    out = torch.zeros_like(hidden)
    for slot in range(TOP_K):
        expert = layer["index"][:, slot]
        gu = torch.einsum("th,tnh->tn", hidden, gate_up[expert])
        gate, up = gu.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        out += torch.einsum("ti,thi->th", act, down[expert]) * layer["weights"][:, slot, None].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_experts_forward_and_backward_are_close_to_fp64(dtype: torch.dtype) -> None:
    layer = _layer(dtype, 5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    leaves = {k: layer[k].clone().requires_grad_(True) for k in ("hidden", "gate_up", "down", "weights")}
    grad_out = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype)
    with samepath.batch_invariant():
        out = sliced_experts(leaves["hidden"], leaves["gate_up"], leaves["down"], layer["index"], leaves["weights"], 2)
        out.backward(grad_out)
    ref_leaves = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    ref = _reference({**ref_leaves, "index": layer["index"]})
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=tol)
    for name, leaf in leaves.items():
        scale = ref_leaves[name].grad.abs().max()
        torch.testing.assert_close(leaf.grad.double(), ref_leaves[name].grad, atol=tol * scale, rtol=tol)
    # Deterministic: a second backward gives the same bits.
    first = {k: v.grad.clone() for k, v in leaves.items()}
    for leaf in leaves.values():
        leaf.grad = None
    with samepath.batch_invariant():
        sliced_experts(
            leaves["hidden"], leaves["gate_up"], leaves["down"], layer["index"], leaves["weights"], 2
        ).backward(grad_out)
    assert all(torch.equal(first[k], leaves[k].grad) for k in leaves)


def test_bad_arguments_are_named() -> None:
    layer = _layer(torch.float32, 7)
    args = (layer["hidden"], layer["gate_up"], layer["down"], layer["index"], layer["weights"])
    with pytest.raises(ValueError, match="not divisible by slices=5"):
        sliced_experts(*args, 5)
    with pytest.raises(ValueError, match="slices must be a positive int"):
        sliced_experts(*args, 0)
    with pytest.raises(ValueError, match="not one set of experts"):
        sliced_experts(layer["hidden"], layer["gate_up"][:, :10], layer["down"], *args[3:], 2)
    with pytest.raises(ValueError, match="top_k_index"):
        sliced_experts(*args[:3], layer["index"][:3], layer["weights"], 2)
    with pytest.raises(NotImplementedError, match="no backward"):
        tensor_parallel_experts(layer["hidden"].requires_grad_(True), *args[1:])


def _tiny_qwen3_moe(dtype: torch.dtype, **overrides):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    from samepath.check.harness import DEFAULT_MODEL_CONFIG

    config = dict(DEFAULT_MODEL_CONFIG, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2)
    config.update({"moe_intermediate_size": 48, "norm_topk_prob": True, **overrides})
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).to(dtype).eval()


def test_trainer_tensor_parallel_numerics_slices_the_experts() -> None:
    """Under ``tensor_parallel_numerics(model, 2)`` each experts module runs ``sliced_experts``
    (its output equals the sliced call on the same inputs), the logits differ from TP 1's; with
    ``expert_parallel=True`` the experts keep the plain layer (only o_proj is sliced)."""
    from samepath import integrations
    from samepath.integrations.hf import tensor_parallel_numerics

    model = _tiny_qwen3_moe(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(1, 100, (1, 13), generator=torch.Generator().manual_seed(8))
    seen = []
    hook = experts.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    integrations.patch_all()
    try:
        with torch.no_grad():
            plain = model(input_ids=ids).logits
            with tensor_parallel_numerics(model, 2):
                sliced = model(input_ids=ids).logits
            with tensor_parallel_numerics(model, 2, expert_parallel=True):
                ep = model(input_ids=ids).logits
            assert "forward" not in vars(experts)
            (hidden, index, weights), out = seen[1]
            with samepath.batch_invariant():
                assert torch.equal(
                    out, sliced_experts(hidden, experts.gate_up_proj, experts.down_proj, index, weights, 2)
                )
                plain_out = moe.experts_forward(hidden, experts.gate_up_proj, experts.down_proj, index, weights)
            assert torch.equal(seen[2][1], plain_out) and not torch.equal(out, plain_out)
    finally:
        integrations.unpatch_all()
        hook.remove()
    assert not torch.equal(plain, sliced) and not torch.equal(sliced, ep)


def test_trainer_tensor_parallel_numerics_names_what_it_refuses(monkeypatch) -> None:
    from samepath.integrations.hf import tensor_parallel_numerics

    model = _tiny_qwen3_moe(torch.float32, moe_intermediate_size=50)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts has an expert intermediate size of 50"):
        with tensor_parallel_numerics(model, 4):
            pass
    with tensor_parallel_numerics(model, 2, expert_parallel=True):  # whole experts: any intermediate size
        pass
    experts = model.model.layers[0].mlp.experts
    experts.register_parameter("gate_up_proj_bias", torch.nn.Parameter(torch.zeros(4, 100)))
    with pytest.raises(ValueError, match=r"plain SwiGLU experts .*layers\.0\.mlp\.experts"):
        with tensor_parallel_numerics(model, 2):
            pass
    assert expert_slices.check_slices(50, 2) is None


def test_the_fingerprint_tells_sliced_from_expert_parallel_experts() -> None:
    """At S > 1 a rollout's experts are TP-sliced or expert-parallel, two numerics: the fingerprint
    tells them apart (and ``assert_same_numerics`` refuses the mix); at S = 1 there is one layer."""
    from samepath.kernels.config import NumericsMismatchError, tensor_parallel_size_of

    assert samepath.fingerprint(1, expert_parallel=True) == samepath.fingerprint(1)
    assert samepath.fingerprint(2, expert_parallel=True) != samepath.fingerprint(2)
    samepath.assert_same_numerics(samepath.fingerprint(2, expert_parallel=True), 2, expert_parallel=True)
    with pytest.raises(NumericsMismatchError):
        samepath.assert_same_numerics(samepath.fingerprint(2), 2, expert_parallel=True)
    assert tensor_parallel_size_of(samepath.fingerprint(4, expert_parallel=True)) == 4
