"""Token log-probabilities, entropy and log-softmax over the vocabulary with one fixed schedule.

Contract (docs/numerics.md, "the rest of the model"): a row of logits is reduced by one program,
``vocab_chunk`` columns at a time (``row_reduce_config(device).vocab_chunk``), serially in
ascending column order, into an fp32 online log-sum-exp. Per chunk, with ``T`` the temperature::

    z = x.to(fp32) / fp32(T)                  # IEEE division (tl.math.div_rn), first of all,
                                              # exactly torch's ``logits.float() / T`` on the CPU
    z = where(col < V, z, -inf)               # the tail of the last chunk; exp gives exactly 0
    m' = max(m, max(z))
    e = exp(z - m')                           # natural exp, no log2(e) folding
    s' = s * exp(m - m') + sum(e)
    w' = exp(m - m') * (w + (m' - m) * s) + sum(e * (m' - z))     # entropy only (-inf terms: 0)
    lse = m + log(s);  entropy = log(s) + w / s;  logprob = z[label] - lse

``w`` is the running ``sum(exp(z - m) * (m - z))``: every term is non-negative, so the entropy
``log(s) + w / s`` (= ``lse - sum(p * z)``) is a sum of two non-negative numbers and does not
cancel for peaked distributions the way ``lse - sum(p * z)`` would.

The lse is computed by one ``@jit`` device function shared by :func:`token_logprobs` and
:func:`log_softmax`, so ``log_softmax(x, T).gather(-1, label) == token_logprobs(x, label, T)``
bitwise; a row's result never depends on the other rows of the batch.

Public functions:

* :func:`token_logprobs` — ``log p(label)`` per row (optionally the entropy), differentiable.
* :func:`log_softmax` — the full fp32 ``[..., V]`` log-softmax (samplers' top-k logprobs),
  differentiable.
* :func:`_log_softmax` — an ``aten::_log_softmax``-compatible implementation ``(input, dim,
  half_to_float)`` for a batch-invariant dispatcher override (temperature 1, last dim only).

Backward (deterministic, one program per row, no atomics), with ``p = exp(z - lse)``,
``log p = z - lse`` and ``H`` the saved entropy:
``dx = ((onehot(label) - p) * g_logprob - g_entropy * p * (log p + H)) / T``, and for the
log-softmax ``dx = (g - p * sum(g)) / T`` with ``sum(g)`` folded in the same fixed chunks.
"""

from __future__ import annotations

import torch
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import (
    SUPPORTED_DTYPES,
    RowReduceConfig,
    dtype_name,
    register_formula,
    row_reduce_config,
)
from samepath.kernels.dispatch import SUPPORTED_DEVICE_TYPES, jit
from samepath.kernels.matmul import launch as launch_matmul
from samepath.kernels.matmul import matmul, register_override
from samepath.kernels.opaque import compiled_by
from samepath.kernels.row_reduce import (  # noqa: F401 (re-exported: the names the logprobs always had)
    MIN_TEMPERATURE,
    check_labels,
    check_logits,
    check_temperature,
    launch_options,
    resolve_config,
    row_lse,
    row_offsets,
    scaled_chunk,
    vocab_chunk,
)
from samepath.kernels.softcap import check_softcap, softcap_backward, softcap_logits

#: The label value whose rows return 0 and get no gradient (PyTorch's and HF's convention).
IGNORE_INDEX = -100

