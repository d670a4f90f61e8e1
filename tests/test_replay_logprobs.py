"""The CPU replays of the logprob, reduction and kept-count kernels are bit-identical to Triton's
interpreter: every launch the public API makes (token logprobs / entropy / log-softmax forward
and backward, the fused lm_head path, processed logprobs, ``batch_invariant()``'s reductions) runs
under the ``"verify"`` executor, which compares every tensor argument bit for bit.

A negative control proves the harness can fail: a replay that divides by the temperature as a
multiplication by its reciprocal (what torch on CUDA does for a Python scalar) is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import samepath
from samepath.kernels import logprobs, sampling
from samepath.kernels.config import RowReduceConfig
from samepath.kernels.dispatch import ReplayMismatch, cpu_executor
from samepath.kernels.replay import logprobs as replay_logprobs
from samepath.kernels.replay import reductions as replay_reductions

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL = RowReduceConfig(vocab_chunk=16)
# (vocab, config): one chunk with a tail; several small chunks with a tail; the real 4096-column
# chunk, more than one of them, with a tail.
VOCABS = [(1, SMALL), (37, SMALL), (45, None), (4100, None)]


def _logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _labels(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, shape, generator=gen)


def _grad(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randn(t.shape, generator=gen).to(t.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("vocab", "config"), VOCABS)
def test_token_logprobs_forward_and_backward(vocab: int, config, dtype: torch.dtype) -> None:
    """Strided rows (``logits[:, :-1]``), -inf logits (a whole row too), a NaN and a +inf logit, an ignored row,
    temperature 1 and not, with and without entropy, each gradient alone and both."""
    seed = vocab * 7 + DTYPES.index(dtype)
    base = _logits((2, 4, vocab), dtype, seed)
    base[0, 1, : (vocab + 1) // 2] = float("-inf")
    base[1, 0] = float("-inf")
    base[0, 2, -1] = float("nan")
    base[1, 1, 0] = float("inf")
    logits = base[:, :-1].detach().requires_grad_(True)
    labels = _labels((2, 3), vocab, seed)
    labels[1, 2] = -100
    with cpu_executor("verify"):
        for temperature in (1.0, 0.7):
            lp, ent = logprobs.token_logprobs(logits, labels, temperature, return_entropy=True, config=config)
            torch.autograd.grad(
                (lp * _grad(lp, seed)).sum() + (ent * _grad(ent, seed + 1)).sum(), logits, retain_graph=True
            )
            torch.autograd.grad((ent * _grad(ent, seed + 3)).sum(), logits)
            lp = logprobs.token_logprobs(logits, labels.clamp(min=0), temperature, ignore_index=None, config=config)
            torch.autograd.grad(lp.sum(), logits)


def test_token_logprobs_out_of_range_labels_and_shards() -> None:
    """``validate=False`` with an out-of-range label (NaN); the backward of rows whose label lies
    outside ``[0, V)`` (a vocabulary shard's rows): no one-hot term."""
    logits = _logits((5, 40), torch.bfloat16, 11)
    labels = torch.tensor([0, 39, 40, -3, 7])
    with cpu_executor("verify"):
        lp = logprobs.token_logprobs(logits, labels, 0.9, ignore_index=None, config=SMALL, validate=False)
        assert lp[2].isnan() and lp[3].isnan() and not lp[0].isnan()
        lse = torch.logsumexp(logits.float() / 0.9, -1)
        grad = torch.randn(5)
        dx = logprobs.token_logprobs_backward(
            logits, labels, logprobs.row_offsets(logits), lse, None, grad, None, 0.9, None, SMALL
        )
    assert dx.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("vocab", "config"), VOCABS)
