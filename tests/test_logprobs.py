"""Token logprobs, entropy and log-softmax: bit equality across batches, fp64 correctness, errors.

Every consistency claim is ``torch.equal``; every consistency harness has a negative control that
shows it can see a deliberate difference (a vocabulary chunk that depends on the batch size);
the stock torch formula is checked for closeness only, since its last bits are the machine's.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import triton

from samepath.kernels import config as config_module
from samepath.kernels.compile_check import compile_launch, record_launches
from samepath.kernels.config import RowReduceConfig
from samepath.kernels.logprobs import _log_softmax, log_softmax, token_logprobs

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BATCH_SIZES = (1, 2, 3, 7, 16, 33)
POOL = 40
#: Gradient tolerance relative to the largest reference magnitude (the gradient is cast to the
#: logits dtype); logprobs and entropy are fp32 for every input dtype.
GRAD_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
FP32_TOLERANCE = 1e-5


def _logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits scaled like a model's, with a few peaked rows (low entropy)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1, shape[-1])
    peaked = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 5),), generator=g)
    flat[peaked, torch.randint(0, shape[-1], (peaked.numel(),), generator=g)] += 25.0
    return x.to(dtype)


def _labels(shape: tuple[int, ...], vocab: int, seed: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed + 1000), dtype=dtype)


def _row_mismatches(fn, x: torch.Tensor, labels: torch.Tensor) -> list[tuple[int, int]]:
    """(batch size, row) pairs whose result inside a batch differs from the row computed alone.

    ``fn(logits, labels)`` returns a tuple of per-row tensors. Batches are windows of the pool at
    different offsets, so a row sits at different positions in different batches.
    """
    alone = [fn(x[i : i + 1], labels[i : i + 1]) for i in range(x.shape[0])]
    bad = []
    for m in BATCH_SIZES:
        start = (5 * m) % (x.shape[0] - m + 1)
        batch = fn(x[start : start + m], labels[start : start + m])
        for i in range(m):
            if not all(torch.equal(b[i : i + 1], a) for b, a in zip(batch, alone[start + i], strict=True)):
                bad.append((m, start + i))
    return bad


def _reference(x: torch.Tensor, labels: torch.Tensor, temperature: float):
    """fp64 log-softmax, token logprob and entropy (0 * log 0 taken as 0), differentiable."""
    logp = torch.log_softmax(x.double() / temperature, -1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
    return logp, logp.gather(-1, labels[..., None].long())[..., 0], entropy


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> None:
    limit = tolerance * max(expected.abs().max().item(), 1.0)
    err = (actual.double() - expected).abs().max().item()
    assert err <= limit, f"{what}: max error {err:.3g} > {limit:.3g}"


# ----------------------------------------------------------------------------------------------
# Batch invariance
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,temperature", [(1000, 1.0), (4097, 0.7)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_do_not_depend_on_the_batch(dtype: torch.dtype, vocab: int, temperature: float) -> None:
    x = _logits((POOL, vocab), dtype, seed=vocab)
    labels = _labels((POOL,), vocab, seed=vocab)

    def fn(xs, ls):
        lp, h = token_logprobs(xs, ls, temperature, return_entropy=True)
        # the entropy flag and the full log-softmax share the lse: same logprob bits
        assert torch.equal(token_logprobs(xs, ls, temperature), lp)
        assert torch.equal(log_softmax(xs, temperature).gather(-1, ls[:, None])[:, 0], lp)
        return lp, h

    assert _row_mismatches(fn, x, labels) == []


def test_negative_control_batch_dependent_chunk_is_detected() -> None:
    """The same harness, with a schedule that picks its vocabulary chunk from the batch size
    (as a split-by-batch kernel would), must report mismatches."""
    x = _logits((POOL, 4097), torch.float32, seed=3)
    labels = _labels((POOL,), 4097, seed=3)

    def batch_dependent(xs, ls):
        chunk = 4096 if xs.shape[0] == 1 else 256
        return token_logprobs(xs, ls, return_entropy=True, config=RowReduceConfig(vocab_chunk=chunk))

    assert len(_row_mismatches(batch_dependent, x, labels)) > 0


def test_stock_formula_is_close() -> None:
    """Stock torch (``log_softmax(x.float() / T).gather``) computes the same quantity; whether its
    last bits agree with samepath's depends on the machine's vectorisation, so only closeness is
    asserted (the negative controls above use deliberate differences)."""
    x = _logits((POOL, 4097), torch.bfloat16, seed=4)
    labels = _labels((POOL,), 4097, seed=4)
    ours = token_logprobs(x, labels, 0.7)
    stock = torch.log_softmax(x.float() / 0.7, -1).gather(-1, labels[:, None])[:, 0]
    _assert_close(stock, ours.double(), FP32_TOLERANCE, "stock vs samepath")


def test_large_vocabulary_rows_do_not_depend_on_the_batch() -> None:
    vocab = 151936  # Qwen's padded vocabulary: 37 full chunks and a partial one
    x = _logits((3, vocab), torch.bfloat16, seed=11)
    labels = _labels((3,), vocab, seed=11)
    lp, h = token_logprobs(x, labels, 0.7, return_entropy=True)
    for i in range(3):
        lp_i, h_i = token_logprobs(x[i : i + 1], labels[i : i + 1], 0.7, return_entropy=True)
        assert torch.equal(lp_i, lp[i : i + 1]) and torch.equal(h_i, h[i : i + 1])
    full = log_softmax(x, 0.7)
    assert torch.equal(full.gather(-1, labels[:, None])[:, 0], lp)
    ref_full, ref_lp, ref_h = _reference(x, labels, 0.7)
    _assert_close(lp, ref_lp, FP32_TOLERANCE, "logprob")
    _assert_close(h, ref_h, FP32_TOLERANCE, "entropy")
    _assert_close(full, ref_full, FP32_TOLERANCE, "log_softmax")


def test_any_strides_and_leading_dims() -> None:
    """``logits[:, :-1]`` (not viewable as 2-D), a strided vocabulary and int32 labels give the
    bits of the same rows computed alone and contiguous."""
    vocab = 700
    x = _logits((3, 6, vocab), torch.bfloat16, seed=21)
    labels = _labels((3, 6), vocab, seed=21)
    sliced, sliced_labels = x[:, :-1], labels[:, :-1]
    lp, h = token_logprobs(sliced, sliced_labels.to(torch.int32), 1.3, return_entropy=True)
    assert lp.shape == h.shape == (3, 5)
    column_major = x.reshape(-1, vocab).t().contiguous().t()  # stride(-1) == rows
    lp_cm, h_cm = token_logprobs(column_major, labels.reshape(-1), 1.3, return_entropy=True)
    ls = log_softmax(sliced, 1.3)
    for b in range(3):
        for t in range(5):
            lp_1, h_1 = token_logprobs(x[b, t][None].contiguous(), labels[b, t][None], 1.3, return_entropy=True)
            assert torch.equal(lp[b, t][None], lp_1) and torch.equal(h[b, t][None], h_1)
            assert torch.equal(lp_cm[b * 6 + t][None], lp_1) and torch.equal(h_cm[b * 6 + t][None], h_1)
            assert torch.equal(ls[b, t, labels[b, t]][None], lp_1)


# ----------------------------------------------------------------------------------------------
# Temperature
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.3, 0.3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_temperature_is_the_samplers_fp32_division(dtype: torch.dtype, temperature: float) -> None:
    """``x.float() / T`` as torch divides on the CPU, fed in with T = 1, gives the same bits:
    the kernel divides (not multiplies by the reciprocal), in fp32, before anything else."""
    x = _logits((5, 1500), dtype, seed=31)
    labels = _labels((5,), 1500, seed=31)
    pre = x.float() / temperature
    assert not torch.equal(pre, x.float() * (1.0 / temperature)), "pick a T where the two roundings differ"
    lp, h = token_logprobs(x, labels, temperature, return_entropy=True)
    lp_pre, h_pre = token_logprobs(pre, labels, return_entropy=True)
    assert torch.equal(lp, lp_pre) and torch.equal(h, h_pre)
    assert torch.equal(log_softmax(x, temperature), log_softmax(pre))


def _all_outputs(x: torch.Tensor, labels: torch.Tensor, temperature: float) -> list[torch.Tensor]:
    """Every kernel's result: token logprob and entropy with both gradients, log-softmax and its gradient."""
    leaf = x.clone().requires_grad_()
    lp, h = token_logprobs(leaf, labels, temperature, return_entropy=True)
    g = torch.Generator().manual_seed(62)
    (lp * torch.randn(lp.shape, generator=g) + h * torch.randn(h.shape, generator=g)).sum().backward()
    token_grad, leaf.grad = leaf.grad, None
    out = log_softmax(leaf, temperature)
    out.backward(torch.randn(out.shape, generator=g))
    return [lp.detach(), h.detach(), token_grad, out.detach(), leaf.grad]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_temperature_one_skips_the_division_with_the_same_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At T = 1 the kernels skip ``x / T`` (``SCALED=False``); every output and gradient equals the
    kernels that divide by 1 (the schedule before the skip), -inf / +inf / NaN logits included. Negative
    control: skipping the division at T = 0.7 is seen."""
    from samepath.kernels import logprobs as logprobs_module

    vocab = 4103
    x = _logits((3, 2, vocab), dtype, seed=61)
    x[0, 1, ::5] = float("-inf")
    x[2, 0, 7] = float("inf")
    x[1, 1, 3] = float("nan")
    labels = _labels((3, 2), vocab, seed=61)
    assert logprobs_module.scaled(1.0) is False and logprobs_module.scaled(0.7) is True
    skipped = _all_outputs(x, labels, 1.0)
    monkeypatch.setattr(logprobs_module, "scaled", lambda temperature: True)
    divided = _all_outputs(x, labels, 1.0)
    for a, b in zip(skipped, divided, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    warm = _all_outputs(x, labels, 0.7)
    monkeypatch.setattr(logprobs_module, "scaled", lambda temperature: False)
    assert not torch.equal(_all_outputs(x, labels, 0.7)[0], warm[0]), "negative control: T = 0.7 must divide"


# ----------------------------------------------------------------------------------------------
# Correctness and gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype, temperature: float) -> None:
    vocab = 4097
    x = _logits((2, 3, vocab), dtype, seed=41)
    x[0, 1, ::3] = float("-inf")  # a sampler's masked vocabulary
    labels = _labels((2, 3), vocab, seed=41)
    labels[0, 1] = 1  # a visible token of the masked row
    g = torch.Generator().manual_seed(42)
    w_lp, w_h = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)

    leaf = x.clone().requires_grad_()
    lp, h = token_logprobs(leaf, labels, temperature, return_entropy=True)
    (lp * w_lp + h * w_h).sum().backward()
    ref_leaf = x.double().requires_grad_()
    _, ref_lp, ref_h = _reference(ref_leaf, labels, temperature)
    (ref_lp * w_lp + ref_h * w_h).sum().backward()

    assert lp.dtype == h.dtype == torch.float32 and leaf.grad.dtype == dtype
    _assert_close(lp.detach(), ref_lp.detach(), FP32_TOLERANCE, "logprob")
    _assert_close(h.detach(), ref_h.detach(), FP32_TOLERANCE, "entropy")
    _assert_close(leaf.grad, ref_leaf.grad, GRAD_TOLERANCE[dtype], "dlogits")

    # each output alone (the other's gradient is None)
    for use_lp in (True, False):
        leaf.grad = ref_leaf.grad = None
        lp, h = token_logprobs(leaf, labels, temperature, return_entropy=True)
        _, ref_lp, ref_h = _reference(ref_leaf, labels, temperature)
        ((lp * w_lp).sum() if use_lp else (h * w_h).sum()).backward()
        ((ref_lp * w_lp).sum() if use_lp else (ref_h * w_h).sum()).backward()
        _assert_close(leaf.grad, ref_leaf.grad, GRAD_TOLERANCE[dtype], f"dlogits (logprob only: {use_lp})")
        if use_lp:  # without return_entropy: the same kernel, the same bits
            grad_lp_only = leaf.grad
            leaf.grad = None
            (token_logprobs(leaf, labels, temperature) * w_lp).sum().backward()
            assert torch.equal(leaf.grad, grad_lp_only)

    # the full log-softmax
    leaf.grad = ref_leaf.grad = None
    grad_out = torch.randn(x.shape, generator=g)
    out = log_softmax(leaf, temperature)
    out.backward(grad_out)
    ref_out, _, _ = _reference(ref_leaf, labels, temperature)
    ref_out.backward(grad_out.double())
    assert out.dtype == torch.float32
    finite = torch.isfinite(ref_out)
    assert torch.equal(torch.isfinite(out), finite)
    _assert_close(out.detach()[finite], ref_out.detach()[finite], FP32_TOLERANCE, "log_softmax")
    _assert_close(leaf.grad, ref_leaf.grad, GRAD_TOLERANCE[dtype], "log_softmax dlogits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_is_row_invariant_and_deterministic(dtype: torch.dtype) -> None:
    vocab, rows = 4097, 7
    x = _logits((rows, vocab), dtype, seed=51)
    labels = _labels((rows,), vocab, seed=51)
    g = torch.Generator().manual_seed(52)
    w_lp, w_h = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    w_full = torch.randn(rows, vocab, generator=g)

    def grads(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x[lo:hi].clone().requires_grad_()
        lp, h = token_logprobs(leaf, labels[lo:hi], 0.7, return_entropy=True)
        (lp * w_lp[lo:hi] + h * w_h[lo:hi]).sum().backward()
        token_grad = leaf.grad
        leaf = x[lo:hi].clone().requires_grad_()
        log_softmax(leaf, 0.7).backward(w_full[lo:hi])
        return token_grad, leaf.grad

    batch = grads(0, rows)
    again = grads(0, rows)
    assert all(torch.equal(a, b) for a, b in zip(batch, again, strict=True))
    for i in range(rows):
        alone = grads(i, i + 1)
        assert all(torch.equal(a, b[i : i + 1]) for a, b in zip(alone, batch, strict=True)), f"row {i}"


def test_ignore_index_rows_return_zero_and_get_no_gradient() -> None:
    vocab = 1000
    x = _logits((6, vocab), torch.bfloat16, seed=61)
    labels = _labels((6,), vocab, seed=61)
    labels[[1, 4]] = -100
    leaf = x.clone().requires_grad_()
    lp, h = token_logprobs(leaf, labels, 0.7, return_entropy=True)
    (lp.sum() + h.sum()).backward()
    kept = torch.tensor([0, 2, 3, 5])
    assert torch.equal(lp[[1, 4]], torch.zeros(2)) and torch.equal(h[[1, 4]], torch.zeros(2))
    assert torch.equal(leaf.grad[[1, 4]], torch.zeros(2, vocab, dtype=torch.bfloat16))
    # the other rows are untouched
    other = x[kept].clone().requires_grad_()
    lp_k, h_k = token_logprobs(other, labels[kept], 0.7, return_entropy=True, ignore_index=None)
    (lp_k.sum() + h_k.sum()).backward()
    assert torch.equal(lp[kept], lp_k) and torch.equal(h[kept], h_k)
    assert torch.equal(leaf.grad[kept], other.grad)
    # a custom ignore_index inside the vocabulary
    labels_0 = labels.clone()
    labels_0[[1, 4]] = 0
    assert torch.equal(token_logprobs(x, labels_0, 0.7, ignore_index=0), lp.detach())


def test_empty_batch() -> None:
    x = torch.randn(0, 5, 300).bfloat16().requires_grad_()
    labels = torch.zeros(0, 5, dtype=torch.int64)
    lp, h = token_logprobs(x, labels, return_entropy=True)
    assert lp.shape == h.shape == (0, 5)
    (lp.sum() + h.sum()).backward()
    assert x.grad.shape == x.shape
    assert log_softmax(x).shape == x.shape


# ----------------------------------------------------------------------------------------------
# aten::_log_softmax implementation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aten_log_softmax_implementation(dtype: torch.dtype) -> None:
    x = _logits((2, 3, 1100), dtype, seed=71)
    ours = log_softmax(x)
    assert torch.equal(_log_softmax(x, -1, False), ours.to(dtype))
    assert torch.equal(_log_softmax(x, 2, False), ours.to(dtype))
    if dtype != torch.float32:
        out = _log_softmax(x, -1, True)
        assert out.dtype == torch.float32 and torch.equal(out, ours)
    stock = torch.ops.aten._log_softmax(x.float(), -1, False)
    _assert_close(_log_softmax(x.float(), -1, False), stock.double(), FP32_TOLERANCE, "aten")
    assert torch.equal(_log_softmax(torch.tensor(2.5, dtype=dtype), 0, False), torch.zeros((), dtype=dtype))
    with pytest.raises(ValueError, match="dim must be the last dimension"):
        _log_softmax(x, 1, False)
    with pytest.raises(ValueError, match="dim must be the last dimension"):
        _log_softmax(x, 0, False)


# ----------------------------------------------------------------------------------------------
# Errors, formula registration, compiled-mode validity
# ----------------------------------------------------------------------------------------------


def test_bad_input_raises_value_error_naming_the_argument() -> None:
    x = _logits((4, 300), torch.float32, seed=81)
    labels = _labels((4,), 300, seed=81)
    with pytest.raises(ValueError, match=r"labels shape \(3,\) must equal logits.shape\[:-1\] = \(4,\)"):
        token_logprobs(x, labels[:3])
    with pytest.raises(ValueError, match=r"labels hold values outside \[0, 300\) \(e.g. 300\)"):
        token_logprobs(x, torch.tensor([0, 1, 300, 2]))
    with pytest.raises(ValueError, match=r"labels hold values outside \[0, 300\) \(e.g. -1\)"):
        token_logprobs(x, torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match=r"labels hold values outside .* not ignore_index=None"):
        token_logprobs(x, torch.tensor([0, 1, -100, 2]), ignore_index=None)
    with pytest.raises(ValueError, match="labels must be an int32/int64 tensor"):
        token_logprobs(x, labels.float())
    with pytest.raises(ValueError, match="labels is on meta"):
        token_logprobs(x, labels.to("meta"))
    with pytest.raises(ValueError, match=r"logits\.dtype must be one of"):
        token_logprobs(x.double(), labels)
    with pytest.raises(ValueError, match=r"logits\.dtype must be one of"):
        log_softmax(x.double())
    with pytest.raises(ValueError, match=r"input\.dtype must be one of"):
        _log_softmax(x.double(), -1, False)
    with pytest.raises(ValueError, match=r"logits.shape\[-1\] \(the vocabulary\) must be at least 1"):
        token_logprobs(x[:, :0], labels)
    with pytest.raises(ValueError, match="logits must be a tensor"):
        token_logprobs(x[0, 0], labels[0])
    for temperature in (0.0, -0.5, float("nan"), float("inf"), 1e-50, 1e-45, 9e-6, "0.7", True):
        with pytest.raises(ValueError, match=r"temperature must be a (positive )?finite float"):
            token_logprobs(x, labels, temperature)
        with pytest.raises(ValueError, match=r"temperature must be a (positive )?finite float"):
            log_softmax(x, temperature)
    with warnings.catch_warnings():  # nor does the interpreter's masked-lane arithmetic warn
        warnings.simplefilter("error")
        assert torch.isfinite(token_logprobs(x * 100, labels, 1e-5)).all()  # the smallest accepted is finite
    with pytest.raises(ValueError, match="ignore_index must be an int or None"):
        token_logprobs(x, labels, ignore_index=-100.0)
    with pytest.raises(ValueError, match=r"config\.vocab_chunk must be a power of two"):
        token_logprobs(x, labels, config=RowReduceConfig(vocab_chunk=1000))
    with pytest.raises(ValueError, match="samepath kernels run on"):
        token_logprobs(x.to("meta"), labels.to("meta"))
    # with validate=False an out-of-range label is NaN, never an out-of-bounds read
    lp = token_logprobs(x, torch.tensor([0, 1, 300, 2]), validate=False)
    assert lp[2].isnan() and torch.isfinite(lp[[0, 1, 3]]).all()


def test_linear_logprobs_arguments_are_checked_alike_eager_compiled_and_in_hf() -> None:
    """One checker (:func:`check_linear_logprobs_args`) for the eager call, the compiled route and the HF
    entry: each refuses a bad dtype, an empty vocabulary, a mismatch and a bad token_chunk by name."""
    from samepath.integrations.hf import fused_lm_head_logprobs
    from samepath.kernels.lm_head_op import compiled_linear_token_logprobs
    from samepath.kernels.logprobs import check_linear_logprobs_args, linear_token_logprobs

    hidden, weight, labels = torch.randn(3, 16), torch.randn(40, 16), torch.tensor([1, 2, 3])
    bad = [
        ((hidden.double(), weight.double(), labels), {}, r"hidden\.dtype must be one of"),
        ((hidden, weight[:0], labels), {}, r"weight.shape\[-1\] \(the vocabulary\) must be at least 1"),
        ((hidden, weight.half(), labels), {}, "must match hidden"),
        ((hidden, weight[:, :8], labels), {}, r"weight must be \[V, H\]"),
        ((hidden, weight, labels), {"token_chunk": 0}, "token_chunk must be a positive int"),
    ]
    for fn in (linear_token_logprobs, compiled_linear_token_logprobs, fused_lm_head_logprobs):
        for args, kwargs, match in bad:
            with pytest.raises(ValueError, match=match):
                fn(*args, **kwargs)
    check_linear_logprobs_args(hidden, weight.bfloat16(), 4, same_dtype=False)  # autocast casts both next
    with pytest.raises(ValueError, match="hidden must be a tensor"):
        check_linear_logprobs_args(hidden[0, 0], weight, 4, same_dtype=False)


def test_formula_is_registered_in_the_fingerprint() -> None:
    formula = config_module.OP_FORMULAS["logprobs"]
    assert formula["exp"].startswith("exp (natural)") and "division" in formula["temperature"]
    assert "vocab_chunk" in formula["schedule"]


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_kernels_compile_for_hopper() -> None:
    """Every logprobs kernel, as launched (forward, entropy, ignore_index, both backwards),
    compiles to a cubin for sm_90 with the CUDA row-reduction config, dividing with div.rn."""
    cfg = config_module.ROW_REDUCE_TABLE["cuda"]
    x = _logits((2, 3, 300), torch.bfloat16, seed=91)[:, :-1].requires_grad_()
    labels = _labels((2, 2), 300, seed=91)
    labels[0, 0] = -100
    with record_launches() as launches:
        lp, h = token_logprobs(x, labels, 0.7, return_entropy=True, config=cfg)
        (lp.sum() + h.sum()).backward()
        log_softmax(x, 0.7, config=cfg).sum().backward()
    compiled = {launch.name: compile_launch(launch) for launch in launches}
    assert set(compiled) == {
        "_token_logprobs_fwd_kernel",
        "_token_logprobs_bwd_kernel",
        "_log_softmax_fwd_kernel",
        "_log_softmax_bwd_kernel",
    }
    for name, kernel in compiled.items():
        assert kernel.asm["cubin"], name
        assert "div.rn.f32" in kernel.asm["ptx"], name


def test_batch_invariant_routes_torch_log_softmax() -> None:
    """Inside samepath.batch_invariant(), torch.log_softmax over the last dim is samepath's
    schedule (row alone == row in batch, equal to samepath.log_softmax); other calls stay stock."""
    import samepath

    gen = torch.Generator().manual_seed(123)
    x = (torch.randn(33, 5000, generator=gen) * 3).to(torch.bfloat16)
    stock = torch.log_softmax(x, -1)
    with samepath.batch_invariant():
        routed = torch.log_softmax(x, -1)
        alone = torch.log_softmax(x[7:8], -1)
        float64 = torch.log_softmax(x.double(), -1)
        first_dim = torch.log_softmax(x, 0)
    assert torch.equal(routed.float(), log_softmax(x).to(torch.bfloat16).float())
    assert torch.equal(alone[0], routed[7])
    assert torch.equal(float64, torch.log_softmax(x.double(), -1))
    assert torch.equal(first_dim, torch.log_softmax(x, 0))
    assert torch.equal(torch.log_softmax(x, -1), stock)


# ----------------------------------------------------------------------------------------------
# lm_head + logprobs over token chunks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_token_logprobs_equal_logprobs_of_the_linear(dtype: torch.dtype) -> None:
    """The trainer's fused lm_head + logprobs (token chunks of 16 rows; vocabulary chunks of 256
    columns, 600 columns) has the bits of the rollout's ``token_logprobs(linear(hidden, weight))``,
    logprobs and entropy; both gradients have the unfused backward's bits. Negative controls: logits
    from a matmul with another block_k; dweight summed over token chunks."""
    import samepath
    from samepath.kernels.config import MatmulConfig, RowReduceConfig
    from samepath.kernels.logprobs import linear_token_logprobs
    from samepath.kernels.matmul import linear, matmul

    def matmul_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return matmul(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 13, 64, generator=gen).to(dtype)
    weight = (torch.randn(600, 64, generator=gen) * 0.3).to(dtype)
    labels = torch.randint(0, 600, (3, 13), generator=gen)
    labels[1, 4] = -100
    g_lp, g_h = torch.randn(3, 13, generator=gen), torch.randn(3, 13, generator=gen)
    cfg = RowReduceConfig(vocab_chunk=256)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(linear(h1, w1), labels, 0.7, return_entropy=True, config=cfg)
    torch.autograd.backward((lp, ent), (g_lp, g_h))
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = linear_token_logprobs(h2, w2, labels, 0.7, return_entropy=True, config=cfg, token_chunk=16)
    torch.autograd.backward(fused, (g_lp, g_h))
    assert torch.equal(fused[0], lp) and torch.equal(fused[1], ent)
    assert torch.equal(h2.grad, h1.grad)
    if dtype == torch.bfloat16:
        # samepath.logprobs(hidden, ..., weight=) with the frozen vocabulary chunk
        assert torch.equal(
            samepath.logprobs(hidden, labels, 0.7, weight=weight), token_logprobs(linear(hidden, weight), labels, 0.7)
        )

    # dweight: one matmul over all tokens, the unfused backward's bits; deterministic, close to fp64
    assert torch.equal(w2.grad, w1.grad)
    h3, w3 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    again = linear_token_logprobs(h3, w3, labels, 0.7, return_entropy=True, config=cfg, token_chunk=16)
    torch.autograd.backward(again, (g_lp, g_h), retain_graph=True)
    assert torch.equal(w3.grad, w2.grad) and torch.equal(h3.grad, h2.grad)
    # a second backward through the same graph (its kept logits became dlogits) recomputes them
    w3.grad = h3.grad = None
    torch.autograd.backward(again, (g_lp, g_h))
    assert torch.equal(w3.grad, w2.grad) and torch.equal(h3.grad, h2.grad)
    # negative control: the fp32 partials of token chunks of 16 summed in chunk order (the schedule
    # before numerics version 5)
    h4, w4 = hidden.clone(), weight.clone().requires_grad_()
    logits = linear(h4, w4)
    logits.retain_grad()
    lp4, ent4 = token_logprobs(logits, labels, 0.7, return_entropy=True, config=cfg)
    torch.autograd.backward((lp4, ent4), (g_lp, g_h))
    dlogits, rows = logits.grad.reshape(-1, 600), hidden.reshape(-1, 64)
    partials = [matmul(dlogits[c : c + 16].t(), rows[c : c + 16], out_dtype=torch.float32) for c in range(0, 39, 16)]
    whole = matmul(dlogits.t(), rows, out_dtype=torch.float32)
    assert torch.equal(w2.grad, whole.to(dtype))
    assert not torch.equal(whole, partials[0] + partials[1] + partials[2])
    # save_logits=False: token chunks of 16 logits at a time, dweight from those chunk partials
    h6, w6 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    streamed = linear_token_logprobs(
        h6, w6, labels, 0.7, return_entropy=True, config=cfg, token_chunk=16, save_logits=False
    )
    torch.autograd.backward(streamed, (g_lp, g_h))
    assert torch.equal(streamed[0], lp) and torch.equal(h6.grad, h1.grad)
    assert torch.equal(w6.grad, (partials[0] + partials[1] + partials[2]).to(dtype))
    # a frozen lm_head (hidden-only gradient) gives the same hidden gradient
    h5 = hidden.clone().requires_grad_()
    frozen = linear_token_logprobs(h5, weight, labels, 0.7, return_entropy=True, config=cfg, token_chunk=16)
    torch.autograd.backward(frozen, (g_lp, g_h))
    assert torch.equal(h5.grad, h1.grad)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = (h64 @ w64.t()) / 0.7
    logp = z.log_softmax(-1)
    keep = labels != -100
    lp64 = torch.where(keep, logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0], 0.0)
    ent64 = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    torch.autograd.backward((lp64, ent64), (g_lp.double(), g_h.double()))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for ours, ref in ((fused[0], lp64), (fused[1], ent64), (w2.grad, w64.grad), (h2.grad, h64.grad)):
        assert (ours.double() - ref).abs().max() <= tol * ref.abs().max()

    # negative control: other logits bits (fp32: another block_k; bf16: logits not rounded to bf16)
    if dtype == torch.float32:
        other_logits = linear(hidden, weight, config=MatmulConfig(16, 32, 16))
    else:
        other_logits = matmul_fp32(hidden, weight)
    assert not torch.equal(token_logprobs(other_logits, labels, 0.7, config=cfg), lp.detach())
    with pytest.raises(ValueError, match="save_logits must be a bool"):
        linear_token_logprobs(hidden, weight, labels, save_logits=1)
    with pytest.raises(ValueError, match="token_chunk must be a positive int"):
        linear_token_logprobs(hidden, weight, labels, token_chunk=0)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        linear_token_logprobs(hidden, weight[:, :10], labels)