LOGPROBS_FORMULA = {
    "schedule": "one program per row; vocab_chunk columns per step, serially in ascending column order",
    "temperature": "logits widened to fp32, then IEEE-rounded division by fp32(temperature) before anything else",
    "mask": "columns past the vocabulary select -inf before the chunk max; their exp is exactly 0",
    "exp": "exp (natural), no log2(e) folding; lse = m + log(s)",
    "lse": "fp32 online: m' = max(m, max(z)); s' = s * exp(m - m') + sum(exp(z - m'))",
    "logprob": "z[label] - lse, z[label] divided exactly as in the chunk",
    "entropy": (
        "fp32 online w = sum(exp(z - m) * (m - z)), w' = exp(m - m') * (w + (m' - m) * s) + chunk sum; "
        "entropy = log(s) + w / s"
    ),
    "log_softmax": "the same lse device function, then z - lse per column, fp32",
    "ignore_index": "rows labelled ignore_index return 0 (logprob and entropy) and get zero gradient",
    "backward": "fp32: ((onehot - p) * g_logprob - g_entropy * p * (log p + H)) / T, one cast to the logits dtype",
    "fp_fusion": "disabled",
    "linear_logprobs": (
        "hidden @ weight^T by samepath's matmul (the bits of linear(hidden, weight)), each row's logits "
        "reduced as above (without gradients: in chunks of token_chunk rows; with them: all rows' logits "
        "kept in the input dtype); backward: dlogits by the backward kernel (in place of the kept logits), "
        "dhidden = dlogits @ weight and dweight = dlogits^T @ hidden, each one matmul over all rows "
        "(the bits of linear's backward); save_logits=False: per chunk recomputed logits, dlogits, "
        "dhidden rows, dweight = fp32 partials summed in ascending chunk order, one cast"
    ),
}
register_formula("logprobs", LOGPROBS_FORMULA)

#: Rows of hidden states whose logits exist at once in :func:`linear_token_logprobs`.
LM_HEAD_TOKEN_CHUNK = 1024


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@jit
def _token_logprobs_fwd_kernel(
    X,
    row_offsets,
    Labels,
    LogProb,
    Entropy,
    Lse,
    num_rows,
    stride_v,
    V,
    temperature,
    ignore_index,
    CHUNK: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_IGNORE: tl.constexpr,
    SCALED: tl.constexpr,
):
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        label = tl.load(Labels + row).to(tl.int64)
        row_ptr = X + tl.load(row_offsets + row)
        lse, entropy = row_lse(row_ptr, stride_v, V, temperature, CHUNK, ENTROPY, SCALED)
        # An out-of-range label (only possible with validate=False) gives NaN, never a wild read.
        in_range = (label >= 0) & (label < V)
        # The label's x / T as the one live lane of a 16-lane vector (x + 0 + ... is exactly x):
        # Triton-Ascend cannot lower a scalar div_rn.
        lanes = tl.arange(0, 16)
        label_ptrs = row_ptr + (tl.where(in_range, label, 0) + lanes) * stride_v
        x_lanes = tl.load(label_ptrs, mask=lanes == 0, other=0.0).to(tl.float32)
        if SCALED:
            x_lanes = tl.math.div_rn(x_lanes, temperature)
        z_label = tl.sum(x_lanes, 0)
        logprob = tl.where(in_range, z_label - lse, float("nan"))
        if HAS_IGNORE:
            # Selects, not a branch around the loop: Triton-Ascend cannot lower the latter.
            ignored = label == ignore_index
            logprob = tl.where(ignored, 0.0, logprob)
            lse = tl.where(ignored, 0.0, lse)
            entropy = tl.where(ignored, 0.0, entropy)
        tl.store(LogProb + row, logprob)
        tl.store(Lse + row, lse)
        if ENTROPY:
            tl.store(Entropy + row, entropy)


