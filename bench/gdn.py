"""Gated DeltaNet (Qwen3-Next / Qwen3.5's linear attention) bench rows: samepath's one chunked schedule
(:mod:`samepath.kernels.gated_delta`) for the trainer (forward + backward, packed sequences) and the decode
step (the slot-indexed continuation ``generate`` and vLLM use: boundary state plus partial chunk, updated in
place), against the stock paths a user would run on the same inputs:

* Hugging Face's torch fallbacks (what a Qwen3-Next layer runs without flash-linear-attention):
  ``torch_chunk_gated_delta_rule`` on the padded batch (training; q/k heads repeated to the value heads, as
  the layer does) and ``torch_recurrent_gated_delta_rule`` on one token from the fixed recurrent state (decode);
* flash-linear-attention's ``chunk_gated_delta_rule`` (varlen, ``cu_seqlens``) and
  ``fused_recurrent_gated_delta_rule`` where it imports and has a Triton driver (a GPU); otherwise listed with
  the reason.

The rate column of the training rows counts ``3 * 2 * T * HV * (2 * DK * DV + C * (DK + DV))`` FLOPs (the state
products and the intra-chunk products, the backward twice the forward), the same number for every row; the
decode rows count the bytes of the state read and written (fp32). samepath's decode reads its boundary state
and up to ``C - 1`` cached tokens (O(C) per token, the price of one schedule); the recurrent baselines one
state.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.baselines import Baselines
from bench.cases import Case
from samepath.kernels.gated_delta import CHUNK, GatedDeltaSlots, chunk_gated_delta, gated_delta_continue_slots


@dataclass(frozen=True)
class GDNShape:
    hk: int  # q / k heads
    hv: int  # value heads (a multiple of hk)
    dk: int
    dv: int

    @property
    def label(self) -> str:
        return f"HK={self.hk} HV={self.hv} DK={self.dk} DV={self.dv} C={CHUNK}"


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def _gates(shape, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decays mostly -0.02 .. -0.6 and betas in (0, 1), fp32 (what the gates kernel gives)."""
    g = -(torch.rand(shape, generator=gen, device=gen.device) * 0.58 + 0.02)
    beta = torch.rand(shape, generator=gen, device=gen.device).sigmoid()
    return g.to(device), beta.to(device)


def _hf_fallbacks(found: Baselines) -> tuple[Callable, Callable] | None:
    """Hugging Face's pure-torch chunked and recurrent gated delta rules (unwrapped from the hub / FLA
    dispatch, so they are the torch paths whatever is installed)."""
    try:
        modeling = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    except ImportError as exc:
        found.missing["Hugging Face torch gated delta rule"] = f"not importable: {exc}"
        return None
    return (
        inspect.unwrap(modeling.torch_chunk_gated_delta_rule),
        inspect.unwrap(modeling.torch_recurrent_gated_delta_rule),
    )


def _fla(found: Baselines, device: torch.device) -> tuple[Callable, Callable] | None:
    """flash-linear-attention's kernels, where they import and this device has a Triton driver."""
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError as exc:
        found.missing["flash-linear-attention"] = f"not importable ({exc}; pip install flash-linear-attention)"
        return None
    if device.type != "cuda":
        found.missing["flash-linear-attention"] = (
            "imports, but its Triton kernels need a GPU driver (on the CPU: '0 active drivers')"
        )
        return None
    return ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule


