"""The short causal depthwise conv1d of the Gated DeltaNet layers (Qwen3-Next, Qwen3.5), with its state.

One kernel for every caller (the trainer's padded or packed forward, ``generate``'s prefill and decode,
vLLM's prefill and decode), element by element::

    acc = bias[d] (fp32, 0 without a bias)
    for j in 0 .. W - 1 (ascending):  acc = acc + w[d, j] * x[t - (W - 1) + j, d]      # fp32, no fusion
    y = acc rounded to x's dtype;  with activation "silu":  y = (y / (1 + exp(-y))) rounded to the dtype

``x`` rows before the sequence's first token come from ``state`` (the sequence's last ``W - 1`` inputs
before this call; zeros without one). The rounding points are Hugging Face's (``F.conv1d`` in the
dtype, then ``F.silu`` of it); every output depends only on its own ``W`` inputs, so prefill, chunked
prefill, packed sequences and decode give the same bits. The new state (the last ``W - 1`` inputs of
each sequence, the old state's included where the call is shorter) is a copy, no arithmetic.

Backward (:class:`_CausalConv1d`), three Triton kernels, deterministic (no atomics): the pre-activation
gradient ``da = dy * s * (1 + y * (1 - s))`` (``s = 1 / (1 + exp(-y))`` of the rounded ``y``; ``da = dy``
without SiLU) by the forward kernel in its ``BACKWARD`` mode; ``dx[s] = sum_j w[d, j] * da[s + W - 1 - j]``
over the taps (ascending) whose output is in s's sequence; ``dw[d, j] = sum_t da[t, d] * x_j[t, d]`` and
``dbias = sum_t da`` as ``[BLOCK_T, BLOCK_D]`` fp32 tiles accumulated over the token blocks in order, then
summed over the tile's rows. The initial state is not differentiated.

API (what vLLM's and Hugging Face's layers call)::

    causal_conv1d(x [T, D], weight [D, W], bias [D] | None, cu_seqlens [N + 1], state [N, D, W - 1] | None,
                  activation="silu" | None) -> (out [T, D] in x's dtype, new_state [N, D, W - 1] in x's dtype)
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from samepath.kernels.config import register_formula
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.opaque import register

#: Channels and tokens one program handles: neutral for the forward and dx (elementwise), the tile of the
#: weight gradient's sums (in the formula).
BLOCK_D = 64
BLOCK_T = 16
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = (None, "silu")

CAUSAL_CONV1D_FORMULA = {
    "taps": "acc = bias (fp32, else 0); acc = acc + w[d, j] * x[t - (W - 1) + j, d] for j ascending, fp32, "
    "no fp fusion; rows before the sequence start from the state (zeros without one)",
    "rounding": "acc rounded to the input dtype (Hugging Face's conv1d output)",
    "silu": "fp32 y / (1 + exp(-y)) of the rounded y, rounded once to the input dtype",
    "state": "the last W - 1 inputs of each sequence (old state included), copied",
    "backward": "da = dy * s * (1 + y * (1 - s)), s = 1 / (1 + exp(-y)) of the rounded y (da = dy without silu); "
    "dx = sum over taps j ascending (outputs in the sequence) of w[d, j] * da[s + W - 1 - j]; dw[d, j] and dbias: "
    f"[{BLOCK_T}, {BLOCK_D}] fp32 tiles of da * x_j accumulated over token blocks in order, then a row sum",
}
register_formula("causal_conv1d", CAUSAL_CONV1D_FORMULA)


@jit
def _tap_input(X, State, rows, cols, seq, start, mask, j, D, WIDTH: tl.constexpr, HAS_STATE: tl.constexpr):
    """Tap ``j``'s fp32 input ``[BLOCK_T, BLOCK_D]`` for output rows ``rows``: ``X[rows - (WIDTH - 1) + j]``
    inside the row's sequence (first row ``start``), before it the sequence's conv state ``State[seq]``
    (with ``HAS_STATE``; else 0). The forward and the weight gradient read their taps through it."""
    src = rows - (WIDTH - 1) + j
    inside = src >= start
    xv = tl.load(X + src.to(tl.int64)[:, None] * D + cols[None, :], mask=mask & inside[:, None], other=0.0).to(
        tl.float32
    )
    if HAS_STATE:
        slot = (WIDTH - 1) + src - start
        sv = tl.load(
            State + (seq.to(tl.int64) * D)[:, None] * (WIDTH - 1) + cols[None, :] * (WIDTH - 1) + slot[:, None],
            mask=mask & (src < start)[:, None],
            other=0.0,
        ).to(tl.float32)
        xv = tl.where(inside[:, None], xv, sv)
    return xv


@jit
def _causal_conv1d_kernel(
    X,
    W,
    Bias,
    State,
    SeqId,
    Starts,
    Out,
    DOut,
    T,
    D,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    SILU: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token block, channel block): ``Out[t, d]`` by the module docstring's formula; with
    ``BACKWARD``, the gradient of the pre-activation instead, fp32 ``DOut * silu'(y)`` (``DOut`` without
    SiLU) into ``Out``. X / Out / DOut ``[T, D]``, W ``[D, WIDTH]``, Bias ``[D]``, State ``[N, D, WIDTH - 1]``
    (contiguous), SeqId / Starts ``[T]`` int32 (each token's sequence and its first token's row)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    seq = tl.load(SeqId + rows, mask=row_ok, other=0)
    start = tl.load(Starts + rows, mask=row_ok, other=0)
    if HAS_BIAS:
        acc = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] + tl.zeros(
            (BLOCK_T, BLOCK_D), dtype=tl.float32
        )
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        w = tl.load(W + cols * WIDTH + j, mask=col_ok, other=0.0).to(tl.float32)
        xv = _tap_input(X, State, rows, cols, seq, start, mask, j, D, WIDTH, HAS_STATE)
        acc = acc + w[None, :] * xv
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    if BACKWARD:
        dy = tl.load(DOut + offs, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            y = acc.to(X.dtype.element_ty).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-y))
            dy = dy * (sig * (1.0 + y * (1.0 - sig)))
        tl.store(Out + offs, dy, mask=mask)
    else:
        y = acc.to(Out.dtype.element_ty).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=mask)


@jit
def _causal_conv1d_dx_kernel(
    DAcc, W, Ends, DX, T, D, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Program (token block, channel block): ``DX[s, d] = sum_j w[d, j] * DAcc[s + WIDTH - 1 - j, d]`` over the
    taps j ascending whose output row is in s's sequence (``Ends [T]``: each token's sequence end), fp32,
    rounded to DX's dtype. DAcc ``[T, D]`` fp32 (the pre-activation gradient)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = cols < D
    end = tl.load(Ends + rows, mask=row_ok, other=0)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        target = rows + (WIDTH - 1) - j
        ok = row_ok & (target < end)
        w = tl.load(W + cols * WIDTH + j, mask=col_ok, other=0.0).to(tl.float32)
        dv = tl.load(
            DAcc + target.to(tl.int64)[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        )
        acc = acc + w[None, :] * dv
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(DX + rows.to(tl.int64)[:, None] * D + cols[None, :], acc.to(DX.dtype.element_ty), mask=mask)


@jit
def _causal_conv1d_dw_kernel(
    X,
    State,
    SeqId,
    Starts,
    DAcc,
    DW,
    T,
    D,
    WIDTH: tl.constexpr,
    HAS_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (channel block, tap j; ``j == WIDTH``: the bias): ``DW[d, j] = sum_t DAcc[t, d] * x_j[t, d]``
    (the tap's input as the forward reads it; 1 for the bias), a ``[BLOCK_T, BLOCK_D]`` fp32 tile accumulated
    over the token blocks in order, then summed over its rows. Deterministic (no atomics); DW
    ``[D, WIDTH + 1]`` fp32."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.program_id(1)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        mask = row_ok[:, None] & col_ok[None, :]
        dv = tl.load(DAcc + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=mask, other=0.0)
        if j < WIDTH:
            seq = tl.load(SeqId + rows, mask=row_ok, other=0)
            start = tl.load(Starts + rows, mask=row_ok, other=0)
            xv = _tap_input(X, State, rows, cols, seq, start, mask, j, D, WIDTH, HAS_STATE)
            acc = acc + dv * xv
        else:
            acc = acc + dv
    tl.store(DW + cols * (WIDTH + 1) + j, tl.sum(acc, axis=0), mask=col_ok)


def _backward(x, weight, bias, cu_seqlens, state, activation, d_out):
    """``(dx, dweight, dbias)`` by the three kernels: the pre-activation gradient, then dx and the weight / bias
    sums (each in a fixed order)."""
    total, d = x.shape
    width = weight.shape[1]
    dacc = _launch(x, weight, bias, cu_seqlens, state, activation, d_out)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.zeros((d, width + 1), dtype=torch.float32, device=x.device)
    if total and d:
        seq, starts = _token_maps(cu_seqlens, total)
        ends = cu_seqlens.to(torch.int64)[1:][seq.to(torch.int64)].to(torch.int32)
        _causal_conv1d_dx_kernel[(triton.cdiv(total, BLOCK_T), triton.cdiv(d, BLOCK_D))](
            dacc, weight.contiguous(), ends, dx, total, d, WIDTH=width, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D
        )
        _causal_conv1d_dw_kernel[(triton.cdiv(d, BLOCK_D), width + (bias is not None))](
            x.contiguous(), state.contiguous() if state is not None else x, seq, starts, dacc, dw, total, d,
            WIDTH=width, HAS_STATE=state is not None and width > 1, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
        )  # fmt: skip
    dbias = dw[:, width].to(bias.dtype) if bias is not None else None
    return dx, dw[:, :width].to(weight.dtype), dbias


def _check(x, weight, bias, cu_seqlens, state, activation) -> tuple[int, int, int]:
    """Validate the operands; returns ``(N, D, W)``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _FLOATS:
        raise ValueError(f"x must be a [T, D] float32 / bfloat16 / float16 tensor, got {getattr(x, 'shape', x)}")
    device_kind(x.device)
    d = x.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be [D, W] = [{d}, W], got {getattr(weight, 'shape', weight)}")
    width = weight.shape[1]
    if not 1 <= width <= 8:
        raise ValueError(f"weight's width W must be in [1, 8], got {width}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (d,)):
        raise ValueError(f"bias must be None or [D] = [{d}], got {getattr(bias, 'shape', bias)}")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-d integer tensor [N + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 / int64, got {cu_seqlens.dtype}")
    n = cu_seqlens.numel() - 1
    if state is not None:
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != (n, d, width - 1):
            raise ValueError(
                f"state must be None or [N, D, W - 1] = {[n, d, width - 1]}, got {getattr(state, 'shape', state)}"
            )
        if state.dtype != x.dtype:
            raise ValueError(f"state must have x's dtype {x.dtype}, got {state.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("cu_seqlens", cu_seqlens), ("state", state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    return n, d, width


def _check_cu_values(cu_seqlens: torch.Tensor, total: int) -> None:
    """``cu_seqlens`` rises from 0 to ``total`` (a host read)."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {total}, got {cu}")


def _token_maps(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's sequence index and its sequence's first row (int32, on the device, no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    return seq.to(torch.int32), cu[seq].to(torch.int32)


def _launch(x, weight, bias, cu_seqlens, state, activation, d_out=None) -> torch.Tensor:
    """The forward (``out`` in x's dtype), or with ``d_out`` the pre-activation gradient (fp32)."""
    total, d = x.shape
    width = weight.shape[1]
    dtype = x.dtype if d_out is None else torch.float32
    out = torch.empty((total, d), dtype=dtype, device=x.device)
    if total == 0 or d == 0:
        return out
    seq, starts = _token_maps(cu_seqlens, total)
    x = x.contiguous()
    _causal_conv1d_kernel[(triton.cdiv(total, BLOCK_T), triton.cdiv(d, BLOCK_D))](
        x,
        weight.contiguous(),
        bias.contiguous() if bias is not None else x,
        state.contiguous() if state is not None else x,
        seq,
        starts,
        out,
        d_out.contiguous() if d_out is not None else x,
        total,
        d,
        WIDTH=width,
        HAS_BIAS=bias is not None,
        HAS_STATE=state is not None and width > 1,
        SILU=activation == "silu",
        BACKWARD=d_out is not None,
        BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D,
    )
    return out


def next_state(x: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last ``width - 1`` inputs of each sequence of ``x`` (packed by ``cu_seqlens``) after ``state``
    (``[N, D, W - 1]``, zeros when ``None``): ``[N, D, W - 1]`` in x's dtype, a copy (gathered on the device)."""
    n, d, keep = cu_seqlens.numel() - 1, x.shape[1], width - 1
    if state is None:
        state = x.new_zeros((n, d, keep))
    if keep == 0:
        return state.clone()
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    virtual = lengths[:, None] + torch.arange(keep, device=x.device)[None, :]  # index into [state, x_n]
    from_x = virtual >= keep
    x_rows = (cu[:-1, None] + virtual - keep).clamp(min=0, max=max(x.shape[0] - 1, 0))
    x_part = x[x_rows.reshape(-1)].reshape(n, keep, d).transpose(1, 2) if x.shape[0] else state
    s_part = state.gather(2, virtual.clamp(max=keep - 1)[:, None, :].expand(n, d, keep))
    return torch.where(from_x[:, None, :], x_part, s_part).contiguous()


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cu_seqlens, state, activation):  # type: ignore[override]
        out = _launch(x, weight, bias, cu_seqlens, state, activation)
        ctx.save_for_backward(x, weight, bias, cu_seqlens, state)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        x, weight, bias, cu_seqlens, state = ctx.saved_tensors
        dx, dw, db = _backward(x, weight, bias, cu_seqlens, state, ctx.activation, d_out)
        return dx, dw, db, None, None, None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv1d over packed sequences (see the module docstring).

    Args:
        x: ``[T, D]`` float32 / bfloat16 / float16 inputs, the sequences packed by ``cu_seqlens``.
        weight: ``[D, W]`` taps (``nn.Conv1d(D, D, W, groups=D).weight[:, 0]``); bias ``[D]`` or ``None``.
        cu_seqlens: ``[N + 1]`` int32 / int64 sequence starts.
        state: ``[N, D, W - 1]`` in x's dtype, each sequence's last ``W - 1`` inputs before this call
            (``None``: the sequences start here). Not differentiated.
        activation: ``"silu"`` (fused, Hugging Face's rounding points) or ``None``.
        validate: ``False`` trusts the values of ``cu_seqlens`` (rising from 0 to T) instead of reading
            them on the host (one sync); callers that build them (the layers' decode and prefill) pass it.

    Returns:
        ``(out [T, D] in x's dtype, new_state [N, D, W - 1])``; ``out`` differentiable in x, weight, bias.
    """
    width = _check(x, weight, bias, cu_seqlens, state, activation)[2]
    if state is not None and state.requires_grad and torch.is_grad_enabled():
        raise ValueError("state: gradients into the conv state are not supported (detach it)")
    if torch.compiler.is_compiling():  # the values of cu_seqlens are checked by the op (on real tensors)
        out = torch.ops.samepath.causal_conv1d(x, weight, bias, cu_seqlens, state, activation, bool(validate))
    else:
        if validate:
            _check_cu_values(cu_seqlens, x.shape[0])
        out = _CausalConv1d.apply(x, weight, bias, cu_seqlens, state, activation)
    return out, next_state(x.detach(), cu_seqlens, None if state is None else state.detach(), width)


# ``torch.compile``: ``samepath::causal_conv1d`` and its backward op (the same launches as _CausalConv1d).
@torch.library.custom_op(register("causal_conv1d"), mutates_args=())
def _causal_conv1d_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor | None,
    activation: str | None,
    validate: bool = True,
) -> torch.Tensor:
    if validate:
        _check_cu_values(cu_seqlens, x.shape[0])
    return _launch(x, weight, bias, cu_seqlens, state, activation)


@_causal_conv1d_op.register_fake
def _(x, weight, bias, cu_seqlens, state, activation, validate=True):
    return x.new_empty(x.shape)


@torch.library.custom_op(register("causal_conv1d_backward"), mutates_args=())
def _causal_conv1d_backward_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor | None,
    activation: str | None,
    d_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _backward(x, weight, bias, cu_seqlens, state, activation, d_out)
    # fp32: dw and db are views of one buffer (an op's outputs may not alias): copies, the same bits
    return dx, dw.clone(), db.clone() if db is not None else x.new_empty((0,))


@_causal_conv1d_backward_op.register_fake
def _(x, weight, bias, cu_seqlens, state, activation, d_out):
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        (bias if bias is not None else x).new_empty(bias.shape if bias is not None else (0,)),
    )


def _causal_conv1d_setup(ctx, inputs, output):
    x, weight, bias, cu_seqlens, state, ctx.activation, _validate = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, cu_seqlens, state)


def _causal_conv1d_grad(ctx, d_out):
    x, weight, bias, cu_seqlens, state = ctx.saved_tensors
    dx, dw, db = torch.ops.samepath.causal_conv1d_backward(x, weight, bias, cu_seqlens, state, ctx.activation, d_out)
    return dx, dw, db if ctx.has_bias else None, None, None, None, None


_causal_conv1d_op.register_autograd(_causal_conv1d_grad, setup_context=_causal_conv1d_setup)


__all__ = ["ACTIVATIONS", "CAUSAL_CONV1D_FORMULA", "causal_conv1d", "next_state"]
