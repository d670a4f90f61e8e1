"""``batch_invariant()`` under the ``.out`` / in-place overloads and ``torch.compile``.

Compiled code calls the ``.out`` overloads (Inductor's ``extern_kernels.mm(a, b, out=buf)``), so
the block routes them too; a graph in which Inductor would compute a routed op with its own kernel
is refused by name rather than run with other bits.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import samepath
from samepath.kernels import routing
from samepath.kernels.matmul import ROUTED_CALLS
from samepath.kernels.opaque import CUSTOM_OPS, CompiledOpError, compile_opaque, compiled_by
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
# samepath's ops as torch.library custom ops
# ----------------------------------------------------------------------------------------------


class Recording:
    """A Dynamo backend that records the ``samepath::`` ops of every graph it is given, then
    compiles the graph with ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend, self.ops = backend, collections.Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("samepath."):
                self.ops[str(node.target).split(".")[1]] += 1
        return lookup_backend(self.backend)(gm, example_inputs)


@pytest.fixture(scope="module")
def dynamo_limits():
    """Room for Hugging Face's call sites (one code object, many guards), and an error rather than
    a silent fall back to eager should a frame still run out of it."""
    with torch._dynamo.config.patch(
        recompile_limit=64, accumulated_recompile_limit=1024, fail_on_recompile_limit_hit=True
    ):
        yield
    torch._dynamo.reset()


