"""``batch_invariant()`` under the ``.out`` / in-place overloads and ``torch.compile``.

Compiled code calls the ``.out`` overloads (Inductor's ``extern_kernels.mm(a, b, out=buf)``), so
the block routes them too; a graph in which Inductor would compute a routed op with its own kernel
is refused by name rather than run with other bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import samepath
from samepath.kernels import routing
from samepath.kernels.matmul import ROUTED_CALLS
from samepath.kernels.routing import OVERRIDES, CompiledRoutingError, variants

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def test_every_override_has_its_out_variant_found() -> None:
    """Each routed functional op's ``.out`` (and ``addmm``'s in-place) overload is found by schema."""
    found = {name: variants(name) for name, _ in OVERRIDES}
    assert found["mm"] == [("mm.out", "out")]
    assert found["addmm"] == [("addmm.out", "out"), ("addmm_", "inplace")]
    assert found["sum.dim_IntList"] == [("sum.IntList_out", "out")]
    assert found["var_mean.correction"] == [("var_mean.correction_out", "out")]
    assert all(any(kind == "out" for _, kind in v) for v in found.values()), found


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_and_inplace_matmuls_equal_the_routed_kernel(dtype: torch.dtype) -> None:
    """``torch.mm(a, b, out=c)``, ``addmm(out=)``, ``addmm_``, ``bmm(out=)`` inside the block equal
    samepath's eager matmul bit for bit (unaligned shapes); outside the block, torch's kernel
    (the negative control: it differs)."""
    a, b = _randn(37, 1024, dtype=dtype, seed=1), _randn(1024, 129, dtype=dtype, seed=2)
    bias = _randn(37, 129, dtype=dtype, seed=3)
    a3, b3 = _randn(3, 13, 1024, dtype=dtype, seed=4), _randn(3, 1024, 33, dtype=dtype, seed=5)
    ours = samepath.matmul(a, b)
    ROUTED_CALLS.clear()
    with samepath.batch_invariant():
        mm_out = torch.mm(a, b, out=_empty(dtype))
        sized = torch.empty(37, 129, dtype=dtype)
        torch.mm(a, b, out=sized)  # an out= of the right shape is written in place
        addmm_out = torch.addmm(bias, a, b, out=_empty(dtype))
        addmm_eager = torch.addmm(bias, a, b)
        inplace = bias.clone().addmm_(a, b)
        bmm_out = torch.bmm(a3, b3, out=_empty(dtype))
        bmm_eager = torch.bmm(a3, b3)
    assert ROUTED_CALLS["mm"] == 2 and ROUTED_CALLS["addmm"] == 3 and ROUTED_CALLS["bmm"] == 2
    assert torch.equal(mm_out, ours) and torch.equal(sized, ours)
    assert torch.equal(addmm_out, addmm_eager) and torch.equal(inplace, addmm_eager)
    assert torch.equal(bmm_out, bmm_eager)
    assert torch.equal(bmm_out[1], samepath.matmul(a3[1], b3[1]))
    # negative control: outside the block the .out overloads are torch's again
    ROUTED_CALLS.clear()
    stock = torch.mm(a, b, out=_empty(dtype))
    assert not ROUTED_CALLS
    if dtype != torch.float32:  # fp32 may round alike; bf16/fp16 at K = 1024 do not
        assert not torch.equal(stock, ours)


def test_out_overloads_of_every_routed_op_reach_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``.out`` / in-place overload of every entry of OVERRIDES runs samepath's override
    (a spy around each) and equals the functional call bit for bit; none does outside the block."""
    calls: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(routing, "OVERRIDES", [(name, spy(name, fn)) for name, fn in OVERRIDES])
    x = _randn(5, 300, dtype=torch.bfloat16, seed=6)
    x32 = x.float()
    out_calls = {
        "_log_softmax": lambda: torch.ops.aten._log_softmax.out(x, -1, False, out=_empty(torch.bfloat16)),
        "_softmax": lambda: torch.ops.aten._softmax.out(x, -1, False, out=_empty(torch.bfloat16)),
        "sum.dim_IntList": lambda: torch.sum(x32, -1, out=_empty(torch.float32)),
        "mean.dim": lambda: torch.mean(x32, -1, out=_empty(torch.float32)),
        "var.correction": lambda: torch.ops.aten.var.correction_out(x32, [-1], out=_empty(torch.float32)),
        "std.correction": lambda: torch.ops.aten.std.correction_out(x32, [-1], out=_empty(torch.float32)),
        "var_mean.correction": lambda: torch.ops.aten.var_mean.correction_out(
            x32, [-1], out0=_empty(torch.float32), out1=_empty(torch.float32)
        ),
        "std_mean.correction": lambda: torch.ops.aten.std_mean.correction_out(
            x32, [-1], out0=_empty(torch.float32), out1=_empty(torch.float32)
        ),
        "linalg_vector_norm": lambda: torch.linalg.vector_norm(x32, 2, -1, out=_empty(torch.float32)),
    }
    functional = {
        "_log_softmax": lambda: torch.ops.aten._log_softmax(x, -1, False),
        "_softmax": lambda: torch.ops.aten._softmax(x, -1, False),
        "sum.dim_IntList": lambda: torch.sum(x32, -1),
        "mean.dim": lambda: torch.mean(x32, -1),
        "var.correction": lambda: torch.ops.aten.var.correction(x32, [-1]),
        "std.correction": lambda: torch.ops.aten.std.correction(x32, [-1]),
        "var_mean.correction": lambda: torch.ops.aten.var_mean.correction(x32, [-1]),
        "std_mean.correction": lambda: torch.ops.aten.std_mean.correction(x32, [-1]),
        "linalg_vector_norm": lambda: torch.linalg.vector_norm(x32, 2, -1),
    }
    untested = {name for name, _ in OVERRIDES} - set(out_calls) - {"mm", "addmm", "bmm"}
    assert not untested, f"a routed op without an out= check here: {untested}"
    for name in out_calls:
        calls.clear()
        with samepath.batch_invariant():
            via_out, eager = out_calls[name](), functional[name]()
        assert calls == [name, name], (name, calls)
        for got, want in zip(*(((v,) if isinstance(v, torch.Tensor) else v) for v in (via_out, eager)), strict=True):
            assert torch.equal(got, want), name
        calls.clear()
        out_calls[name]()  # negative control: outside the block, torch's kernel
        assert calls == [], name