@jit
def _token_logprobs_bwd_kernel(
    X,
    row_offsets,
    Labels,
    Lse,
    Entropy,
    dLogProb,
    dEntropy,
    dX,
    num_rows,
    stride_v,
    stride_dlp,
    stride_dh,
    V,
    temperature,
    ignore_index,
    CHUNK: tl.constexpr,
    HAS_GRAD_LP: tl.constexpr,
    HAS_GRAD_H: tl.constexpr,
    HAS_IGNORE: tl.constexpr,
    SCALED: tl.constexpr,
):
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        dx_row = dX + tl.cast(row, tl.int64) * V
        label = tl.load(Labels + row).to(tl.int64)
        ignored = False
        if HAS_IGNORE:
            ignored = label == ignore_index
        if ignored:
            for start in range(0, V, CHUNK):
                cols = start + offs
                tl.store(dx_row + cols, tl.zeros([CHUNK], tl.float32).to(dX.dtype.element_ty), mask=cols < V)
        else:
            row_ptr = X + tl.load(row_offsets + row)
            lse = tl.load(Lse + row)
            g_lp = 0.0
            if HAS_GRAD_LP:
                g_lp = tl.load(dLogProb + row * stride_dlp).to(tl.float32)
            g_h = 0.0
            entropy = 0.0
            if HAS_GRAD_H:
                g_h = tl.load(dEntropy + row * stride_dh).to(tl.float32)
                entropy = tl.load(Entropy + row)
            for start in range(0, V, CHUNK):
                cols = start + offs
                z = scaled_chunk(row_ptr, cols, stride_v, V, temperature, SCALED)
                logp = z - lse
                p = tl.exp(logp)
                g = tl.zeros([CHUNK], tl.float32)
                if HAS_GRAD_LP:
                    g = (tl.where(cols == label, 1.0, 0.0) - p) * g_lp
                if HAS_GRAD_H:
                    # p log p -> 0 where p == 0 (logits of -inf), without computing 0 * -inf.
                    g = g - g_h * (p * (tl.where(p == 0.0, 0.0, logp) + entropy))
                dx = g
                if SCALED:
                    dx = tl.math.div_rn(g, temperature)
                tl.store(dx_row + cols, dx.to(dX.dtype.element_ty), mask=cols < V)


@jit
def _log_softmax_fwd_kernel(
    X,
    row_offsets,
    Out,
    Lse,
    num_rows,
    stride_v,
    V,
    temperature,
    CHUNK: tl.constexpr,
    SCALED: tl.constexpr,
):
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        lse, _ = row_lse(row_ptr, stride_v, V, temperature, CHUNK, False, SCALED)
        tl.store(Lse + row, lse)
        out_row = Out + tl.cast(row, tl.int64) * V
        offs = tl.arange(0, CHUNK)
        for start in range(0, V, CHUNK):
            cols = start + offs
            z = scaled_chunk(row_ptr, cols, stride_v, V, temperature, SCALED)
            tl.store(out_row + cols, z - lse, mask=cols < V)


@jit
def _log_softmax_bwd_kernel(
    X,
    row_offsets,
    Lse,
    dOut,
    dX,
    num_rows,
    stride_v,
    V,
    temperature,
    CHUNK: tl.constexpr,
    SCALED: tl.constexpr,
):
    """dx = (g - p * sum(g)) / T; sum(g) folded in the same fixed chunks, ascending."""
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        lse = tl.load(Lse + row)
        g_row = dOut + tl.cast(row, tl.int64) * V
        dx_row = dX + tl.cast(row, tl.int64) * V
        offs = tl.arange(0, CHUNK)
        g_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + offs
            g_sum = g_sum + tl.sum(tl.load(g_row + cols, mask=cols < V, other=0.0), 0)
        for start in range(0, V, CHUNK):
            cols = start + offs
            z = scaled_chunk(row_ptr, cols, stride_v, V, temperature, SCALED)
            p = tl.exp(z - lse)
            g = tl.load(g_row + cols, mask=cols < V, other=0.0)
            dx = g - p * g_sum
            if SCALED:
                dx = tl.math.div_rn(dx, temperature)
            tl.store(dx_row + cols, dx.to(dX.dtype.element_ty), mask=cols < V)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def scaled(temperature: float) -> bool:
    """Whether the kernels divide by ``temperature``: not at exactly 1 (``x / 1`` is ``x``, so
    skipping the division gives the same bits)."""
    return float(temperature) != 1.0


