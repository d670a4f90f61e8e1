"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): one schedule anchored at position 0.

The recurrent rule (Hugging Face's ``torch_recurrent_gated_delta_rule``), per value head, with
``q``, ``k`` L2-normalised in fp32 and ``q`` scaled by ``Dk ** -0.5``::

    S_t = exp(g_t) * S_{t-1};  S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

Schedule (the same for prefill, chunked prefill split anywhere, packed sequences and decode): the
fp32 state ``S [Dk, Dv]`` exists only at chunk boundaries, multiples of :data:`CHUNK` tokens from
each sequence's first token. Token ``t``'s output is computed from the state at its chunk's start
and the tokens of its chunk up to ``t``, by the chunk formula of
:data:`samepath.kernels.config.GATED_DELTA_FORMULA` (UT transform by forward substitution, every
cross-token term behind an exact lower-triangular mask, so a row's bits never depend on the tokens
after it); a full chunk produces the next boundary state by the one update formula.
A continuation (decode included) keeps the boundary state plus the ``<= C - 1`` tokens since it
(their keys, values, gates, betas), recomputes that partial chunk with the new tokens appended (query
rows of the old tokens zero, their outputs discarded) and applies the update when the chunk fills:
every output and state has the bits of the one-call prefill. A decode step therefore costs one chunk
tile (``O(C^3 + C^2 (Dk + Dv) + C Dk Dv)``), not a per-token recurrence. Two forms:
:func:`gated_delta_continue` (a packed :class:`GatedDeltaCache`, host-side bookkeeping) and
:func:`gated_delta_continue_slots` (per-slot buffers :class:`GatedDeltaSlots` updated in place on the
device, no host sync: vLLM's state cache, ``generate``), the same kernel reading the tail from the
slot.

Programs: one per (sequence, value head, block of :data:`V_BLOCK` value columns), walking its
chunks in order (the state slice stays in registers). Dots take fp32 operands with fp32
accumulation: :data:`DOT_PRECISION` ``tf32x3`` on NVIDIA (three tf32 products, near-fp32), ``ieee`` on
Ascend, fp32 products in the interpreter and the replay (which ignore ``input_precision``).

Backward: the Triton kernel of :mod:`samepath.kernels.gated_delta_bwd`, deterministic (no atomics,
fixed orders): the forward rerun with ``STORE_STATES`` stores the state at every chunk start and the
chunk's UT transform, then the chunks are walked in reverse recomputing the other chunk quantities
(the formula row ``backward``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from samepath.kernels import config
from samepath.kernels.config import GATED_DELTA_CHUNK
from samepath.kernels.dispatch import jit
from samepath.kernels.gated_delta_bwd import gated_delta_backward
from samepath.kernels.opaque import register

#: The frozen chunk size (tokens); part of the fingerprint through ``GATED_DELTA_FORMULA``.
CHUNK = GATED_DELTA_CHUNK
#: The L2 norm's epsilon (FLA's and Hugging Face's ``l2norm``).
L2_EPS = 1e-6
#: Value columns per program (frozen): the state tile is ``[BLOCK_K, V_BLOCK]``.
V_BLOCK = 32
#: ``tl.dot`` precision of the fp32 operands by device kind: three tf32 products on NVIDIA (near-fp32, on
#: the tensor cores); ieee on Ascend (Triton-Ascend refuses tf32). The interpreter and the replay compute
#: fp32 products whatever it says.
DOT_PRECISION = {"cuda": "tf32x3", "npu": "ieee", "cpu": "ieee"}


def dot_precision(device: torch.device) -> str:
    """:data:`DOT_PRECISION` of ``device``'s kind."""
    return DOT_PRECISION[config.device_kind(device)]


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@jit
def _gated_delta_fwd_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    S0,
    Out,
    SOut,
    CuSeqlens,
    SlotIds,
    TailLen,
    Initial,
    TailK,
    TailV,
    TailG,
    TailB,
    States,
    TMat,
    ChunkBase,
    HK,
    HV,
    DK,
    DV,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    HAS_S0: tl.constexpr,
    SLOTS: tl.constexpr,
    STORE_STATES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (sequence n, value head h, value block vb): outputs of every token of the sequence and
    the state at its last chunk boundary, value columns ``vb * BLOCK_V ...`` (the chunk's UT transform,
    ``w`` and the intra-chunk scores are recomputed per value block, the same bits).
    Q, K ``[T, HK, DK]``, V / Out ``[T, HV, DV]``, G / Beta ``[T, HV]`` fp32,
    S0 / SOut ``[N, HV, DK, DV]`` fp32, all contiguous.

    ``SLOTS``: sequence n continues slot ``SlotIds[n]``: its ``TailLen[n]`` (gathered per sequence, 0
    for a fresh one) tail tokens ``TailK [S, C, HK, DK]``, ``TailV [S, C, HV, DV]``, ``TailG`` /
    ``TailB [S, C, HV]`` come first (query rows zero, outputs not stored), then its new tokens; the
    state is read (where ``Initial[n]``, else zeros) from and written back to ``S0 = SOut [S, HV, DK,
    DV]`` at the slot (each program its own slice).

    ``STORE_STATES`` (the backward's recompute): the state at the start of chunk ``c`` of sequence n is
    also stored to ``States [ChunkBase[n] + c, HV, DK, DV]``, the chunk's UT transform to ``TMat
    [ChunkBase[n] + c, HV, CHUNK, CHUNK]`` (by the value block 0's program)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (HV // HK)
    start = tl.load(CuSeqlens + n).to(tl.int64)
    length = (tl.load(CuSeqlens + n + 1) - tl.load(CuSeqlens + n)).to(tl.int32)
    rows = tl.arange(0, CHUNK_SIZE)
    kd = tl.arange(0, BLOCK_K)
    vd = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    state_mask = (kd[:, None] < DK) & (vd[None, :] < DV)
    if SLOTS:
        slot = tl.load(SlotIds + n).to(tl.int64)
        tail = tl.load(TailLen + n).to(tl.int32)
        state_offs = (slot * HV + h) * DK * DV + kd[:, None] * DV + vd[None, :]
        S = tl.load(S0 + state_offs, mask=state_mask, other=0.0)
        S = tl.where(tl.load(Initial + n) != 0, S, 0.0)
    else:
        tail = 0
        state_offs = (n * HV + h).to(tl.int64) * DK * DV + kd[:, None] * DV + vd[None, :]
        if HAS_S0:
            S = tl.load(S0 + state_offs, mask=state_mask, other=0.0)
        else:
            S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for c0 in range(0, tail + length, CHUNK_SIZE):
        if STORE_STATES:
            chunk = (tl.load(ChunkBase + n) + c0 // CHUNK_SIZE).to(tl.int64)
            tl.store(States + (chunk * HV + h) * DK * DV + kd[:, None] * DV + vd[None, :], S, mask=state_mask)
        if SLOTS:
            valid = (c0 + rows) < tail + length
            old = (c0 + rows) < tail
            new = valid & (c0 + rows >= tail)
            tok = start + c0 + rows - tail
            trow = slot * CHUNK_SIZE + c0 + rows
            qk_mask = new[:, None] & (kd[None, :] < DK)
            v_mask = new[:, None] & (vd[None, :] < DV)
            old_k = old[:, None] & (kd[None, :] < DK)
            old_v = old[:, None] & (vd[None, :] < DV)
            qk_offs = (tok[:, None] * HK + hk) * DK + kd[None, :]
            tk_offs = (trow[:, None] * HK + hk) * DK + kd[None, :]
            tv_offs = (trow[:, None] * HV + h) * DV + vd[None, :]
            q = tl.load(Q + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
            k = tl.where(
                old_k,
                tl.load(TailK + tk_offs, mask=old_k, other=0.0).to(tl.float32),
                tl.load(K + qk_offs, mask=qk_mask, other=0.0).to(tl.float32),
            )
            v = tl.where(
                old_v,
                tl.load(TailV + tv_offs, mask=old_v, other=0.0).to(tl.float32),
                tl.load(V + (tok[:, None] * HV + h) * DV + vd[None, :], mask=v_mask, other=0.0).to(tl.float32),
            )
            g = tl.where(
                old, tl.load(TailG + trow * HV + h, mask=old, other=0.0), tl.load(G + tok * HV + h, mask=new, other=0.0)
            )
            b = tl.where(
                old,
                tl.load(TailB + trow * HV + h, mask=old, other=0.0),
                tl.load(Beta + tok * HV + h, mask=new, other=0.0),
            )
        else:
            valid = (c0 + rows) < length
            tok = start + c0 + rows
            qk_mask = valid[:, None] & (kd[None, :] < DK)
            v_mask = valid[:, None] & (vd[None, :] < DV)
            qk_offs = (tok[:, None] * HK + hk) * DK + kd[None, :]
            q = tl.load(Q + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
            k = tl.load(K + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
            v = tl.load(V + (tok[:, None] * HV + h) * DV + vd[None, :], mask=v_mask, other=0.0).to(tl.float32)
            g = tl.load(G + tok * HV + h, mask=valid, other=0.0)
            b = tl.load(Beta + tok * HV + h, mask=valid, other=0.0)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + EPS))[:, None]
        q = q * SCALE
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + EPS))[:, None]
        gc = tl.cumsum(g, axis=0)
        gc_last = tl.sum(tl.where(rows == CHUNK_SIZE - 1, gc, 0.0), axis=0)
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
        kb = k * b[:, None]
        a = tl.where(strict, tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
        # what needs q, k or the decays before the forward substitution (the same operations as after
        # it, fewer tiles live through it: sm_90 spills 6.2 KB instead of 7.5 KB)
        egc = tl.exp(gc)
        attn = tl.where(lower, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
        o = tl.dot(q * egc[:, None], S, input_precision=DOT_PRECISION)
        kbg = kb * egc[:, None]
        vbeta = v * b[:, None]
        kdec = k * tl.exp(gc_last - gc)[:, None]
        t = eye
        for i in range(1, CHUNK_SIZE):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
            row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)
            t = tl.where(rows[:, None] == i, row[None, :], t)
        if STORE_STATES:
            if vb == 0:
                chunk = (tl.load(ChunkBase + n) + c0 // CHUNK_SIZE).to(tl.int64)
                tl.store(TMat + ((chunk * HV + h) * CHUNK_SIZE + rows[:, None]) * CHUNK_SIZE + rows[None, :], t)
        u = tl.dot(t, vbeta, input_precision=DOT_PRECISION)
        w = tl.dot(t, kbg, input_precision=DOT_PRECISION)
        vnew = u - tl.dot(w, S, input_precision=DOT_PRECISION)
        o = tl.dot(attn, vnew, o, input_precision=DOT_PRECISION)
        tl.store(Out + (tok[:, None] * HV + h) * DV + vd[None, :], o.to(Out.dtype.element_ty), mask=v_mask)
        updated = tl.dot(tl.trans(kdec), vnew, S * tl.exp(gc_last), input_precision=DOT_PRECISION)
        S = tl.where(c0 + CHUNK_SIZE <= tail + length, updated, S)
    tl.store(SOut + state_offs, S, mask=state_mask)


def _check(q, k, v, g, beta, cu_seqlens, state, check_values: bool = True) -> tuple[int, int, int, int, int]:
    """Validate the packed operands; returns ``(N, HK, HV, DK, DV)``."""
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-d tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32 / bfloat16 / float16, got {t.dtype}")
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(
            f"k must match q's shape and dtype, got {tuple(k.shape)} {k.dtype} vs {tuple(q.shape)} {q.dtype}"
        )
    if v.dtype != q.dtype:
        raise ValueError(f"v must have q's dtype {q.dtype}, got {v.dtype}")
    total, hk, dk = q.shape
    if v.shape[0] != total:
        raise ValueError(f"v must have {total} tokens like q, got {v.shape[0]}")
    hv, dv = v.shape[1], v.shape[2]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's head count {hv} must be a multiple of q's {hk}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (total, hv):
            raise ValueError(f"{name} must be [T, HV] = [{total}, {hv}], got {tuple(t.shape)}")
    if not (1 <= dk <= 256 and 1 <= dv <= 256):
        raise ValueError(f"head sizes must be in [1, 256], got q/k {dk}, v {dv}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-d integer tensor [N + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 / int64, got {cu_seqlens.dtype}")
    if check_values:  # a host sync: the slot path trusts the values instead
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {total}, got {cu}")
    n = cu_seqlens.numel() - 1
    if state is not None:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.float32:
            raise ValueError("state must be a float32 tensor [N, HV, DK, DV]")
        if tuple(state.shape) != (n, hv, dk, dv):
            raise ValueError(f"state must be [N, HV, DK, DV] = {[n, hv, dk, dv]}, got {tuple(state.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens), ("state", state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return n, hk, hv, dk, dv


def _launch(q, k, v, g, beta, cu_seqlens, state, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    n, _hk, hv, dk, dv = _check(q, k, v, g, beta, cu_seqlens, state, check_values=validate)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s_out = torch.zeros((n, hv, dk, dv), dtype=torch.float32, device=v.device)
    s0 = state.contiguous() if state is not None else s_out
    _run_forward(q, k, v, g, beta, cu_seqlens.contiguous(), s0, out, s_out, state is not None, None)
    return out, s_out


def _run_forward(q, k, v, g, beta, cu_seqlens, s0, out, s_out, has_s0: bool, slots, states=None) -> None:
    """One launch of the forward kernel; ``slots``: ``None`` or ``(slot_ids, tail_len [N] int32,
    initial [N] int32, tail_k, tail_v, tail_g, tail_beta)`` (then ``s0 is s_out``, the slot states);
    ``states``: ``None`` or ``(states [chunks, HV, DK, DV] fp32, t [chunks, HV, C, C] fp32, chunk_base
    [N] int32)``."""
    n, hk, dk = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    block_k, block_v = max(16, triton.next_power_of_2(dk)), V_BLOCK
    # without slots the slot pointers are unused (any tensor of the launch's device)
    slot_args = slots if slots is not None else (cu_seqlens,) * 3 + (k, v, g, beta)
    _gated_delta_fwd_kernel[(n, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        s0,
        out,
        s_out,
        cu_seqlens,
        *slot_args,
        *(states if states is not None else (s_out, s_out, cu_seqlens)),
        hk,
        hv,
        dk,
        dv,
        SCALE=dk**-0.5,
        EPS=L2_EPS,
        HAS_S0=has_s0,
        SLOTS=slots is not None,
        STORE_STATES=states is not None,
        DOT_PRECISION=dot_precision(q.device),
        CHUNK_SIZE=CHUNK,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        num_warps=4,
    )


class _GatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, state, validate=True):
        out, s_out = _launch(q, k, v, g, beta, cu_seqlens, state, validate)
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, state)
        ctx.mark_non_differentiable(s_out)
        return out, s_out

    @staticmethod
    def backward(ctx, d_out, d_state):
        q, k, v, g, beta, cu_seqlens, state = ctx.saved_tensors
        grads = _backward(q, k, v, g, beta, cu_seqlens, state, d_out)
        return (
            *(gr.to(x.dtype) for gr, x in zip(grads[:5], (q, k, v, g, beta), strict=True)),
            None,
            grads[5] if state is not None else None,
            None,
        )


def _backward(q, k, v, g, beta, cu_seqlens, state, d_out):
    """The Triton backward: the forward rerun storing the state at every chunk start, then one
    program per (sequence, value head) walking the chunks in reverse
    (:func:`samepath.kernels.gated_delta_bwd.gated_delta_backward`). fp32 gradients."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta, cu = g.float().contiguous(), beta.float().contiguous(), cu_seqlens.contiguous()
    n, hv, dk, dv = cu.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2]
    chunks = torch.div(cu[1:] - cu[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
    chunk_base = (torch.cumsum(chunks, 0) - chunks).to(torch.int32)
    # sum(ceil(L / C)) <= T // C + N: a bound known on the host, no sync
    states = torch.empty((q.shape[0] // CHUNK + n, hv, dk, dv), dtype=torch.float32, device=q.device)
    t_mat = torch.empty((states.shape[0], hv, CHUNK, CHUNK), dtype=torch.float32, device=q.device)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s_out = torch.empty((n, hv, dk, dv), dtype=torch.float32, device=v.device)
    s0 = state.contiguous() if state is not None else s_out
    _run_forward(q, k, v, g, beta, cu, s0, out, s_out, state is not None, None, (states, t_mat, chunk_base))
    return gated_delta_backward(
        q,
        k,
        v,
        g,
        beta,
        d_out,
        cu,
        states,
        t_mat,
        chunk_base,
        scale=dk**-0.5,
        eps=L2_EPS,
        chunk=CHUNK,
        block_v=V_BLOCK,
        dot_precision=dot_precision(q.device),
    )


def chunk_gated_delta(q, k, v, g, beta, cu_seqlens, state=None, validate=True) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet over packed sequences, every sequence starting at a chunk boundary.

    Args:
        q, k: ``[T, HK, DK]`` (float32 / bfloat16 / float16), L2-normalised here (fp32).
        v: ``[T, HV, DV]``, q's dtype; ``HV`` a multiple of ``HK`` (each q/k head serves ``HV / HK``
            consecutive value heads).
        g: ``[T, HV]`` log decays (<= 0), beta ``[T, HV]``; taken in fp32.
        cu_seqlens: ``[N + 1]`` int32 / int64 sequence starts.
        state: optional fp32 ``[N, HV, DK, DV]`` boundary states the sequences continue from
            (differentiable).
        validate: ``False`` trusts the values of ``cu_seqlens`` (rising from 0 to T) instead of reading
            them on the host (a caller that built them on the device, e.g. from a padding mask).

    Returns:
        ``(out [T, HV, DV] in q's dtype, boundary_state [N, HV, DK, DV] fp32)``: the state after each
        sequence's last full chunk (not differentiated). Differentiable in q, k, v, g, beta and
        ``state`` by the deterministic Triton backward (see the module docstring).
    """
    if torch.compiler.is_compiling():  # the values of cu_seqlens are checked by the op (on real tensors)
        _check(q, k, v, g, beta, cu_seqlens, state, check_values=False)
        return tuple(torch.ops.samepath.chunk_gated_delta(q, k, v, g, beta, cu_seqlens, state, bool(validate)))
    return _GatedDelta.apply(q, k, v, g, beta, cu_seqlens, state, validate)


# ``torch.compile``: ``samepath::chunk_gated_delta`` and its backward op (the launches of _GatedDelta).
@torch.library.custom_op(register("chunk_gated_delta"), mutates_args=())
def _chunk_gated_delta_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor | None,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, v, g, beta, cu_seqlens, state, validate)


def _state_shape(q, v, cu_seqlens) -> tuple[int, int, int, int]:
    return cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2]


@_chunk_gated_delta_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, state, validate):
    return v.new_empty(v.shape), v.new_empty(_state_shape(q, v, cu_seqlens), dtype=torch.float32)


@torch.library.custom_op(register("chunk_gated_delta_backward"), mutates_args=())
def _chunk_gated_delta_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor | None,
    d_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(q, k, v, g, beta, cu_seqlens, state, d_out)
    cast = [gr.to(x.dtype) for gr, x in zip(grads[:5], (q, k, v, g, beta), strict=True)]
    return (*tuple(t.clone() if any(t is c for c in cast[:i]) else t for i, t in enumerate(cast)), grads[5])


@_chunk_gated_delta_backward_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, state, d_out):
    grads = tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))
    return (*grads, v.new_empty(_state_shape(q, v, cu_seqlens), dtype=torch.float32))


def _chunk_gated_delta_setup(ctx, inputs, output):
    *tensors, ctx.validate = inputs
    ctx.has_state = tensors[6] is not None
    ctx.save_for_backward(*tensors)


def _chunk_gated_delta_grad(ctx, d_out, d_state):
    grads = torch.ops.samepath.chunk_gated_delta_backward(*ctx.saved_tensors, d_out)
    return *grads[:5], None, grads[5] if ctx.has_state else None, None


_chunk_gated_delta_op.register_autograd(_chunk_gated_delta_grad, setup_context=_chunk_gated_delta_setup)


@dataclass
class GatedDeltaCache:
    """A sequence batch's Gated DeltaNet cache for one layer: the fp32 state at each sequence's last
    chunk boundary and the ``< C`` tokens since it (packed, ``cu_tail`` ``[N + 1]``)."""

    state: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_tail: torch.Tensor


@torch.no_grad()
def gated_delta_continue(q, k, v, g, beta, cu_seqlens, cache: GatedDeltaCache | None = None):
    """Prefill, chunked prefill or decode: the new tokens (packed by ``cu_seqlens``) after ``cache``
    (``None``: the sequences start here). Returns ``(out, new_cache)`` with the bits of one
    :func:`chunk_gated_delta` call over the whole sequences. Not differentiable."""
    if cache is not None and (
        not isinstance(cache, GatedDeltaCache) or cache.state.shape[0] != getattr(cu_seqlens, "numel", lambda: 0)() - 1
    ):
        raise ValueError("cache must be a GatedDeltaCache of the same sequences as cu_seqlens")
    n, _hk, _hv, _dk, _dv = _check(q, k, v, g, beta, cu_seqlens, None if cache is None else cache.state)
    if cache is None:
        out, state = _launch(q, k, v, g, beta, cu_seqlens, None)
        full_q, full_k, full_v, full_g, full_b, cu_full = q, k, v, g.float(), beta.float(), cu_seqlens.tolist()
        new_rows = None
    else:
        tail = cache.cu_tail.tolist()
        cu = cu_seqlens.tolist()
        if len(tail) != n + 1 or any(b - a >= CHUNK for a, b in itertools.pairwise(tail)):
            raise ValueError(f"cache: cu_tail must be [N + 1] with fewer than {CHUNK} tokens per sequence")
        pieces, new_rows, cu_full = {x: [] for x in "qkvgb"}, [], [0]
        for i in range(n):
            t0, t1, s0, s1 = tail[i], tail[i + 1], cu[i], cu[i + 1]
            pieces["q"] += [torch.zeros_like(cache.k[t0:t1]), q[s0:s1]]
            pieces["k"] += [cache.k[t0:t1], k[s0:s1]]
            pieces["v"] += [cache.v[t0:t1], v[s0:s1]]
            pieces["g"] += [cache.g[t0:t1], g[s0:s1].float()]
            pieces["b"] += [cache.beta[t0:t1], beta[s0:s1].float()]
            new_rows.append(torch.arange(cu_full[-1] + t1 - t0, cu_full[-1] + t1 - t0 + s1 - s0))
            cu_full.append(cu_full[-1] + t1 - t0 + s1 - s0)
        full_q, full_k, full_v, full_g, full_b = (torch.cat(pieces[x]) for x in "qkvgb")
        cu_t = torch.tensor(cu_full, dtype=cu_seqlens.dtype, device=q.device)
        out_full, state = _launch(full_q, full_k, full_v, full_g, full_b, cu_t, cache.state)
        out = out_full[torch.cat(new_rows).to(q.device)]
    keep, cu_tail = [], [0]
    for a, b in itertools.pairwise(cu_full):
        first = a + (b - a) // CHUNK * CHUNK
        keep.append(torch.arange(first, b))
        cu_tail.append(cu_tail[-1] + b - first)
    rows = torch.cat(keep).to(q.device)
    new_cache = GatedDeltaCache(
        state,
        full_k[rows],
        full_v[rows],
        full_g[rows],
        full_b[rows],
        torch.tensor(cu_tail, dtype=torch.int64, device=q.device),
    )
    return out, new_cache


@dataclass
class GatedDeltaSlots:
    """One layer's Gated DeltaNet cache by slot (vLLM's state cache, a ``generate`` batch), updated in
    place by :func:`gated_delta_continue_slots`. Slot ``s`` holds a sequence's fp32 state at its last
    chunk boundary and the ``tail_len[s] < C`` tokens since it (rows ``0 .. tail_len[s] - 1``; rows
    beyond are unused), every buffer contiguous:

    - ``state [S, HV, DK, DV]`` float32;
    - ``tail_k [S, C, HK, DK]`` and ``tail_v [S, C, HV, DV]`` in q's dtype (the raw keys and values);
    - ``tail_g``, ``tail_beta [S, C, HV]`` float32;
    - ``tail_len [S]`` int32.
    """

    state: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    tail_g: torch.Tensor
    tail_beta: torch.Tensor
    tail_len: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, hk: int, hv: int, dk: int, dv: int, dtype, device=None) -> GatedDeltaSlots:
        """Zeroed buffers (every slot empty) for ``num_slots`` sequences."""

        def zeros(*shape, dt=torch.float32):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            zeros(num_slots, hv, dk, dv),
            zeros(num_slots, CHUNK, hk, dk, dt=dtype),
            zeros(num_slots, CHUNK, hv, dv, dt=dtype),
            zeros(num_slots, CHUNK, hv),
            zeros(num_slots, CHUNK, hv),
            zeros(num_slots, dt=torch.int32),
        )