def test_uncovered_out_calls_get_torchs_kernel() -> None:
    """fp64 (not covered) through ``out=`` reaches torch's own kernel inside the block (the
    override's fallback does not recurse); an ``out`` of another dtype gets torch's refusal."""
    a, b = _randn(9, 40, dtype=torch.float64, seed=7), _randn(40, 11, dtype=torch.float64, seed=8)
    with samepath.batch_invariant():
        got = torch.mm(a, b, out=_empty(torch.float64))
        with pytest.raises(RuntimeError, match="dtype"):
            torch.mm(a.float(), b.float(), out=_empty(torch.float64))
    assert torch.equal(got, a @ b)
    bias, a32, b32 = _randn(11, dtype=torch.float32, seed=20), a.float(), b.float()
    with samepath.batch_invariant(), pytest.raises(RuntimeError, match="Bad in-place call"):
        bias.addmm_(a32, b32)  # a self that cannot hold the result: torch's refusal, not a resize


def _compiled(fn, *args, backend: str = "inductor"):
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend=backend, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()


def test_compiled_matmuls_equal_the_eager_routed_ones() -> None:
    """Inductor keeps mm / addmm / bmm whole and calls their ``.out`` overloads: inside the block the
    compiled matmul (64×1024×768 bf16, the issue's case; a biased linear; a bmm) equals the eager
    routed one; compiled outside the block, torch's kernel (the negative control)."""
    dtype = torch.bfloat16
    a, b = _randn(64, 1024, dtype=dtype, seed=9), _randn(1024, 768, dtype=dtype, seed=10)
    w, bias = b.t().contiguous()[:200], _randn(200, dtype=dtype, seed=11)
    a3, b3 = _randn(4, 16, 1024, dtype=dtype, seed=12), _randn(4, 1024, 24, dtype=dtype, seed=13)
    with samepath.batch_invariant():
        eager = (a @ b, F.linear(a, w, bias), torch.bmm(a3, b3))
        compiled = (
            _compiled(lambda x, y: x @ y, a, b),
            _compiled(lambda x, y, z: F.linear(x, y, z), a, w, bias),
            _compiled(torch.bmm, a3, b3),
        )
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(eager[0], samepath.matmul(a, b))
    assert not torch.equal(_compiled(lambda x, y: x @ y, a, b), eager[0])


def test_compiled_code_inductor_would_compute_itself_is_refused_by_name() -> None:
    """A softmax (Inductor decomposes it into its own reductions) or a one-row matmul (decomposed
    into a multiply and a sum) compiled with Inductor inside the block is refused, naming the op;
    with ``backend="aot_eager"`` every op runs through the routed kernels and equals eager. Outside
    the block the same compile runs (the check is gone)."""
    x = _randn(6, 257, dtype=torch.bfloat16, seed=14)
    row, b = _randn(1, 64, dtype=torch.float32, seed=15), _randn(64, 1, dtype=torch.float32, seed=16)
    softmax = lambda t: torch.softmax(t.float(), -1)  # noqa: E731
    with samepath.batch_invariant():
        eager = softmax(x)
        for fn, args in ((softmax, (x,)), (lambda p, q: p @ q, (row, b))):
            with pytest.raises(Exception, match=r"batch_invariant\(\).*aten::sum\.dim_IntList.*aot_eager") as info:
                _compiled(fn, *args)
            assert isinstance(info.value, CompiledRoutingError) or "CompiledRoutingError" in str(info.value)
        assert torch.equal(_compiled(softmax, x, backend="aot_eager"), eager)
    import torch._inductor.config as inductor_config

    assert inductor_config.post_grad_custom_pre_pass is None
    assert _compiled(softmax, x).shape == x.shape  # negative control: outside the block it compiles