def _token_forward(logits, labels_flat, offsets, temperature, ignore_index, entropy, config):
    rows, vocab = labels_flat.numel(), logits.shape[-1]
    device = logits.device
    logprob = torch.empty(rows, dtype=torch.float32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    ent = torch.empty(rows, dtype=torch.float32, device=device) if entropy else None
    if rows == 0:
        return logprob, ent, lse
    _token_logprobs_fwd_kernel[(grid.num_programs(rows, logits.device),)](
        logits,
        offsets,
        labels_flat,
        logprob,
        ent if entropy else logprob,
        lse,
        rows,
        logits.stride(-1),
        vocab,
        temperature,
        ignore_index if ignore_index is not None else 0,
        CHUNK=vocab_chunk(config),
        ENTROPY=entropy,
        HAS_IGNORE=ignore_index is not None,
        SCALED=scaled(temperature),
        **launch_options(config),
    )
    return logprob, ent, lse


def token_logprobs_backward(
    logits: torch.Tensor,
    labels_flat: torch.Tensor,
    offsets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    grad_lp: torch.Tensor | None,
    grad_h: torch.Tensor | None,
    temperature: float,
    ignore_index: int | None,
    config: RowReduceConfig,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d/d logits`` of the token logprobs (and entropy) of rows whose fp32 ``lse`` (``[rows]``)
    is given: ``((onehot(label) - p) * g_lp - g_h * p * (log p + H)) / T`` with ``p = exp(z - lse)``,
    in ``logits.dtype``, 0 for rows labelled ``ignore_index``. A label outside ``[0, V)`` adds no
    one-hot term (a vocabulary shard's rows whose label another shard holds). Rows are addressed
    through ``offsets`` (:func:`row_offsets`); inputs are not validated. ``out``: a contiguous
    ``[rows, V]`` tensor to write into — ``logits`` itself when contiguous (each row's chunk is read
    before it is written, by the row's one program)."""
    rows, vocab = labels_flat.numel(), logits.shape[-1]
    dx = out if out is not None else torch.empty((*logits.shape[:-1], vocab), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return dx
    grad_lp = grad_lp.reshape(-1) if grad_lp is not None else None
    grad_h = grad_h.reshape(-1) if grad_h is not None else None
    _token_logprobs_bwd_kernel[(grid.num_programs(rows, logits.device),)](
        logits,
        offsets,
        labels_flat,
        lse,
        ent if ent is not None else lse,
        grad_lp if grad_lp is not None else lse,
        grad_h if grad_h is not None else lse,
        dx,
        rows,
        logits.stride(-1),
        grad_lp.stride(0) if grad_lp is not None else 0,
        grad_h.stride(0) if grad_h is not None else 0,
        vocab,
        temperature,
        ignore_index if ignore_index is not None else 0,
        CHUNK=vocab_chunk(config),
        HAS_GRAD_LP=grad_lp is not None,
        HAS_GRAD_H=grad_h is not None,
        HAS_IGNORE=ignore_index is not None,
        SCALED=scaled(temperature),
        **launch_options(config),
    )
    return dx


def _log_softmax_forward(logits, offsets, temperature, config):
    vocab = logits.shape[-1]
    rows = offsets.numel()
    out = torch.empty((*logits.shape[:-1], vocab), dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out, lse
    _log_softmax_fwd_kernel[(grid.num_programs(rows, logits.device),)](
        logits,
        offsets,
        out,
        lse,
        rows,
        logits.stride(-1),
        vocab,
        temperature,
        CHUNK=vocab_chunk(config),
        SCALED=scaled(temperature),
        **launch_options(config),
    )
    return out, lse


def _log_softmax_backward(logits, offsets, lse, grad_out, temperature, config):
    vocab = logits.shape[-1]
    rows = offsets.numel()
    dx = torch.empty((*logits.shape[:-1], vocab), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return dx
    grad_out = grad_out.to(torch.float32).contiguous()
    _log_softmax_bwd_kernel[(grid.num_programs(rows, logits.device),)](
        logits,
        offsets,
        lse,
        grad_out,
        dx,
        rows,
        logits.stride(-1),
        vocab,
        temperature,
        CHUNK=vocab_chunk(config),
        SCALED=scaled(temperature),
        **launch_options(config),
    )
    return dx


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


class TokenLogprobsFunction(torch.autograd.Function):
    """Autograd for :func:`token_logprobs`; returns ``(logprob, entropy or None)``."""

    @staticmethod
    def forward(ctx, logits, labels_flat, temperature, ignore_index, entropy, config):  # type: ignore[override]
        offsets = row_offsets(logits)
        logprob, ent, lse = _token_forward(logits, labels_flat, offsets, temperature, ignore_index, entropy, config)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels_flat, offsets, lse, ent)
        ctx.temperature, ctx.ignore_index, ctx.config = temperature, ignore_index, config
        lead = logits.shape[:-1]
        if ent is None:
            return logprob.reshape(lead), None
        return logprob.reshape(lead), ent.reshape(lead)

    @staticmethod
    def backward(ctx, grad_lp, grad_h):  # type: ignore[override]
        logits, labels_flat, offsets, lse, ent = ctx.saved_tensors
        if grad_lp is None and grad_h is None:
            return None, None, None, None, None, None
        dx = token_logprobs_backward(
            logits,
            labels_flat,
            offsets,
            lse,
            ent,
            grad_lp,
            grad_h if ent is not None else None,
            ctx.temperature,
            ctx.ignore_index,
            ctx.config,
        )
        return dx, None, None, None, None, None


class LogSoftmaxFunction(torch.autograd.Function):
    """Autograd for :func:`log_softmax`."""

    @staticmethod
    def forward(ctx, logits, temperature, config):  # type: ignore[override]
        offsets = row_offsets(logits)
        out, lse = _log_softmax_forward(logits, offsets, temperature, config)
        ctx.save_for_backward(logits, offsets, lse)
        ctx.temperature, ctx.config = temperature, config
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, offsets, lse = ctx.saved_tensors
        return _log_softmax_backward(logits, offsets, lse, grad_out, ctx.temperature, ctx.config), None, None


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[label]`` per row, in fp32, batch-invariant.

    Args:
        logits: ``[..., V]`` float32 / bfloat16 / float16, any strides (rows are addressed through
            their strides, never copied).
        labels: ``[...]`` int32/int64, ``logits.shape[:-1]``; each in ``[0, V)`` or ``ignore_index``.
        temperature: divides the fp32-widened logits (IEEE division by the fp32 temperature,
            bit-identical to ``logits.float() / temperature`` computed by torch on the CPU, and to
            torch's division by a temperature *tensor* on CUDA; note that torch on CUDA divides by
            a Python-number scalar as a multiplication by its reciprocal, which can differ).
        return_entropy: also return the fp32 entropy of ``softmax(logits / temperature)``.
        ignore_index: rows with this label return 0 (logprob and entropy) and get zero gradient;
            ``None`` disables it.
        config: row-reduction config instead of the frozen table (tests and tuning only: another
            ``vocab_chunk`` gives other bits).
        validate: check the labels' values on the host (a device-to-host copy); with
            ``validate=False`` an out-of-range label yields NaN.

    Returns:
        ``[...]`` fp32 logprobs, or ``(logprobs, entropy)``. A row's values depend only on that
        row and equal ``log_softmax(logits, temperature).gather(-1, label)`` bitwise.
        Differentiable in ``logits`` (gradient in ``logits.dtype``, deterministic).
    """
    check_logits(logits)
    temperature = check_temperature(temperature)
    check_labels(labels, logits, logits.shape[-1], ignore_index, validate=validate)
    cfg = resolve_config(config, logits.device)
    labels_flat = labels.reshape(-1).contiguous()
    logprob, entropy = TokenLogprobsFunction.apply(logits, labels_flat, temperature, ignore_index, return_entropy, cfg)
    if return_entropy:
        return logprob, entropy
    return logprob


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """Autograd for :func:`linear_token_logprobs`. ``keep``: all rows' logits are computed by one
    matmul and kept in the input dtype; the backward turns them into dlogits in place and runs two
    matmuls over all rows (dhidden, dweight): three GEMM passes in all. Otherwise the logits exist
    one token chunk at a time, in the forward and again (recomputed) in the backward, whose
    dweight sums fp32 per-chunk partials in chunk order (four passes and a running sum)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, labels_flat, temperature, ignore_index, entropy, config, chunk, keep, softcap):  # type: ignore[override]
        rows = hidden2d.shape[0]
        device = hidden2d.device
        logits = None
        if keep:
            logits = matmul(hidden2d, weight.t())
            capped = logits if softcap is None else softcap_logits(logits, softcap)
            logprob, ent, lse = _token_forward(
                capped, labels_flat, row_offsets(capped), temperature, ignore_index, entropy, config
            )
            del capped
        else:
            outs = []
            for start in range(0, rows, chunk):
                part = matmul(hidden2d[start : start + chunk], weight.t())
                if softcap is not None:  # Gemma 2's final logit soft-capping: the unfused path's kernel
                    part = softcap_logits(part, softcap)
                labels = labels_flat[start : start + chunk]
                outs.append(_token_forward(part, labels, row_offsets(part), temperature, ignore_index, entropy, config))
            empty = torch.empty(0, dtype=torch.float32, device=device)
            logprob = torch.cat([o[0] for o in outs]) if outs else empty
            lse = torch.cat([o[2] for o in outs]) if outs else empty
            ent = torch.cat([o[1] for o in outs]) if entropy and outs else None
        if entropy and ent is None:
            ent = torch.empty(rows, dtype=torch.float32, device=device)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden2d, weight, labels_flat, lse, ent)
        ctx.logits, ctx.keep = logits, keep
        ctx.temperature, ctx.ignore_index, ctx.config, ctx.chunk = temperature, ignore_index, config, chunk
        ctx.softcap = softcap
        return logprob, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_h):  # type: ignore[override]
        hidden2d, weight, labels_flat, lse, ent = ctx.saved_tensors
        none = (None,) * 8
        if grad_lp is None and (grad_h is None or ent is None):
            return None, None, *none
        if not ctx.keep:
            return (*_streamed_backward(ctx, hidden2d, weight, labels_flat, lse, ent, grad_lp, grad_h), *none)
        # The kept logits become dlogits in place; a second backward (retain_graph) recomputes them
        # (the same bits: every logits row is a batch-invariant matmul row).
        raw, ctx.logits = ctx.logits, None
        if raw is None:
            raw = matmul(hidden2d, weight.t())
        logits = raw if ctx.softcap is None else softcap_logits(raw, ctx.softcap)
        dlogits = token_logprobs_backward(
            logits,
            labels_flat,
            row_offsets(logits),
            lse,
            ent,
            grad_lp,
            grad_h if ent is not None else None,
            ctx.temperature,
            ctx.ignore_index,
            ctx.config,
            out=logits,
        )
        if ctx.softcap is not None:
            dlogits = softcap_backward(raw, dlogits, ctx.softcap)
        grad_hidden = matmul(dlogits, weight) if ctx.needs_input_grad[0] else None
        grad_weight = matmul(dlogits.t(), hidden2d) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, *none


def _streamed_backward(ctx, hidden2d, weight, labels_flat, lse, ent, grad_lp, grad_h):
    """The backward without kept logits: per token chunk, logits recomputed, dlogits, dhidden rows
    (``dlogits @ weight``, the bits of the one-matmul form) and an fp32 dweight partial added to the
    running sum in chunk order (in the matmul's epilogue, the running sum as its bias); one cast."""
    want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_hidden = torch.empty_like(hidden2d, memory_format=torch.contiguous_format) if want_hidden else None
    grad_weight = None
    for start in range(0, hidden2d.shape[0], ctx.chunk):
        part = slice(start, start + ctx.chunk)
        rows = hidden2d[part]
        raw = matmul(rows, weight.t())
        logits = raw if ctx.softcap is None else softcap_logits(raw, ctx.softcap)
        dlogits = token_logprobs_backward(
            logits,
            labels_flat[part],
            row_offsets(logits),
            lse[part],
            ent[part] if ent is not None else None,
            grad_lp[part] if grad_lp is not None else None,
            grad_h[part] if grad_h is not None and ent is not None else None,
            ctx.temperature,
            ctx.ignore_index,
            ctx.config,
            out=logits,
        )
        if ctx.softcap is not None:
            dlogits = softcap_backward(raw, dlogits, ctx.softcap)
        if want_hidden:
            grad_hidden[part] = matmul(dlogits, weight)
        if not want_weight:
            continue
        if grad_weight is None:
            grad_weight = matmul(dlogits.t(), rows, out_dtype=torch.float32)
        else:
            running = grad_weight.unsqueeze(0)
            launch_matmul(dlogits.t().unsqueeze(0), rows.unsqueeze(0), running, running)
    if want_weight and grad_weight is None:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return grad_hidden, grad_weight.to(weight.dtype) if want_weight else None


def check_linear_logprobs_args(
    hidden: torch.Tensor, weight: torch.Tensor, token_chunk: int, *, same_dtype: bool = True
) -> None:
    """``ValueError`` naming the argument unless :func:`linear_token_logprobs` takes ``hidden [..., H]``,
    ``weight [V, H]`` (a supported dtype, ``hidden``'s dtype and device) and ``token_chunk`` (a positive
    int). ``same_dtype=False`` leaves the dtypes to a caller that casts both next (autocast)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError("hidden must be a tensor [..., H] with at least one dimension")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {got}")
    if same_dtype:
        dtype_name(hidden.dtype, "hidden.dtype")
        check_logits(weight.t(), "weight")
    if (same_dtype and weight.dtype != hidden.dtype) or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if isinstance(token_chunk, bool) or not isinstance(token_chunk, int) or token_chunk < 1:
        raise ValueError(f"token_chunk must be a positive int, got {token_chunk!r}")


@compiled_by("linear_token_logprobs")  # torch.compile: samepath::linear_token_logprobs (lm_head_op.py)
def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
    token_chunk: int = LM_HEAD_TOKEN_CHUNK,
    validate: bool = True,
    save_logits: bool = True,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(linear(hidden, weight), labels, temperature)``, the lm_head and the logprobs
    fused: without gradients over fixed chunks of ``token_chunk`` rows (no ``[tokens, vocab]``
    logits); with them, in three GEMM passes (see Returns).

    Bit-identical (logprobs and entropy) to ``token_logprobs(samepath.linear(hidden, weight), ...)``
    — what a rollout that materialises its logits computes — because every logits row is
    samepath's batch-invariant matmul row and every logprob row is reduced alone.

    Args:
        hidden: ``[..., H]`` hidden states (float32 / bfloat16 / float16).
        weight: ``[V, H]`` lm_head weight, same dtype and device.
        labels, temperature, return_entropy, ignore_index, config, validate: as
            :func:`token_logprobs`.
        token_chunk: rows per chunk (a positive int).
        save_logits: with gradients, keep all tokens' logits (``[tokens, vocab]`` in the input dtype,
            reused for their gradient) for three GEMM passes and the unfused dweight bits
            (default); ``False``: only ``[token_chunk, vocab]`` logits at a time, recomputed in the
            backward, dweight summed from fp32 per-chunk partials (other bits, deterministic).
        softcap: final logit soft-capping (Gemma 2): the logits go through
            :func:`samepath.kernels.softcap.softcap_logits` first, the bits of
            ``token_logprobs(softcap_logits(linear(hidden, weight), softcap), ...)``, forward and backward.

    Returns:
        fp32 ``[...]`` logprobs (and entropy). Differentiable in ``hidden`` and ``weight``: both
        gradients (dweight: unless ``save_logits=False``) equal the unfused backward's bit for bit
        (``dlogits @ weight`` and ``dlogits^T @ hidden``, one matmul each over all rows). When a
        gradient will be taken, the ``[tokens, vocab]`` logits are kept in the input dtype from the
        forward to the backward (which overwrites them with dlogits): three GEMM passes rather than
        four, and half the memory of the fp32 upcast a stock loss holds; without one (or with
        ``save_logits=False``), only ``[token_chunk, vocab]`` logits exist at a time.
    """
    check_linear_logprobs_args(hidden, weight, token_chunk)
    temperature = check_temperature(temperature)
    softcap = check_softcap(softcap)
    check_labels(labels, hidden, weight.shape[0], ignore_index, validate=validate)
    cfg = resolve_config(config, hidden.device)
    lead = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    labels_flat = labels.reshape(-1).contiguous()
    if not isinstance(save_logits, bool):
        raise ValueError(f"save_logits must be a bool, got {save_logits!r}")
    keep = save_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprob, entropy = LinearTokenLogprobsFunction.apply(
        hidden2d, weight, labels_flat, temperature, ignore_index, return_entropy, cfg, token_chunk, keep, softcap
    )
    if return_entropy:
        return logprob.reshape(lead), entropy.reshape(lead)
    return logprob.reshape(lead)


def log_softmax(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """fp32 ``log_softmax(logits.float() / temperature, dim=-1)`` with the fixed chunked lse.

    The lse is the one :func:`token_logprobs` computes, so ``log_softmax(x, T).gather(-1, l)``
    equals ``token_logprobs(x, l, T)`` bitwise. Returns ``[..., V]`` fp32; differentiable in
    ``logits`` (gradient in ``logits.dtype``, deterministic).
    """
    check_logits(logits)
    temperature = check_temperature(temperature)
    cfg = resolve_config(config, logits.device)
    return LogSoftmaxFunction.apply(logits, temperature, cfg)


def _log_softmax(input: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """``aten::_log_softmax(input, dim, half_to_float)`` on samepath's schedule (temperature 1).

    Only the last dimension is supported (``ValueError`` otherwise). The result is computed in
    fp32 and returned in fp32 when ``half_to_float`` (or for fp32 input), else cast once to
    ``input.dtype``. No autograd here: registered below the autograd key, aten's own derivative
    (``_log_softmax_backward_data``) applies.
    """
    if not isinstance(input, torch.Tensor):
        raise ValueError(f"input must be a tensor, got {type(input).__name__}")
    ndim = max(input.dim(), 1)
    if dim not in (-1, ndim - 1):
        raise ValueError(f"dim must be the last dimension (-1 or {ndim - 1}) for samepath's log_softmax, got {dim}")
    logits = input.reshape(1) if input.dim() == 0 else input
    check_logits(logits, "input")
    cfg = row_reduce_config(logits.device)
    with torch.no_grad():
        out, _ = _log_softmax_forward(logits, row_offsets(logits), 1.0, cfg)
    if not half_to_float:
        out = out.to(input.dtype)
    return out.reshape(input.shape)


def _log_softmax_override(input: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """``aten::_log_softmax`` inside :func:`samepath.batch_invariant`: samepath's schedule over the
    last dimension of fp32/bf16/fp16 tensors, torch's own kernel (the ``.out`` overload, which is
    not overridden) for everything else."""
    if (
        input.dim() > 0
        and dim in (-1, input.dim() - 1)
        and input.dtype in SUPPORTED_DTYPES
        and input.device.type in SUPPORTED_DEVICE_TYPES
    ):
        return _log_softmax(input, dim, half_to_float)
    out = torch.empty(0, dtype=torch.float32 if half_to_float else input.dtype, device=input.device)
    return torch.ops.aten._log_softmax.out(input, dim, half_to_float, out=out)


register_override("_log_softmax", _log_softmax_override)

__all__ = [
    "IGNORE_INDEX",
    "LM_HEAD_TOKEN_CHUNK",
    "LOGPROBS_FORMULA",
    "check_labels",
    "check_linear_logprobs_args",
    "check_logits",
    "check_temperature",
    "linear_token_logprobs",
    "log_softmax",
    "resolve_config",
    "row_lse",
    "row_offsets",
    "token_logprobs",
    "token_logprobs_backward",
]