def _check_slots(slots, q, v, n, slot_ids, initial) -> None:
    """Shapes, dtypes, devices and contiguity (metadata only: no host sync) of the slot operands."""
    if not isinstance(slots, GatedDeltaSlots):
        raise ValueError(f"slots must be a GatedDeltaSlots, got {type(slots).__name__}")
    hk, dk, hv, dv = q.shape[1], q.shape[2], v.shape[1], v.shape[2]
    num = slots.state.shape[0] if isinstance(slots.state, torch.Tensor) and slots.state.dim() else -1
    expected = {
        "state": ((num, hv, dk, dv), torch.float32),
        "tail_k": ((num, CHUNK, hk, dk), q.dtype),
        "tail_v": ((num, CHUNK, hv, dv), q.dtype),
        "tail_g": ((num, CHUNK, hv), torch.float32),
        "tail_beta": ((num, CHUNK, hv), torch.float32),
        "tail_len": ((num,), torch.int32),
    }
    for name, (shape, dtype) in expected.items():
        t = getattr(slots, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"slots.{name} must be {dtype} {list(shape)}, got {getattr(t, 'dtype', type(t))} "
                f"{list(getattr(t, 'shape', []))}"
            )
        if not t.is_contiguous():
            raise ValueError(f"slots.{name} must be contiguous (it is updated in place)")
        if t.device != q.device:
            raise ValueError(f"slots.{name} must be on q's device {q.device}, got {t.device}")
    for name, t, dtypes in (
        ("slot_ids", slot_ids, (torch.int32, torch.int64)),
        ("initial", initial, (torch.bool,)),
    ):
        if t is None and name == "initial":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype not in dtypes:
            raise ValueError(f"{name} must be a {' / '.join(map(str, dtypes))} tensor [N] = [{n}]")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