def gdn_train_case(lens: list[int], s: GDNShape, dtype, device, found: Baselines) -> Case:
    """The trainer's Gated DeltaNet, forward + backward, packed sequences (unaligned lengths)."""
    total, longest, n = sum(lens), max(lens), len(lens)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    rows = torch.cat([torch.arange(i * longest, i * longest + m) for i, m in enumerate(lens)]).to(device)
    names = ("q", "k", "v", "g", "beta")

    def make(seed: int) -> dict:
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
        d = {
            "q": _randn((total, s.hk, s.dk), dtype, device, gen),
            "k": _randn((total, s.hk, s.dk), dtype, device, gen),
            "v": _randn((total, s.hv, s.dv), dtype, device, gen),
        }
        d["g"], d["beta"] = _gates((total, s.hv), device, gen)
        d["d_out"] = _randn((total, s.hv, s.dv), dtype, device, gen)
        for name in names:
            d[name].requires_grad_(True)
        return d

    def grads(d, out):
        return torch.autograd.grad(out, [d[x] for x in names], d["d_out"])

    def ours(d):
        out, _ = chunk_gated_delta(*(d[x] for x in names), cu, validate=False)
        return grads(d, out)

    def padded(d, x, heads: int | None = None):
        """``x`` [T, ...] as Hugging Face's padded batch [N, L, ...] (q / k repeated to the value heads)."""
        if heads is not None and heads != x.shape[1]:
            x = x.repeat_interleave(heads // x.shape[1], dim=1)
        out = x.new_zeros((n * longest, *x.shape[1:]))
        return out.index_copy(0, rows, x).view(n, longest, *x.shape[1:])

    baselines: dict[str, Callable[[dict], object]] = {}
    hf = _hf_fallbacks(found)
    if hf is not None:
        torch_chunk = hf[0]

        def hf_chunked(d):
            q, k = (padded(d, d[x], s.hv) for x in ("q", "k"))
            v, g, beta = (padded(d, d[x]) for x in ("v", "g", "beta"))
            out, _ = torch_chunk(q, k, v, g, beta, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)
            return grads(d, out.reshape(n * longest, s.hv, s.dv)[rows])

        baselines["stock HF torch_chunk_gated_delta_rule (padded batch)"] = hf_chunked
    fla = _fla(found, device)
    if fla is not None:
        fla_chunk = fla[0]
        cu64 = cu.to(torch.int64)

        def fla_chunked(d):
            q, k = (d[x].repeat_interleave(s.hv // s.hk, dim=1)[None] for x in ("q", "k"))
            out, _ = fla_chunk(
                q, k, d["v"][None], d["g"][None], d["beta"][None], cu_seqlens=cu64, use_qk_l2norm_in_kernel=True
            )
            return grads(d, out[0])

        baselines["flash-linear-attention chunk_gated_delta_rule (varlen)"] = fla_chunked
    flops = 3 * 2.0 * total * s.hv * (2 * s.dk * s.dv + CHUNK * (s.dk + s.dv))
    return Case("gdn_train", f"lens={lens} {s.label}", make, ours, baselines, flops=flops, repeat_scale=0.5)


def gdn_decode_case(batch: int, context: int, s: GDNShape, dtype, device, found: Baselines) -> Case:
    """One decode step of ``batch`` sequences after ``context`` tokens each (prefilled in ``make``): samepath's
    slot continuation (in place; each timed call appends one more token, the tails wrap at C) against the
    recurrent state update."""
    slot_ids = torch.arange(batch, device=device)
    one = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def make(seed: int) -> dict:
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
        slots = GatedDeltaSlots.allocate(batch, s.hk, s.hv, s.dk, s.dv, dtype, device)
        total = batch * context
        prefill_cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * context
        qp, kp = (_randn((total, s.hk, s.dk), dtype, device, gen) for _ in range(2))
        vp = _randn((total, s.hv, s.dv), dtype, device, gen)
        gp, bp = _gates((total, s.hv), device, gen)
        gated_delta_continue_slots(qp, kp, vp, gp, bp, prefill_cu, slots, slot_ids)
        d = {"slots": slots, "state": _randn((batch, s.hv, s.dk, s.dv), torch.float32, device, gen) * 0.1}
        d["q"], d["k"] = (_randn((batch, s.hk, s.dk), dtype, device, gen) for _ in range(2))
        d["v"] = _randn((batch, s.hv, s.dv), dtype, device, gen)
        d["g"], d["beta"] = _gates((batch, s.hv), device, gen)
        return d

    def ours(d):
        return gated_delta_continue_slots(d["q"], d["k"], d["v"], d["g"], d["beta"], one, d["slots"], slot_ids)

    def recurrent_inputs(d):
        q, k = (d[x].repeat_interleave(s.hv // s.hk, dim=1)[:, None] for x in ("q", "k"))
        return q, k, d["v"][:, None], d["g"][:, None], d["beta"][:, None]

    baselines: dict[str, Callable[[dict], object]] = {}
    hf = _hf_fallbacks(found)
    if hf is not None:
        torch_recurrent = hf[1]

        def hf_recurrent(d):
            return torch_recurrent(
                *recurrent_inputs(d), initial_state=d["state"], output_final_state=True, use_qk_l2norm_in_kernel=True
            )

        baselines["stock HF torch_recurrent_gated_delta_rule (one token)"] = hf_recurrent
    fla = _fla(found, device)
    if fla is not None:
        fla_recurrent = fla[1]

        def fla_step(d):
            q, k, v, g, beta = recurrent_inputs(d)
            return fla_recurrent(
                q, k, v, g, beta=beta, initial_state=d["state"], output_final_state=True, use_qk_l2norm_in_kernel=True
            )

        baselines["flash-linear-attention fused_recurrent_gated_delta_rule"] = fla_step
    state_bytes = 2 * batch * s.hv * s.dk * s.dv * 4
    label = f"B={batch} ctx={context} {s.label}"
    return Case("gdn_decode", label, make, ours, baselines, bytes=state_bytes)


def cases(op: str, device: torch.device, dtype, quick: bool, found: Baselines):
    """The Gated DeltaNet cases of ``op``: Qwen3-Next's layer shape (16 q/k heads, 32 value heads, 128 / 128)
    on a GPU, tiny shapes on the CPU."""
    if device.type == "cpu":
        shape = GDNShape(1, 2, 32, 32)
        lens, (batch, ctx) = ([40, 21], (2, 37)) if quick else ([160, 77], (4, 150))
    else:
        shape = GDNShape(16, 32, 128, 128)
        lens, (batch, ctx) = ([1024] * 4, (64, 1000)) if quick else ([4096, 3001, 1000], (256, 4000))
    if op == "gdn_train":
        yield gdn_train_case(lens, shape, dtype, device, found)
    else:
        yield gdn_decode_case(batch, ctx, shape, dtype, device, found)