# ----------------------------------------------------------------------------------------------
# torch.compile of a patched Hugging Face model
# ----------------------------------------------------------------------------------------------


def _model_case(arch: str, backend: str, prompts: list[int], new_tokens: int) -> None:
    """A patched tiny model compiled with ``backend``: its log-probs of the tokens the (eager,
    patched) ``generate`` sampled equal generate's on every token, right-padded and packed; its
    gradients equal the eager forward's. Negative control: the stock model differs."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    from test_integration_hf import random_prompts, rollout, tiny_model, trainer_packed, trainer_padded

    from samepath import integrations

    model = tiny_model(arch, torch.bfloat16, seed=3)
    integrations.patch_all(model)
    try:
        prompts_ = random_prompts(prompts, 20)
        generated, rollout_lp = rollout(model, prompts_, new_tokens, 0.7, seed=4)
        grads = {}
        for name, runner in (("eager", model), ("compiled", torch.compile(model, backend=backend))):
            model.zero_grad(set_to_none=True)
            padded = trainer_padded(runner, prompts_, generated, 0.7, grad=True)
            padded.sum().backward()
            grads[name] = [p.grad for p in model.parameters()]
            if name == "compiled":
                assert torch.equal(padded.detach(), rollout_lp)
                assert torch.equal(trainer_packed(runner, prompts_, generated, 0.7), rollout_lp)
        torch._dynamo.reset()
        assert all(g is not None for g in grads["eager"])
        for got, want in zip(grads["compiled"], grads["eager"], strict=True):
            assert torch.equal(got, want)
    finally:
        integrations.unpatch_all()
    stock_lp = trainer_padded(tiny_model(arch, torch.bfloat16, seed=3), prompts_, generated, 0.7)
    assert not torch.equal(stock_lp, rollout_lp)  # negative control: torch's kernels differ


def test_compiled_patched_qwen3_equals_generate_and_eager_gradients() -> None:
    """``torch.compile(model, backend="aot_eager")`` of a patched Qwen3 (left-padded rollout,
    right-padded and packed trainer batches, unaligned lengths)."""
    _model_case("qwen3", "aot_eager", [7, 2, 9, 4], 4)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "backend"), [("qwen3", "inductor"), ("qwen3_moe", "aot_eager")])
def test_compiled_patched_models_equal_generate_and_eager_gradients(arch: str, backend: str) -> None:
    """Qwen3 with Inductor (the glue between samepath's ops compiled to C++), Qwen3-MoE with
    aot_eager."""
    _model_case(arch, backend, [5, 11, 3], 4)


@pytest.mark.slow
def test_inductor_compile_of_patched_qwen3_moe_is_refused_by_name() -> None:
    """Qwen3-MoE's router (Hugging Face's softmax, top-k and renormalising sum) left in the graph:
    Inductor would compute its reductions with its own kernels, so the compile is refused."""
    with pytest.raises(Exception, match=r"batch_invariant\(\).*aten::sum\.dim_IntList"):
        _model_case("qwen3_moe", "inductor", [5, 3], 2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_rms_norm_custom_op_compiles_in_one_graph_with_eager_bits(backend: str) -> None:
    """``torch.ops.samepath.rms_norm`` (fake + autograd registrations, ``torch.library.opcheck``):
    ``fullgraph=True`` compiles a norm and the ops around it; forward and gradients equal eager's;
    negative control: torch's own RMSNorm differs."""
    from samepath.kernels.rms_norm import rms_norm

    x = _randn(5, 3, 200, dtype=torch.bfloat16, seed=17).requires_grad_()
    w = (1 + _randn(200, dtype=torch.bfloat16, seed=18)).requires_grad_()
    dy = _randn(5, 3, 200, dtype=torch.bfloat16, seed=19)

    def run(fn):
        x.grad = w.grad = None
        y = fn(x, w)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    eager = run(lambda a, b: rms_norm(a, b, 1e-6) * 2)
    torch._dynamo.reset()
    compiled = run(torch.compile(lambda a, b: rms_norm(a, b, 1e-6) * 2, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.samepath.rms_norm.default, (x.detach().view(15, 200), w.detach(), 1e-6, 0))
    stock = F.rms_norm(x.detach(), (200,), w.detach(), 1e-6) * 2
    assert not torch.equal(stock, eager[0])