@torch.no_grad()
def gated_delta_continue_slots(q, k, v, g, beta, cu_seqlens, slots: GatedDeltaSlots, slot_ids, initial=None):
    """Prefill, chunked prefill and decode of a mixed batch against per-slot buffers, in place, on the
    device: no host sync and no per-sequence Python (one kernel launch and a fixed number of torch
    ops, so it can be captured in a CUDA graph). Not differentiable.

    Args:
        q, k, v, g, beta, cu_seqlens: the new tokens of ``N`` sequences, packed as for
            :func:`chunk_gated_delta` (any number per sequence, 0 included).
        slots: the :class:`GatedDeltaSlots` buffers; slot ``slot_ids[n]`` is sequence n's.
        slot_ids: ``[N]`` int32 / int64, distinct, each in ``[0, S)``.
        initial: optional ``[N]`` bool: where ``False`` the sequence starts here (its slot's state
            and tail are ignored, as for a fresh slot); ``None``: every slot continues (an empty slot,
            ``tail_len == 0`` and zero state, is a fresh sequence too).

    Returns ``out [T, HV, DV]`` in q's dtype. Afterwards each slot holds the state at its sequence's
    last chunk boundary and the tokens since it. Contract: every output and every slot state has the
    bits of one :func:`chunk_gated_delta` call over the whole sequences (all tokens fed so far),
    however the sequences were split into calls. The values of ``cu_seqlens`` and ``slot_ids`` are
    not checked (that would be a host sync): ``cu_seqlens`` must rise from 0 to T and the slots must
    be distinct and in range.
    """
    n, _hk, _hv, _dk, _dv = _check(q, k, v, g, beta, cu_seqlens, None, check_values=False)
    _check_slots(slots, q, v, n, slot_ids, initial)
    if torch.compiler.is_compiling():  # the slot buffers are updated in place by the op
        fields = (slots.state, slots.tail_k, slots.tail_v, slots.tail_g, slots.tail_beta, slots.tail_len)
        return torch.ops.samepath.gated_delta_continue_slots(q, k, v, g, beta, cu_seqlens, *fields, slot_ids, initial)
    return _continue_slots(q, k, v, g, beta, cu_seqlens, slots, slot_ids, initial)