def _every_op(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One call of each samepath op a patched model makes (and the fused lm_head log-probs)."""
    from samepath.integrations.moe import experts_forward
    from samepath.kernels.attention import packed_attention, varlen_attention
    from samepath.kernels.clamped_swiglu import clamped_swiglu
    from samepath.kernels.gelu_tanh_mul import gelu_tanh_mul
    from samepath.kernels.logprobs import linear_token_logprobs
    from samepath.kernels.rms_norm import rms_norm
    from samepath.kernels.rotary import apply_rotary, mrope_cos_sin, rotary_cos_sin
    from samepath.kernels.softcap import softcap_logits
    from samepath.kernels.swiglu import silu_mul, swiglu

    t = tensors
    x = rms_norm(t["x"], t["norm_w"], 1e-6)  # [T, 64]
    gate, up = t["gate_up2"][:, :64], t["gate_up2"][:, 64:]
    cos, sin = rotary_cos_sin(t["pos"], 16, 10000.0, x.dtype, {"rope_type": "linear", "factor": 2.0})
    mcos, msin = mrope_cos_sin(t["pos"], 16, 10000.0, x.dtype, [2, 3, 3])
    q, k = apply_rotary(t["q"], t["k"], cos, sin, unsqueeze_dim=1)  # [T, H, 16]
    mq, mk = apply_rotary(t["q"], t["k"], mcos, msin, unsqueeze_dim=1)
    with torch.no_grad():
        last = packed_attention(q[t["last"]], k, t["v"], t["cu_q"], t["cu"], 0.25)
    return (
        silu_mul(x, up),
        gelu_tanh_mul(gate, up),
        swiglu(t["gate_up2"]),
        clamped_swiglu(t["gate_up2"], 7.0, 1.7),
        mq,
        mk,
        varlen_attention(q, k, t["v"], t["cu"], sinks=t["sinks"]),
        experts_forward(x, t["gate_up"], t["down"], t["idx"], t["wts"]),
        softcap_logits(t["logits"], 5.0),
        linear_token_logprobs(x, t["lm"], t["labels"], 0.7, softcap=3.0),
        last,
    )


def _op_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    T, E = 11, 4
    g = torch.Generator().manual_seed(21)

    def rand(*shape, scale=1.0, grad=True):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_(grad)

    probs = torch.randn(T, E, generator=g).softmax(-1)
    wts, idx = probs.topk(2, -1)
    return {
        "x": rand(T, 64),
        "norm_w": rand(64, scale=0.3),
        "pos": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]),
        "q": rand(T, 4, 16),
        "k": rand(T, 2, 16),
        "v": rand(T, 2, 16),
        "cu": torch.tensor([0, 4, 11], dtype=torch.int32),
        "cu_q": torch.tensor([0, 1, 2], dtype=torch.int32),
        "last": torch.tensor([3, 10]),
        "sinks": torch.randn(4, generator=g).requires_grad_(),
        "gate_up": rand(E, 96, 64, scale=0.125),
        "down": rand(E, 64, 48, scale=0.125),
        "idx": idx,
        "wts": (wts / wts.sum(-1, keepdim=True)).to(dtype).requires_grad_(),
        "lm": rand(37, 64, scale=0.125),
        "labels": torch.randint(0, 37, (T,), generator=g),
        "gate_up2": rand(T, 128),
        "logits": rand(T, 37, scale=8.0),
    }


def _run_and_grads(fn, tensors):
    outs = fn(tensors)
    leaves = [v for v in tensors.values() if v.requires_grad]
    gen = torch.Generator().manual_seed(5)
    seeds = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs[:-1]]
    grads = torch.autograd.grad(outs[:-1], leaves, seeds)
    return tuple(o.detach() for o in outs), grads


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_every_op_compiles_in_one_graph_with_eager_bits(backend: str) -> None:
    """Every samepath op a patched model calls (RMSNorm, SiLU·mul / SwiGLU / GELU-tanh·mul / clamped
    SwiGLU, rope cos/sin and mrope, rotary, varlen attention with sinks, packed attention, the
    grouped experts, soft-capping, the fused lm_head log-probs) under ``fullgraph=True``: one graph,
    each op one ``samepath::`` node; outputs and every input's gradient equal eager's bit for bit."""
    tensors = _op_tensors(torch.bfloat16)
    eager = _run_and_grads(_every_op, tensors)
    recording = Recording(backend)
    torch._dynamo.reset()
    try:
        with samepath.batch_invariant():  # as patch_all: Inductor rounds the glue like eager
            compiled_fn = torch.compile(_every_op, backend=recording, fullgraph=True, dynamic=False)
            compiled = _run_and_grads(compiled_fn, tensors)
    finally:
        torch._dynamo.reset()
    expected = {
        "rms_norm", "gated_mul", "rotary_cos_sin", "mrope_cos_sin", "rotary", "varlen_attention",
        "packed_attention", "grouped_experts", "softcap", "linear_token_logprobs",
    }  # fmt: skip
    assert set(recording.ops) == expected, recording.ops
    for got, want in zip(compiled[0] + compiled[1], eager[0] + eager[1], strict=True):
        assert torch.equal(got, want)


def test_stock_formulas_compiled_by_inductor_differ() -> None:
    """Negative control for the test above: Hugging Face's own SiLU·mul and rotary formulas compiled
    by Inductor (fp32 without the eager roundings between ops) differ from their eager bits, which
    samepath's ops keep."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from samepath.kernels.swiglu import silu_mul

    g, u = _randn(6, 9, 96, dtype=torch.bfloat16, seed=22), _randn(6, 9, 96, dtype=torch.bfloat16, seed=23)
    q, k = _randn(2, 4, 11, 32, dtype=torch.bfloat16, seed=24), _randn(2, 2, 11, 32, dtype=torch.bfloat16, seed=25)
    cos, sin = _randn(2, 11, 32, dtype=torch.bfloat16, seed=26), _randn(2, 11, 32, dtype=torch.bfloat16, seed=27)
    stock_mlp = lambda a, b: F.silu(a) * b  # noqa: E731
    torch._dynamo.reset()
    try:
        assert not torch.equal(torch.compile(stock_mlp, dynamic=False)(g, u), stock_mlp(g, u))
        assert not torch.equal(
            torch.compile(apply_rotary_pos_emb, dynamic=False)(q, k, cos, sin)[0],
            apply_rotary_pos_emb(q, k, cos, sin)[0],
        )
        assert torch.equal(torch.compile(silu_mul, dynamic=False)(g, u), stock_mlp(g, u))  # the HF bits, kept
    finally:
        torch._dynamo.reset()


def test_inductor_rounds_low_precision_glue_like_eager_inside_the_block() -> None:
    """A bf16 chain of adds (a gradient summed over three uses, residual adds) compiled by Inductor
    inside the block equals eager (``emulate_precision_casts`` is on while a block is open);
    negative controls: compiled outside the block it differs, and inside the block with the
    setting turned off the compile is refused by name."""
    import torch._inductor.config as inductor_config

    a, b, c = (_randn(64, 96, dtype=torch.bfloat16, seed=s) for s in (40, 41, 42))
    chain = lambda x, y, z: x + y + z  # noqa: E731
    eager = chain(a, b, c)
    assert inductor_config.emulate_precision_casts is False
    with samepath.batch_invariant():
        assert torch.equal(_compiled(chain, a, b, c), eager)
        with inductor_config.patch(emulate_precision_casts=False):
            with pytest.raises(Exception, match=r"emulate_precision_casts"):
                _compiled(chain, a, b, c)
    assert inductor_config.emulate_precision_casts is False
    assert not torch.equal(_compiled(chain, a, b, c), eager)


def test_custom_ops_pass_torch_library_opcheck() -> None:
    """``torch.library.opcheck`` (schema, fake implementation against the real one, autograd
    registration) on each differentiable op and the forward-only ones."""
    t = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in _op_tensors(torch.float32).items()}
    import samepath.kernels.grouped_matmul

    x, q = t["x"].requires_grad_(), t["q"].requires_grad_()
    strided_q = t["q"].transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # HF's [B*S, H, D] view
    cos, sin = (
        c.unsqueeze(1).expand(11, 4, 16).unsqueeze(0) for c in samepath.rotary_cos_sin(t["pos"], 16, 1e4, torch.float32)
    )
    cases = [
        (torch.ops.samepath.gated_mul.default, ("silu", x, x.detach() * 0.5, [])),
        (torch.ops.samepath.gated_mul.default, ("clamped_swiglu", x, x.detach(), [7.0, 1.7])),
        (torch.ops.samepath.rotary.default, (q.unsqueeze(0), cos, sin, False)),
        (torch.ops.samepath.rotary_cos_sin.default, (t["pos"], 16, 1e4, torch.bfloat16, None, True)),
        (torch.ops.samepath.mrope_cos_sin.default, (t["pos"], 16, 1e4, torch.float32, [2, 3, 3], None, False)),
        (torch.ops.samepath.softcap.default, (x, 5.0)),
        (
            torch.ops.samepath.varlen_attention.default,
            (q, t["k"], t["v"], t["cu"], t["sinks"], 0.25, True, None, None, True),
        ),
        (
            torch.ops.samepath.varlen_attention.default,
            (strided_q, t["k"], t["v"], t["cu"], None, 0.25, True, None, None, True),
        ),
        (
            torch.ops.samepath.packed_attention.default,
            (q[t["last"]], t["k"], t["v"], t["cu_q"], t["cu"], None, None, 0.25, True, None, None, True, None),
        ),
        (torch.ops.samepath.grouped_experts.default, (x, t["gate_up"], t["down"], t["idx"], t["wts"])),
        (
            torch.ops.samepath.linear_token_logprobs.default,
            (x, t["lm"], t["labels"], 0.7, -100, True, 4, True, None, True),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert {str(op).split(".")[1] for op, _ in cases} | {"rms_norm"} <= {name.split("::")[1] for name in CUSTOM_OPS}


# ----------------------------------------------------------------------------------------------
# What is refused under torch.compile
# ----------------------------------------------------------------------------------------------


def _compile_call(fn, *args):
    torch._dynamo.reset()
    try:  # not fullgraph: a refusal must stop the compile, not break the graph and run eagerly
        return torch.compile(fn, backend="aot_eager", dynamic=False)(*args)
    finally:
        torch._dynamo.reset()


def test_functions_without_a_custom_op_are_refused_by_name() -> None:
    """A samepath function with no custom op (wrapped by ``compile_opaque``), the fused residual
    RMSNorm, a tile ``config``, GPT-OSS's biased experts and the experts' eager-loop fallback are
    refused by name while Dynamo traces; each runs eagerly (the negative control: the refusal is
    the compile's, not the function's)."""
    from samepath.integrations.moe import experts_forward, module_experts_forward
    from samepath.kernels.attention import varlen_attention
    from samepath.kernels.config import attention_config
    from samepath.kernels.rms_norm import rms_norm

    x, w = _randn(3, 64, dtype=torch.bfloat16, seed=30), _randn(64, dtype=torch.bfloat16, seed=31)
    traced_only = compile_opaque(lambda a: a * 2)
    unrouted = compiled_by("no_such_route")(lambda a: a * 2)
    q = _randn(5, 2, 16, dtype=torch.bfloat16, seed=32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    cfg = attention_config(16, torch.bfloat16, q.device)
    biased = torch.nn.Module()
    biased.has_bias, biased.is_transposed, biased.is_concatenated, biased.has_gate = True, True, False, True
    biased.limit, biased.alpha = 7.0, 1.7
    idx, wts = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.float64)
    x64, gu64, dn64 = x.double(), torch.zeros(1, 8, 64, dtype=torch.float64), torch.zeros(1, 64, 4, dtype=torch.float64)
    cases = [
        (r"test_compile\.test_functions_without.*<lambda> is not a torch\.library custom op", traced_only, (x,)),
        (r"no_such_route has no torch\.library custom op", unrouted, (x,)),
        (r"rms_norm with residual=", lambda a, b: rms_norm(a, b, 1e-6, residual=a), (x, w)),
        (r"varlen_attention\(config=", lambda a: varlen_attention(a, a, a, cu, config=cfg), (q,)),
        (r"biased experts", lambda a: module_experts_forward(biased, a, idx, wts), (x,)),
        (r"eager loop\) under torch\.compile", lambda a: experts_forward(a, gu64, dn64, idx, wts), (x64,)),
    ]
    for pattern, fn, args in cases:
        with pytest.raises(CompiledOpError, match=pattern):
            _compile_call(fn, *args)
    traced_only(x), unrouted(x), rms_norm(x, w, 1e-6, residual=x), varlen_attention(q, q, q, cu, config=cfg)


# ----------------------------------------------------------------------------------------------
# torch.compile of a patched Hugging Face model
# ----------------------------------------------------------------------------------------------

MODEL_OPS = {
    "qwen3": {"rms_norm", "rotary_cos_sin", "rotary", "varlen_attention", "gated_mul"},
    "qwen3_moe": {"rms_norm", "rotary_cos_sin", "rotary", "varlen_attention", "grouped_experts"},
}


def _model_case(arch: str, backend: str, prompts: list[int], new_tokens: int) -> None:
    """A patched tiny model compiled with ``backend``: its log-probs of the tokens the (eager,
    patched) ``generate`` sampled equal generate's on every token, right-padded and packed; its
    parameter gradients equal the eager forward's; its graphs hold samepath's custom ops.
    Negative control: the stock model differs."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    from test_integration_hf import random_prompts, rollout, tiny_model, trainer_packed, trainer_padded

    from samepath import integrations

    model = tiny_model(arch, torch.bfloat16, seed=3)
    integrations.patch_all(model)
    recording = Recording(backend)
    try:
        prompts_ = random_prompts(prompts, 20)
        generated, rollout_lp = rollout(model, prompts_, new_tokens, 0.7, seed=4)
        grads = {}
        torch._dynamo.reset()
        for name, runner in (("eager", model), ("compiled", torch.compile(model, backend=recording, dynamic=False))):
            model.zero_grad(set_to_none=True)
            padded = trainer_padded(runner, prompts_, generated, 0.7, grad=True)
            padded.sum().backward()
            grads[name] = [p.grad for p in model.parameters()]
            if name == "compiled":
                assert torch.equal(padded.detach(), rollout_lp)
                assert torch.equal(trainer_packed(runner, prompts_, generated, 0.7), rollout_lp)
        assert MODEL_OPS[arch] <= set(recording.ops), recording.ops
        assert all(g is not None for g in grads["eager"])
        for got, want in zip(grads["compiled"], grads["eager"], strict=True):
            assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()
        integrations.unpatch_all()
    stock_lp = trainer_padded(tiny_model(arch, torch.bfloat16, seed=3), prompts_, generated, 0.7)
    assert not torch.equal(stock_lp, rollout_lp)  # negative control: torch's kernels differ


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_compiled_patched_model_equals_generate_and_eager_gradients(arch: str, dynamo_limits) -> None:
    """``torch.compile(model, backend="aot_eager")`` of a patched Qwen3 / Qwen3-MoE (left-padded
    rollout, right-padded and packed trainer batches, unaligned lengths)."""
    _model_case(arch, "aot_eager", [7, 2, 9, 4], 4)


@pytest.mark.slow
def test_inductor_compiled_patched_qwen3_equals_generate_and_eager_gradients(dynamo_limits) -> None:
    """Qwen3 with Inductor (the glue between samepath's custom ops compiled to C++)."""
    _model_case("qwen3", "inductor", [5, 11, 3], 4)


@pytest.mark.slow
def test_inductor_compile_of_patched_qwen3_moe_is_refused_by_name(dynamo_limits) -> None:
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


# ----------------------------------------------------------------------------------------------
# The hybrid linear-attention (Gated DeltaNet) and MLA ops
# ----------------------------------------------------------------------------------------------


def _hybrid_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Two packed sequences (5 and 70 tokens: one partial, one over a 64-token chunk), GQA value heads."""
    T, HK, HV, DK, DV, D, W = 75, 2, 4, 16, 16, 48, 4
    g = torch.Generator().manual_seed(41)

    def rand(*shape, scale=1.0, dt=dtype, grad=True):
        return (scale * torch.randn(*shape, generator=g)).to(dt).requires_grad_(grad)

    return {
        "x": rand(T, D),
        "conv_w": rand(D, W, scale=0.5),
        "conv_b": rand(D, scale=0.1),
        "conv_state": rand(2, D, W - 1, grad=False),
        "cu": torch.tensor([0, 5, T], dtype=torch.int32),
        "q": rand(T, HK, DK),
        "k": rand(T, HK, DK),
        "v": rand(T, HV, DV),
        "a": rand(T, HV),
        "b": rand(T, HV),
        "a_log": rand(HV, scale=0.5, dt=torch.float32),
        "dt_bias": rand(HV, scale=0.5, dt=torch.float32),
        "state": rand(2, HV, DK, DV, scale=0.1, dt=torch.float32),
        "z": rand(T, HV, DV),
        "norm_w": rand(DV, scale=0.3),
        "shared": rand(T, D),
        "shared_gate": rand(T, 1),
        "q_nope": rand(T, HK, 24),
        "q_pe": rand(T, HK, 8),
        "w_uk": rand(HK, 24, 32, scale=0.2),
        "w_uv": rand(HK, 16, 32, scale=0.2),
        "latent": rand(T, HK, 40),
    }


def _hybrid_ops(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One call of each Gated DeltaNet / gated / MLA op a patched Qwen3-Next, Qwen3.5 or DeepSeek-V3 makes,
    and a slot continuation (no grad, in place) whose output ends the tuple."""
    from samepath.kernels.causal_conv1d import causal_conv1d
    from samepath.kernels.gated_delta import GatedDeltaSlots, chunk_gated_delta, gated_delta_continue_slots
    from samepath.kernels.gated_ops import gated_delta_gates, gated_rms_norm, sigmoid_gate
    from samepath.kernels.mla import mla_output, mla_query

    conv, new_state = causal_conv1d(t["x"], t["conv_w"], t["conv_b"], t["cu"], t["conv_state"], "silu")
    g, beta = gated_delta_gates(t["a"], t["b"], t["a_log"], t["dt_bias"])
    out, boundary = chunk_gated_delta(t["q"], t["k"], t["v"], g, beta, t["cu"], t["state"], validate=False)
    normed = gated_rms_norm(out, t["z"], t["norm_w"], 1e-6)
    with torch.no_grad():
        slots = GatedDeltaSlots.allocate(3, 2, 4, 16, 16, t["q"].dtype)
        ids = torch.tensor([2, 0])
        first = gated_delta_continue_slots(t["q"], t["k"], t["v"], g, beta, t["cu"], slots, ids)
        one_each = torch.tensor([0, 1, 2], dtype=torch.int32)  # a decode step of both sequences
        step = gated_delta_continue_slots(t["q"][:2], t["k"][:2], t["v"][:2], g[:2], beta[:2], one_each, slots, ids)
    return (
        conv,
        normed,
        sigmoid_gate(t["shared"], t["shared_gate"]),
        mla_query(t["q_nope"], t["q_pe"], t["w_uk"]),
        mla_output(t["latent"], t["w_uv"]),
        new_state,
        boundary,
        first,
        step,
        slots.state,
        slots.tail_k,
        slots.tail_len,
    )


def _hybrid_run(fn, tensors):
    outs = fn(tensors)
    leaves = [v for v in tensors.values() if v.requires_grad]
    gen = torch.Generator().manual_seed(6)
    seeds = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs[:5]]
    grads = torch.autograd.grad(outs[:5], leaves, seeds)
    return tuple(o.detach() for o in outs), grads


HYBRID_OPS = {
    "causal_conv1d", "gated_delta_gates", "chunk_gated_delta", "gated_rms_norm", "sigmoid_gate", "batched_matmul",
    "gated_delta_continue_slots",
}  # fmt: skip


@pytest.mark.parametrize(("backend", "dtype"), [("inductor", torch.bfloat16), ("aot_eager", torch.float32)])
def test_gated_deltanet_and_mla_ops_compile_in_one_graph_with_eager_bits(backend: str, dtype: torch.dtype) -> None:
    """The causal conv1d (state, bias), the gates, the chunked delta rule (an initial state), the gated
    norm, the sigmoid gate (broadcast), MLA's query / output products and the slot continuation (in place)
    under ``fullgraph=True``: one graph, each a ``samepath::`` node; outputs, slot buffers and every input's
    gradient equal eager's bit for bit."""
    tensors = _hybrid_tensors(dtype)
    recording = Recording(backend)
    torch._dynamo.reset()
    try:
        with samepath.batch_invariant():  # as patch_all, for both runs (the gates' gradient sums are routed)
            eager = _hybrid_run(_hybrid_ops, tensors)
            compiled = _hybrid_run(
                torch.compile(_hybrid_ops, backend=recording, fullgraph=True, dynamic=False), tensors
            )
    finally:
        torch._dynamo.reset()
    assert set(recording.ops) >= HYBRID_OPS, recording.ops
    assert len(compiled[1]) == len(eager[1]) == 20
    for got, want in zip(compiled[0] + compiled[1], eager[0] + eager[1], strict=True):
        assert torch.equal(got, want)


def test_stock_gate_formulas_compiled_by_inductor_differ() -> None:
    """Negative control for the test above: the gates' and the gated norm's own torch formulas compiled by
    Inductor without samepath's ops (its fused ``exp`` / ``log1p``) differ from their eager bits."""
    from samepath.kernels.gated_ops import sigmoid

    x = _randn(4096, dtype=torch.float32, seed=42) * 4

    def formula(a):
        return (a * (a / (1.0 + torch.exp(-a)))) + sigmoid(a) * torch.log1p(torch.exp(a))

    torch._dynamo.reset()
    try:
        compiled = torch.compile(formula, backend="inductor", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert not torch.equal(compiled, formula(x))


def test_hybrid_and_mla_custom_ops_pass_torch_library_opcheck() -> None:
    """``torch.library.opcheck`` (schema, fake against real, autograd registration) on the Gated DeltaNet,
    gated and MLA ops, the in-place slot continuation included."""
    from samepath.kernels.gated_delta import GatedDeltaSlots

    t = _hybrid_tensors(torch.float32)
    x, w, bias, state, cu = t["x"], t["conv_w"], t["conv_b"], t["conv_state"], t["cu"]
    detached = {k: v.detach() for k, v in t.items()}
    g, beta = torch.ops.samepath.gated_delta_gates(detached["a"], detached["b"], t["a_log"], t["dt_bias"])
    slots = GatedDeltaSlots.allocate(3, 2, 4, 16, 16, torch.float32)
    fields = [slots.state, slots.tail_k, slots.tail_v, slots.tail_g, slots.tail_beta, slots.tail_len]
    d = detached
    cases = [
        (torch.ops.samepath.causal_conv1d.default, (x, w, bias, cu, state, "silu")),
        (torch.ops.samepath.causal_conv1d.default, (x, w, None, cu, None, None)),
        (torch.ops.samepath.gated_delta_gates.default, (t["a"], t["b"], t["a_log"], t["dt_bias"])),
        (
            torch.ops.samepath.chunk_gated_delta.default,
            (t["q"], t["k"], t["v"], g.requires_grad_(), beta.requires_grad_(), cu, t["state"], True),
        ),
        (torch.ops.samepath.chunk_gated_delta.default, (t["q"], t["k"], t["v"], g, beta, cu, None, False)),
        (torch.ops.samepath.gated_rms_norm.default, (d["v"].requires_grad_(), t["z"], t["norm_w"], 1e-6)),
        (torch.ops.samepath.sigmoid_gate.default, (t["shared"], t["shared_gate"])),
        (torch.ops.samepath.batched_matmul.default, (t["q_nope"].transpose(0, 1), t["w_uk"])),
        (
            torch.ops.samepath.gated_delta_continue_slots.default,
            (d["q"], d["k"], d["v"], g.detach(), beta.detach(), cu, *fields, torch.tensor([2, 0]), None),
        ),
    ]
    # MLA's attention: a value head (the latent, 32) narrower than the key head (latent + rope, 48)
    mla_q, mla_kv = t["latent"][:, :, :48].detach().clone(), t["latent"][:, :1, :48].detach().clone()
    mla_q.requires_grad_()
    mla_args = (mla_q, mla_kv, mla_kv[..., :32], cu, None, 0.2, True, None, None, True)
    cases.append((torch.ops.samepath.varlen_attention.default, mla_args))
    eager_mla = samepath.varlen_attention(mla_q.detach(), mla_kv, mla_kv[..., :32], cu, 0.2)
    assert eager_mla.shape == (75, 2, 32)
    assert torch.equal(torch.ops.samepath.varlen_attention(*mla_args)[0].detach(), eager_mla)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    packed_args = (mla_q.detach()[[4, 74]], mla_kv, mla_kv[..., :32], cu_q, cu, None, None, 0.2, True, None, None)
    cases.append((torch.ops.samepath.packed_attention.default, (*packed_args, True, None)))
    assert torch.equal(torch.ops.samepath.packed_attention(*packed_args, True, None), eager_mla[[4, 74]])
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert {str(op).split(".")[1] for op, _ in cases} <= {name.split("::")[1] for name in CUSTOM_OPS}