def test_log_softmax_forward_and_backward(vocab: int, config, dtype: torch.dtype) -> None:
    seed = vocab * 5 + DTYPES.index(dtype)
    base = _logits((3, vocab + 2), dtype, seed)
    base[1, : vocab // 3] = float("-inf")
    base[2, -2] = float("nan")
    logits = base[:, 1 : vocab + 1].detach().requires_grad_(True)  # strided rows, offset start
    with cpu_executor("verify"):
        for temperature in (1.0, 1.3):
            out = logprobs.log_softmax(logits, temperature, config=config)
            torch.autograd.grad((out.masked_fill(out.isinf(), 0) * _grad(out, seed)).sum(), logits)
        with samepath.batch_invariant():
            torch.log_softmax(logits.detach(), -1)
            torch.log_softmax(logits.detach(), -1, dtype=torch.float32)


def test_empty_and_single_rows() -> None:
    with cpu_executor("verify"):
        empty = logprobs.token_logprobs(_logits((0, 9), torch.float32, 1), torch.zeros(0, dtype=torch.long))
        assert empty.shape == (0,)
        single = _logits((9,), torch.float16, 2).requires_grad_(True)
        lp, ent = logprobs.token_logprobs(single, torch.tensor(3), 0.5, return_entropy=True, config=SMALL)
        torch.autograd.grad(lp + ent, single)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_lm_head(dtype: torch.dtype) -> None:
    """``linear_token_logprobs`` (lm_head + logprobs over token chunks) forward and backward."""
    hidden = _logits((2, 5, 16), dtype, 3, scale=1.0).requires_grad_(True)
    weight = _logits((70, 16), dtype, 4, scale=0.3).requires_grad_(True)
    labels = _labels((2, 5), 70, 5)
    labels[0, 0] = -100
    with cpu_executor("verify"):
        lp, ent = logprobs.linear_token_logprobs(
            hidden, weight, labels, 0.8, return_entropy=True, config=SMALL, token_chunk=4
        )
        torch.autograd.grad((lp * _grad(lp, 6)).sum() + (ent * _grad(ent, 7)).sum(), (hidden, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [37, 4100])
def test_processed_logprobs_and_keep_mask(vocab: int, dtype: torch.dtype) -> None:
    """top-k / top-p / min-p (alone and together), per-row tensors, a row with -inf logits."""
    seed = vocab + DTYPES.index(dtype)
    logits = _logits((4, vocab), dtype, seed).requires_grad_(True)
    labels = _labels((4,), vocab, seed)
    with cpu_executor("verify"):
        for edits in (dict(top_k=5), dict(top_p=0.7), dict(min_p=0.05), dict(top_k=9, top_p=0.9, min_p=0.01)):
            lp = sampling.processed_logprobs(logits, labels, 0.8, validate=False, **edits)
            torch.autograd.grad(lp[lp.isfinite()].sum(), logits, allow_unused=True)
        tempered = logits.detach().float() / 0.8
        tempered[2, 1:] = float("-inf")
        tempered[3] = float("-inf")
        sampling.sampling_keep_mask(
            tempered,
            top_k=torch.tensor([0, 3, 1, vocab + 5]),
            top_p=torch.tensor([0.5, 1.0, 0.3, 0.9]),
            min_p=torch.tensor([0.0, 0.2, 0.5, 0.1]),
            config=SMALL,
        )


REDUCTIONS = {
    "softmax": lambda x: (torch.softmax(x, -1), torch.softmax(x, 0), torch.softmax(x, -1, dtype=torch.float32)),
    "sum_mean": lambda x: (x.sum(-1), x.mean(-1, keepdim=True), x.sum(), x.mean((0, -1)), x.sum(-1, dtype=torch.float)),
    "columns": lambda x: (x.sum(0), x.mean(0), x.sum(1), x.mean(-2)),
    "var_std": lambda x: (
        x.var(-1),
        x.std(0),
        torch.var_mean(x, -1),
        torch.std_mean(x, (0, 1), correction=0),
        x.var(-1, correction=x.shape[-1] + 2),
    ),
    "norms": lambda x: (
        x.norm(dim=-1),
        torch.linalg.vector_norm(x, 1, dim=-1),
        torch.linalg.vector_norm(x, 2, dim=0, dtype=torch.float32),
        torch.nn.functional.normalize(x, dim=-1),
    ),
}
# Rows longer than one 4096-column chunk (reductions over the last dimension only: a reduction over
# another dimension of such a tensor has thousands of rows, too many for the interpreter).
LONG_ROWS = {
    "softmax": lambda x: (torch.softmax(x, -1), torch.softmax(x, -1, dtype=torch.float32)),
    "sum_mean": lambda x: (x.sum(-1), x.mean(-1), x.sum(), x.mean(dtype=torch.float32)),
    "var_std": lambda x: (x.var(-1), torch.std_mean(x, -1, correction=0)),
    "norms": lambda x: (x.norm(dim=-1), torch.linalg.vector_norm(x, 1, dim=-1)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_batch_invariant_reductions(op: str, dtype: torch.dtype) -> None:
    """Every reduced dimension form: last, other (strided rows or the column kernel), several."""
    x = _logits((3, 2, 7), dtype, 5 + DTYPES.index(dtype))
    if op == "softmax":
        x[0, 0, :3] = float("-inf")
    with cpu_executor("verify"), samepath.batch_invariant():
        REDUCTIONS[op](x)
        REDUCTIONS[op](x[:, :, 1:].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(LONG_ROWS))
def test_batch_invariant_reductions_over_long_rows(op: str, dtype: torch.dtype) -> None:
    x = _logits((2, 4100), dtype, 7 + DTYPES.index(dtype))
    if op == "softmax":
        x[0, :4097] = float("-inf")
    with cpu_executor("verify"), samepath.batch_invariant():
        LONG_ROWS[op](x)
        LONG_ROWS[op](x[:, 3:])


def test_column_sum_over_many_reduced_rows() -> None:
    """More reduced rows than the column tile holds (two tiles, a tail), unaligned columns."""
    x = _logits((300, 45), torch.bfloat16, 9)
    with cpu_executor("verify"), samepath.batch_invariant():
        x.sum(0)
        x.float().mean(0)


def test_negative_control_reciprocal_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Multiplying by ``1 / T`` instead of dividing by ``T`` is caught by the verify harness."""

    def reciprocal(self, start, temperature):
        z = self.widened(start) * (np.float32(1.0) / temperature)
        return np.where(self.valid(start), z, np.float32(-np.inf))

    monkeypatch.setattr(replay_logprobs.RowTiles, "scaled", reciprocal)
    logits = _logits((16, 300), torch.float32, 21)
    labels = _labels((16,), 300, 21)
    with cpu_executor("verify"), pytest.raises(ReplayMismatch):
        logprobs.token_logprobs(logits, labels, 0.7, config=SMALL)


def test_negative_control_sequential_row_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk summed left to right instead of by numpy's pairwise ``np.sum`` is caught."""

    def sequential(tiles):
        total = np.zeros(tiles.rows, np.float32)
        for start in range(0, tiles.V, tiles.chunk):
            total = total + np.cumsum(tiles.widened(start), axis=1)[:, -1]
        return total

    monkeypatch.setattr(replay_reductions, "_row_totals", sequential)
    x = _logits((16, 4100), torch.float32, 22)
    with cpu_executor("verify"), samepath.batch_invariant(), pytest.raises(ReplayMismatch):
        x.sum(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_sharded_logprobs(dtype: torch.dtype) -> None:
    """``samepath.distributed``'s shard lse / merge kernels and the shards' backward (labels
    outside a shard), an ignored row, a shard whose columns are all -inf for one row."""
    from samepath import distributed

    logits = _logits((5, 48), dtype, 31)
    logits[2, 16:32] = float("-inf")
    logits = logits.requires_grad_(True)
    labels = _labels((5,), 48, 31)
    labels[4] = -100
    with cpu_executor("verify"):
        for config in (SMALL, None):
            lp = distributed.sharded_token_logprobs(logits, labels, 3, 0.8, config=config)
            torch.autograd.grad((lp * _grad(lp, 32)).sum(), logits)