def _continue_slots(q, k, v, g, beta, cu_seqlens, slots: GatedDeltaSlots, slot_ids, initial):
    n = cu_seqlens.shape[0] - 1
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    cu_seqlens, slot_ids = cu_seqlens.contiguous(), slot_ids.contiguous()
    tail = slots.tail_len.index_select(0, slot_ids)
    if initial is not None:
        tail = torch.where(initial, tail, torch.zeros_like(tail))
        init = initial.to(torch.int32)
    else:
        init = torch.ones_like(tail)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    tails = (slots.tail_k, slots.tail_v, slots.tail_g, slots.tail_beta)
    _run_forward(q, k, v, g, beta, cu_seqlens, slots.state, out, slots.state, True, (slot_ids, tail, init, *tails))
    # the new tail: virtual positions first .. total - 1 (tail tokens, then the new ones), rows from 0
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    old = tail.to(torch.int64)
    total = old + lengths
    first = total // CHUNK * CHUNK
    pos = first[:, None] + torch.arange(CHUNK, device=q.device)[None, :]
    write = (pos >= old[:, None]) & (pos < total[:, None])
    if q.shape[0]:
        src = (cu_seqlens[:-1, None].to(torch.int64) + pos - old[:, None]).clamp(0, q.shape[0] - 1)
        row = slot_ids.to(torch.int64)[:, None].expand(n, CHUNK)
        col = torch.arange(CHUNK, device=q.device)[None, :].expand(n, CHUNK)
        for buf, x in zip(tails, (k, v, g, beta), strict=True):
            mask = write.view(n, CHUNK, *([1] * (x.dim() - 1)))
            buf[row, col] = torch.where(mask, x[src], buf[row, col])
    slots.tail_len.index_copy_(0, slot_ids.to(torch.int64), (total - first).to(torch.int32))
    return out


@torch.library.custom_op(
    register("gated_delta_continue_slots"),
    mutates_args=("state", "tail_k", "tail_v", "tail_g", "tail_beta", "tail_len"),
)
def _continue_slots_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_g: torch.Tensor,
    tail_beta: torch.Tensor,
    tail_len: torch.Tensor,
    slot_ids: torch.Tensor,
    initial: torch.Tensor | None,
) -> torch.Tensor:
    slots = GatedDeltaSlots(state, tail_k, tail_v, tail_g, tail_beta, tail_len)
    with torch.no_grad():
        return _continue_slots(q, k, v, g, beta, cu_seqlens, slots, slot_ids, initial)


@_continue_slots_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, state, tail_k, tail_v, tail_g, tail_beta, tail_len, slot_ids, initial):
    return v.new_empty(v.shape)
