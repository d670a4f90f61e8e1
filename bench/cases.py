"""The benchmark cases: one builder per op, sized per device and mode, each with its baselines.

Every case builds its inputs from a seed (so several sets can be cycled) and names its samepath
call and the baselines it is compared with, measured in the same run on the same device. The
baselines are stock PyTorch (eager math as Hugging Face writes it, ``F.linear``, ``F.rms_norm``,
``log_softmax + gather``) and the third-party kernels of :mod:`bench.baselines` wherever they
import and suit the device and dtype.

samepath is called the way its integrations call it (:data:`SAMEPATH_CALLS`): the attention
kernels with ``validate=False`` and a :class:`~samepath.kernels.attention.LaunchPlan` built once per
step (per input set here) and shared by the calls, as ``integrations/hf.py`` (one plan per model forward)
and ``integrations/vllm/attention.py`` (one per step) call them; ``token_logprobs`` skips the label check
as ``integrations/verl.py`` does.

Decode and chunked prefill read a paged KV cache (vLLM's layout, pages shuffled) on every side:
the torch SDPA baselines gather the pages first (what a paged SDPA path such as Hugging Face's
``sdpa_paged`` does), the other baselines read the pages themselves.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import samepath
from bench import old_schedule
from bench.baselines import VLLM_SEGMENTS, Baselines
from bench.timing import Timing, measure_peak_memory
from samepath.kernels.attention import LaunchPlan, paged_attention, varlen_attention
from samepath.kernels.logprobs import LM_HEAD_TOKEN_CHUNK, linear_token_logprobs

#: Op groups, in the order they run (``--ops`` takes a comma-separated subset).
OPS = (
    "varlen_fwd",
    "varlen_fwdbwd",
    "chunked_prefill",
    "paged_decode",
    "paged_decode_gqa",
    "linear",
    "token_logprobs",
    "lm_head_logprobs",
    "lm_head_memory",
    "rms_norm",
    "swiglu",
    "rotary",
    "moe_experts",
    "mla_train",
    "mla_decode",
    "gdn_train",
    "gdn_decode",
    "e2e",
    "vllm_decode_step",
)

#: How each samepath call is made, matching the integration that makes it.
SAMEPATH_CALLS = (
    "varlen_attention(validate=False, plan=LaunchPlan built once per step) as integrations/hf.py; "
    "paged_attention(validate=False, plan=LaunchPlan built once per step) as integrations/vllm/attention.py; "
    "token_logprobs(validate=False) as integrations/verl.py; "
    "linear_token_logprobs(validate=False) (the fused lm_head) as integrations/verl.py's use_fused_kernels path; "
    "linear / rms_norm / silu_mul / apply_rotary as integrations/hf.py; "
    "moe.experts_forward (grouped expert GEMMs) as integrations/hf.py's ExpertsInterface and vLLM's fused-MoE "
    "replacement; "
    f"'{old_schedule.LABEL}': the same kernels on the schedule before issue 14 (bench/old_schedule.py); "
    "no old-schedule row for the attention backward (today's backward kernel is not the pre-issue-14 one)"
)

VOCAB = 151936  # Qwen2/Qwen3's padded vocabulary
TEMPERATURE = 0.7
PAGE_SIZE = 16
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20

Timer = Callable[[Callable[[Any], object], list, torch.device, int, int], Timing]


@dataclass
class Case:
    """One benchmark configuration: a samepath call and its baselines on the same inputs."""

    op: str
    config: str
    make: Callable[[int], dict]  # seed -> one input set
    samepath: Callable[[dict], object]
    baselines: dict[str, Callable[[dict], object]]
    flops: float = 0.0  # per call; TFLOP/s are reported when set
    bytes: float = 0.0  # per call; GB/s otherwise
    tokens: float = 0.0  # per call; tok/s for the end-to-end cases
    context: Callable[[str], contextlib.AbstractContextManager] | None = None  # per implementation
    repeat_scale: float = 1.0
    timer: Timer | None = None  # None: bench.timing.measure (wall time of each call)
    what: str = ""  # what a time measures, when not the call's wall time
    notes: list[str] = field(default_factory=list)

    def rate(self, ms: float) -> tuple[str, float]:
        if not ms or math.isnan(ms):
            return self.unit, float("nan")
        if self.flops:
            return "TFLOP/s", self.flops / (ms * 1e-3) / 1e12
        if self.bytes:
            return "GB/s", self.bytes / (ms * 1e-3) / 1e9
        if self.tokens:
            return "tok/s", self.tokens / (ms * 1e-3)
        return "", float("nan")

    @property
    def unit(self) -> str:
        return "TFLOP/s" if self.flops else "GB/s" if self.bytes else "tok/s" if self.tokens else ""


def _randn(shape, dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)


def _sdpa_context(found: Baselines) -> Callable[[str], contextlib.AbstractContextManager]:
    def context(impl: str) -> contextlib.AbstractContextManager:
        backend = found.sdpa.get(impl)
        return backend.context() if backend is not None else contextlib.nullcontext()

    return context


def _sdpa(q, k, v, gqa_native: bool, **kwargs) -> torch.Tensor:
    """SDPA on ``[B, H, L, D]`` / ``[B, Hkv, S, D]``; K/V heads repeated when the backend has no GQA."""
    if not gqa_native and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[-3] != q.shape[-3], **kwargs)


def eager_attention(q, k, v, scale: float, offset: int | None) -> torch.Tensor:
    """Hugging Face's eager math: q ``[.., H, L, D]``, k/v ``[.., Hkv, S, D]``; causal with the
    queries at the last ``L`` of ``S`` positions when ``offset`` is given (``offset = S - L``)."""
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if offset is not None:
        length, span = q.shape[-2], k.shape[-2]
        i = torch.arange(length, device=q.device)[:, None]
        j = torch.arange(span, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + offset, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def _lens_label(lens: list[int]) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)}x{lens[0]}"
    return "[" + ",".join(map(str, lens)) + "]"


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def varlen_case(op: str, lens: list[int], heads: int, kv_heads: int, head: int, dtype, device, found) -> Case:
    """Packed causal self-attention (the trainer's forward, or forward + backward)."""
    backward = op == "varlen_fwdbwd"
    total = sum(lens)
    scale = head**-0.5
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    longest = max(lens)
    # One layout for every input set, planned once (as a trainer plans once per forward for all layers).
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    plan = LaunchPlan(cu, total)

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        d = {
            "q": _randn((total, heads, head), dtype, device, gen),
            "k": _randn((total, kv_heads, head), dtype, device, gen),
            "v": _randn((total, kv_heads, head), dtype, device, gen),
            "cu": cu,
        }
        if backward:
            for name in ("q", "k", "v"):
                d[name].requires_grad_(True)
            d["g"] = _randn((total, heads, head), dtype, device, gen)
        return d

    def finish(d, out):
        if backward:
            return torch.autograd.grad(out, (d["q"], d["k"], d["v"]), d["g"])
        return out

    def ours(d):
        with torch.set_grad_enabled(backward):
            out = varlen_attention(d["q"], d["k"], d["v"], d["cu"], scale, True, validate=False, plan=plan)
            return finish(d, out)

    def per_sequence(attend):
        def run(d):
            with torch.set_grad_enabled(backward):
                outs = []
                for s, e in itertools.pairwise(starts):
                    q, k, v = (d[n][s:e].transpose(0, 1)[None] for n in ("q", "k", "v"))
                    outs.append(attend(q, k, v)[0].transpose(0, 1))
                return finish(d, torch.cat(outs))

        return run

    def old(d):
        with torch.set_grad_enabled(backward), old_schedule.unpacked_heads():
            return finish(d, old_schedule.varlen_attention(d["q"], d["k"], d["v"], d["cu"], scale))

    # The old schedule's forward only: its backward would be today's kernel on other tiles, not the
    # backward that schedule ran, so no honest old-backward row exists.
    baselines: dict[str, Callable[[dict], object]] = {} if backward else {old_schedule.LABEL: old}
    for name, backend in found.sdpa.items():
        native = backend.gqa_native
        baselines[name] = per_sequence(
            lambda q, k, v, native=native: _sdpa(q, k, v, native, is_causal=True, scale=scale)
        )
    baselines["eager math (HF)"] = per_sequence(lambda q, k, v: eager_attention(q, k, v, scale, offset=0))
    if found.varlen_attn is not None:
        causal = {"is_causal": True} if found.varlen_attn_causal_kw else {"window_size": (-1, 0)}

        def torch_varlen(d):
            with torch.set_grad_enabled(backward):
                out = found.varlen_attn(
                    d["q"], d["k"], d["v"], d["cu"], d["cu"], longest, longest, scale=scale, enable_gqa=True, **causal
                )
                return finish(d, out)

        baselines["torch varlen_attn"] = torch_varlen
    if found.flashinfer is not None and not backward:
        fi = found.flashinfer
        state: dict[str, Any] = {}

        def flashinfer_ragged(d):
            if "wrapper" not in state:  # plan once per step, as a serving engine does for all its layers
                workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
                wrapper.plan(d["cu"], d["cu"], heads, kv_heads, head, causal=True, sm_scale=scale, q_data_type=dtype)
                state["wrapper"] = wrapper
            return state["wrapper"].run(d["q"], d["k"], d["v"])

        baselines["FlashInfer ragged prefill"] = flashinfer_ragged
    if found.flash_attn is not None:
        fa = found.flash_attn

        def flash(d):
            with torch.set_grad_enabled(backward):
                out = fa.flash_attn_varlen_func(
                    d["q"], d["k"], d["v"], d["cu"], d["cu"], longest, longest, softmax_scale=scale, causal=True
                )
                return finish(d, out)

        baselines["flash-attn varlen"] = flash
    flops = 4.0 * heads * head * sum(_causal_pairs(n) for n in lens) * (3.5 if backward else 1.0)
    shape = f"lens={_lens_label(lens)} H={heads}/{kv_heads} D={head}"
    return Case(
        op,
        shape,
        make,
        ours,
        baselines,
        flops=flops,
        context=_sdpa_context(found),
        repeat_scale=0.5 if backward else 1.0,
    )


def paged_case(
    op: str, batch: int, context: int, chunk: int, heads: int, kv_heads: int, head: int, dtype, device, found
) -> Case:
    """``chunk`` new queries per sequence over ``context`` cached positions (``chunk = 1``: decode),
    the KV cache paged and its pages shuffled; every baseline reads that paged cache."""
    span = context + chunk  # KV positions per sequence after this step
    pages = (span + PAGE_SIZE - 1) // PAGE_SIZE
    scale = head**-0.5
    # One page layout for every input set (a serving engine plans once per step for all layers);
    # the cached keys and values differ from set to set.
    perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(1234)).to(device)
    table = perm.view(batch, pages).to(torch.int32)
    table_long = table.long()
    qsl = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), span, dtype=torch.int32, device=device)

    def make(seed: int) -> dict:
        gen = _generator(seed, device)

        def cache() -> torch.Tensor:
            dense = _randn((batch, pages * PAGE_SIZE, kv_heads, head), dtype, device, gen)
            dense[:, span:] = 0
            out = torch.empty(batch * pages, PAGE_SIZE, kv_heads, head, dtype=dtype, device=device)
            out[perm] = dense.view(batch * pages, PAGE_SIZE, kv_heads, head)
            return out

        return {"q": _randn((batch * chunk, heads, head), dtype, device, gen), "kc": cache(), "vc": cache()}

    plan = LaunchPlan(qsl, batch * chunk)  # one per step, shared by the step's layers

    def ours(d):
        return paged_attention(d["q"], d["kc"], d["vc"], table, qsl, seq_lens, scale, validate=False, plan=plan)

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, span, D]
        return cache[table_long].flatten(1, 2)[:, :span].transpose(1, 2)

    def q4(d) -> torch.Tensor:  # [B, H, chunk, D]
        return d["q"].view(batch, chunk, heads, head).transpose(1, 2)

    mask_kwargs: dict[str, Any] = {}
    if chunk > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask_kwargs["attn_mask"] = causal_lower_right(chunk, span)

    def old(d):
        return old_schedule.paged_attention(d["q"], d["kc"], d["vc"], table, qsl, seq_lens, scale)

    baselines: dict[str, Callable[[dict], object]] = {f"{old_schedule.LABEL}, paged": old}
    for name, backend in found.sdpa.items():
        native = backend.gqa_native

        def gather_sdpa(d, native=native):
            return _sdpa(q4(d), gathered(d["kc"]), gathered(d["vc"]), native, scale=scale, **mask_kwargs)

        baselines[f"{name} (gather pages)"] = gather_sdpa
    baselines["eager math (HF, gather pages)"] = lambda d: eager_attention(
        q4(d), gathered(d["kc"]), gathered(d["vc"]), scale, offset=context
    )
    if found.varlen_attn is not None and found.varlen_attn_paged:
        causal = {"is_causal": True} if found.varlen_attn_causal_kw else {"window_size": (-1, 0)}

        def torch_varlen_paged(d):
            return found.varlen_attn(
                d["q"],
                d["kc"],
                d["vc"],
                qsl,
                None,
                chunk,
                span,
                scale=scale,
                enable_gqa=True,
                seqused_k=seq_lens,
                block_table=table,
                num_splits=1,
                **causal,
            )

        baselines["torch varlen_attn paged (num_splits=1)"] = torch_varlen_paged
    if found.vllm_unified_attention is not None:
        unified = found.vllm_unified_attention
        padded = 1 << (head - 1).bit_length()
        tokens = batch * chunk
        segm_out = torch.empty(tokens, heads, VLLM_SEGMENTS, padded, dtype=torch.float32, device=device)
        segm_max = torch.empty(tokens, heads, VLLM_SEGMENTS, dtype=torch.float32, device=device)
        segm_sum = torch.empty_like(segm_max)
        descale = torch.ones(1, dtype=torch.float32, device=device).expand(batch, kv_heads)

        def vllm_triton(d):
            out = torch.empty_like(d["q"])
            unified(
                d["q"],
                d["kc"],
                d["vc"],
                out,
                cu_seqlens_q=qsl,
                max_seqlen_q=chunk,
                seqused_k=seq_lens,
                max_seqlen_k=span,
                softmax_scale=scale,
                causal=True,
                window_size=(-1, -1),
                block_table=table,
                softcap=0,
                q_descale=None,
                k_descale=descale,
                v_descale=descale,
                seq_threshold_3D=1 << 30,
                num_par_softmax_segments=VLLM_SEGMENTS,
                softmax_segm_output=segm_out,
                softmax_segm_max=segm_max,
                softmax_segm_expsum=segm_sum,
            )
            return out

        split = f"fixed {VLLM_SEGMENTS}-segment split" if chunk == 1 else "2D, no split"
        baselines[f"vLLM Triton unified_attention ({split})"] = vllm_triton
    if found.flashinfer is not None and chunk == 1:
        fi = found.flashinfer

        def flashinfer_decode(split_kv: bool) -> Callable[[dict], object]:
            state: dict[str, Any] = {}

            def run(d):
                if "wrapper" not in state:  # plan once per step, as a serving engine does for all its layers
                    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                        workspace, "NHD", use_tensor_cores=heads // kv_heads >= 4
                    )
                    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=device)
                    last = torch.full((batch,), (span - 1) % PAGE_SIZE + 1, dtype=torch.int32, device=device)
                    wrapper.plan(
                        indptr,
                        table.flatten(),
                        last,
                        heads,
                        kv_heads,
                        head,
                        PAGE_SIZE,
                        sm_scale=scale,
                        q_data_type=dtype,
                        kv_data_type=dtype,
                        disable_split_kv=not split_kv,
                    )
                    state["wrapper"] = wrapper
                return state["wrapper"].run(d["q"], (d["kc"], d["vc"]))

            return run

        baselines["FlashInfer paged decode"] = flashinfer_decode(split_kv=True)
        baselines["FlashInfer paged decode (split-KV off)"] = flashinfer_decode(split_kv=False)
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * span * kv_heads * head * element
    context_fn = _sdpa_context_paged(found)
    if op == "paged_decode":
        label = f"B={batch} ctx={span} H={heads}/{kv_heads} D={head} page={PAGE_SIZE}"
        q_bytes = batch * heads * head * element
        return Case(op, label, make, ours, baselines, bytes=kv_bytes + 2 * q_bytes, context=context_fn)
    pairs = batch * sum(context + i + 1 for i in range(chunk))
    label = f"B={batch} ctx={context}+{chunk} H={heads}/{kv_heads} D={head} page={PAGE_SIZE}"
    return Case(op, label, make, ours, baselines, flops=4.0 * heads * head * pairs, context=context_fn)


def _sdpa_context_paged(found: Baselines) -> Callable[[str], contextlib.AbstractContextManager]:
    def context(impl: str) -> contextlib.AbstractContextManager:
        backend = found.sdpa.get(impl.removesuffix(" (gather pages)"))
        return backend.context() if backend is not None else contextlib.nullcontext()

    return context


# ----------------------------------------------------------------------------------------------
# The rest of the model
# ----------------------------------------------------------------------------------------------


def linear_case(m: int, k: int, n: int, dtype, device, found: Baselines) -> Case:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {"x": _randn((m, k), dtype, device, gen), "w": _randn((n, k), dtype, device, gen) * k**-0.5}

    blas = "cuBLAS" if device.type == "cuda" else "CPU BLAS"
    baselines = {
        old_schedule.LABEL: lambda d: old_schedule.linear(d["x"], d["w"]),
        f"torch F.linear ({blas})": lambda d: F.linear(d["x"], d["w"]),
    }
    if found.vllm_bi is not None and hasattr(found.vllm_bi, "matmul_persistent"):
        baselines["vLLM batch-invariant matmul"] = lambda d: found.vllm_bi.matmul_persistent(d["x"], d["w"].t())
    return Case(
        "linear",
        f"M={m} K={k} N={n}",
        make,
        lambda d: samepath.linear(d["x"], d["w"]),
        baselines,
        flops=2.0 * m * n * k,
    )


def logprobs_case(rows: int, vocab: int, dtype, device, found: Baselines) -> Case:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        labels = torch.randint(0, vocab, (rows,), generator=gen, device=gen.device).to(device)
        return {"logits": _randn((rows, vocab), dtype, device, gen) * 4, "labels": labels}

    def stock(d):
        return torch.log_softmax(d["logits"].float() / TEMPERATURE, -1).gather(-1, d["labels"][:, None])[:, 0]

    baselines = {"F.log_softmax + gather (fp32)": stock}
    if found.vllm_bi is not None and hasattr(found.vllm_bi, "log_softmax"):

        def vllm_lp(d):
            lp = found.vllm_bi.log_softmax(d["logits"].float() / TEMPERATURE, dim=-1)
            return lp.gather(-1, d["labels"][:, None])[:, 0]

        baselines["vLLM batch-invariant log_softmax"] = vllm_lp
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "token_logprobs",
        f"rows={rows} V={vocab} T={TEMPERATURE}",
        make,
        lambda d: samepath.token_logprobs(d["logits"], d["labels"], TEMPERATURE, validate=False),
        baselines,
        bytes=rows * vocab * element,
    )


def _lm_head_inputs(rows: int, hidden: int, vocab: int, dtype, device) -> Callable[[int], dict]:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        h = _randn((rows, hidden), dtype, device, gen).requires_grad_(True)
        w = (_randn((vocab, hidden), dtype, device, gen) * hidden**-0.5).requires_grad_(True)
        labels = torch.randint(0, vocab, (rows,), generator=gen, device=gen.device).to(device)
        return {"h": h, "w": w, "labels": labels}

    return make


def _lm_head_sides(
    found: Baselines, token_chunk: int, save_logits: bool = True
) -> tuple[Callable, dict[str, Callable]]:
    """The trainer's loss head, forward + backward at T = 1: samepath's fused lm_head + token
    log-probs (by default the three-pass form that keeps the logits for their gradient;
    ``save_logits=False``: ``token_chunk`` rows of logits at a time), and what it replaces: the unfused pair
    on samepath's kernels (the old schedule: full logits), the same in torch, and Liger's fused
    linear cross-entropy where it runs."""

    def grads(d, loss):
        return torch.autograd.grad(loss, (d["h"], d["w"]))

    def ours(d):
        lp = linear_token_logprobs(
            d["h"], d["w"], d["labels"], 1.0, token_chunk=token_chunk, validate=False, save_logits=save_logits
        )
        return grads(d, -lp.mean())

    def unfused(d):
        return grads(d, -old_schedule.lm_head_logprobs(d["h"], d["w"], d["labels"], 1.0).mean())

    def stock(d):
        lp = torch.log_softmax(F.linear(d["h"], d["w"]).float(), -1).gather(-1, d["labels"][:, None])
        return grads(d, -lp.mean())

    baselines = {
        f"{old_schedule.LABEL}: unfused linear + token_logprobs": unfused,
        "F.linear + log_softmax + gather (fp32)": stock,
    }
    if found.liger is not None:
        baselines["Liger fused linear cross-entropy"] = lambda d: grads(
            d, found.liger.liger_fused_linear_cross_entropy(d["h"], d["w"], d["labels"])
        )
    return ours, baselines


def lm_head_logprobs_case(
    rows: int, hidden: int, vocab: int, token_chunk: int, dtype, device, found: Baselines
) -> Case:
    """Time of the trainer's loss head, forward + backward (see :func:`_lm_head_sides`)."""
    ours, baselines = _lm_head_sides(found, token_chunk)
    return Case(
        "lm_head_logprobs",
        f"fwd+bwd rows={rows} hidden={hidden} V={vocab} token_chunk={token_chunk}",
        _lm_head_inputs(rows, hidden, vocab, dtype, device),
        ours,
        baselines,
        flops=3 * 2.0 * rows * hidden * vocab,  # logits, dhidden, dweight: the fused default keeps the logits
        repeat_scale=0.5,
    )


def lm_head_memory_case(rows: int, hidden: int, vocab: int, token_chunk: int, dtype, device, found: Baselines) -> Case:
    """Peak memory of the trainer's loss head, forward + backward: the fused lm_head in its
    memory-bounded form (``save_logits=False``) holds ``token_chunk`` rows of logits (and their
    gradient) at a time, the unfused paths all ``rows``. (Its default three-pass form keeps the
    ``[rows, V]`` logits in the input dtype, like the unfused pair.) The row's "ms" columns are MiB
    and its speedup the ratio of the peaks (baseline / samepath)."""
    ours, baselines = _lm_head_sides(found, token_chunk, save_logits=False)
    element = torch.empty((), dtype=dtype).element_size()
    logits_mib = rows * vocab * element / 2**20
    chunk_mib = min(rows, token_chunk) * vocab * element / 2**20
    return Case(
        "lm_head_memory",
        f"fwd+bwd rows={rows} hidden={hidden} V={vocab} token_chunk={token_chunk}: "
        f"[rows, V] logits {logits_mib:.3g} MiB, one chunk {chunk_mib:.3g} MiB ({dtype_label(dtype)})",
        _lm_head_inputs(rows, hidden, vocab, dtype, device),
        ours,
        baselines,
        timer=measure_peak_memory,
        what="peak MiB of tensors allocated by one fwd+bwd call (not ms; speedup = memory ratio)",
    )


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gqa_decode_case(batch: int, context: int, heads: int, kv_heads: int, head: int, dtype, device) -> Case:
    """Paged decode of ``heads`` query heads over ``kv_heads`` KV heads (samepath's column) against
    the same kernel over ``heads`` KV heads, one per query head (baseline column), and the grouped
    cache on the old, unpacked schedule. Packing runs one program per KV group, so the grouped
    decode reads each K/V tile once per KV head: it should take well under the ungrouped one."""
    span = context + 1
    pages = (span + PAGE_SIZE - 1) // PAGE_SIZE
    scale = head**-0.5
    perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(4321)).to(device)
    table = perm.view(batch, pages).to(torch.int32)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), span, dtype=torch.int32, device=device)

    def make(seed: int) -> dict:
        gen = _generator(seed, device)

        def cache(kv: int) -> torch.Tensor:
            dense = _randn((batch, pages * PAGE_SIZE, kv, head), dtype, device, gen)
            dense[:, span:] = 0
            out = torch.empty(batch * pages, PAGE_SIZE, kv, head, dtype=dtype, device=device)
            out[perm] = dense.view(batch * pages, PAGE_SIZE, kv, head)
            return out

        d = {"q": _randn((batch, heads, head), dtype, device, gen)}
        d["kc"], d["vc"], d["kc_all"], d["vc_all"] = cache(kv_heads), cache(kv_heads), cache(heads), cache(heads)
        return d

    plan = LaunchPlan(qsl, batch)  # one per step, shared by the step's layers

    def grouped(d):
        return paged_attention(d["q"], d["kc"], d["vc"], table, qsl, seq_lens, scale, validate=False, plan=plan)

    def ungrouped(d):
        return paged_attention(d["q"], d["kc_all"], d["vc_all"], table, qsl, seq_lens, scale, validate=False, plan=plan)

    def old(d):
        return old_schedule.paged_attention(d["q"], d["kc"], d["vc"], table, qsl, seq_lens, scale)

    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "paged_decode_gqa",
        f"B={batch} ctx={span} D={head} page={PAGE_SIZE}: samepath H={heads}/{kv_heads} (GQA-packed)",
        make,
        grouped,
        {
            f"samepath paged, H={heads}/{heads} (one KV head per query head)": ungrouped,
            f"{old_schedule.LABEL}, paged, H={heads}/{kv_heads} (unpacked heads)": old,
        },
        bytes=2 * batch * span * kv_heads * head * element,
    )


def rms_norm_case(rows: int, hidden: int, dtype, device, found: Baselines) -> Case:
    eps = 1e-6

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {"x": _randn((rows, hidden), dtype, device, gen), "w": _randn((hidden,), dtype, device, gen)}

    def hf_eager(d):
        h = d["x"].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return d["w"] * h.to(d["x"].dtype)

    baselines = {
        old_schedule.LABEL: lambda d: old_schedule.rms_norm(d["x"], d["w"], eps),
        "eager math (HF RMSNorm)": hf_eager,
        "torch F.rms_norm": lambda d: F.rms_norm(d["x"], (hidden,), d["w"], eps),
    }
    if found.liger is not None:
        baselines["Liger RMSNorm"] = lambda d: found.liger.liger_rms_norm(d["x"], d["w"], eps)
    if found.vllm_bi is not None and hasattr(found.vllm_bi, "rms_norm_batch_invariant"):
        baselines["vLLM batch-invariant rms_norm"] = lambda d: found.vllm_bi.rms_norm_batch_invariant(
            d["x"], d["w"], eps
        )
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "rms_norm",
        f"rows={rows} hidden={hidden}",
        make,
        lambda d: samepath.rms_norm(d["x"], d["w"], eps),
        baselines,
        bytes=(2 * rows + 1) * hidden * element,
    )


def swiglu_case(rows: int, inter: int, dtype, device, found: Baselines) -> Case:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {"gate": _randn((rows, inter), dtype, device, gen), "up": _randn((rows, inter), dtype, device, gen)}

    baselines = {"eager math (HF act_fn(gate) * up)": lambda d: F.silu(d["gate"]) * d["up"]}
    if found.liger is not None:
        baselines["Liger SwiGLU"] = lambda d: found.liger.liger_swiglu(d["gate"], d["up"])
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "swiglu",
        f"rows={rows} intermediate={inter}",
        make,
        lambda d: samepath.silu_mul(d["gate"], d["up"]),
        baselines,
        bytes=3 * rows * inter * element,
    )


def rotary_case(batch: int, seq: int, heads: int, kv_heads: int, head: int, dtype, device, found: Baselines) -> Case:
    positions = torch.arange(seq, device=device)[None].expand(batch, seq)
    cos, sin = samepath.rotary_cos_sin(positions, head, 1e6, dtype)

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {
            "q": _randn((batch, heads, seq, head), dtype, device, gen),
            "k": _randn((batch, kv_heads, seq, head), dtype, device, gen),
        }

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def hf_eager(d):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return d["q"] * c + rotate_half(d["q"]) * s, d["k"] * c + rotate_half(d["k"]) * s

    baselines = {"eager math (HF apply_rotary_pos_emb)": hf_eager}
    if found.liger is not None:
        baselines["Liger rope"] = lambda d: found.liger.liger_rope(d["q"], d["k"], cos, sin)
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "rotary",
        f"B={batch} S={seq} H={heads}/{kv_heads} D={head}",
        make,
        lambda d: samepath.apply_rotary(d["q"], d["k"], cos, sin),
        baselines,
        bytes=2 * batch * seq * (heads + kv_heads) * head * element,
    )


def moe_experts_case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype, device, found: Baselines
) -> Case:
    """A routed SwiGLU expert layer (Qwen3-MoE / Mixtral experts, forward): samepath's grouped
    expert GEMMs against samepath's per-expert loop (the same bits, one linear per expert), stock
    Hugging Face experts (``Qwen3MoeExperts``' eager loop on torch's matmul) and vLLM's Triton
    ``fused_experts`` where it imports and runs."""
    from samepath.integrations import moe

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        logits = _randn((tokens, experts), torch.float32, device, gen)
        index, weights = moe.topk_softmax_routing(logits, top_k, renormalize=True, dtype=dtype)
        return {
            "x": _randn((tokens, hidden), dtype, device, gen),
            "w13": _randn((experts, 2 * inter, hidden), dtype, device, gen) * hidden**-0.5,
            "w2": _randn((experts, hidden, inter), dtype, device, gen) * inter**-0.5,
            "index": index,
            "weights": weights,
        }

    def ours(d):
        with torch.no_grad():
            return moe.experts_forward(d["x"], d["w13"], d["w2"], d["index"], d["weights"])

    def loop(d):
        with torch.no_grad():
            return moe._experts_loop(d["x"], d["w13"], d["w2"], d["index"], d["weights"])

    baselines: dict[str, Callable[[dict], object]] = {"samepath per-expert loop (one linear per expert)": loop}
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as exc:
        found.missing["stock HF experts"] = f"not importable: {type(exc).__name__}: {exc}"
    else:
        config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
        config._experts_implementation = "eager"
        stock = Qwen3MoeExperts(config).to(device=device, dtype=dtype).requires_grad_(False)

        def hf_experts(d):
            stock.gate_up_proj.data, stock.down_proj.data = d["w13"], d["w2"]
            return stock(d["x"], d["index"], d["weights"])

        baselines["stock HF experts (Qwen3MoeExperts eager loop)"] = hf_experts
    if found.vllm_fused_experts is not None:
        fused = found.vllm_fused_experts

        def vllm_fused(d):
            return fused(d["x"], d["w13"], d["w2"], d["weights"].float(), d["index"].to(torch.int32))

        baselines["vLLM Triton fused_experts"] = vllm_fused

    def context(impl: str) -> contextlib.AbstractContextManager:
        # The loop's linears are samepath's only inside batch_invariant (as patch_all runs them).
        return samepath.batch_invariant() if impl.startswith("samepath per-expert loop") else contextlib.nullcontext()

    return Case(
        "moe_experts",
        f"tokens={tokens} H={hidden} I={inter} E={experts} top_k={top_k}",
        make,
        ours,
        baselines,
        flops=6.0 * tokens * top_k * hidden * inter,
        context=context,
    )


# ----------------------------------------------------------------------------------------------
# End to end: Hugging Face generate (rollout), a trainer forward + backward, host time per layer
# ----------------------------------------------------------------------------------------------


@dataclass
class E2ESize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head: int
    batch: int
    prompt: int
    new_tokens: int


def _tiny_model(size: E2ESize, dtype, device):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).to(device=device, dtype=dtype)


@contextlib.contextmanager
def _samepath_for(impl: str) -> Iterator[None]:
    """``patch_all()`` around the samepath sides of an end-to-end case (``samepath`` and the
    baselines named ``samepath, ...``); stock otherwise."""
    if not impl.startswith("samepath"):
        yield
        return
    from samepath import integrations

    with integrations.patched():
        yield


def _host_timer(model) -> Timer:
    """A timer that reports host time per attention-layer call: perf_counter around each
    ``self_attn`` module call, with no device synchronization, so on an asynchronous device it is
    the time the host spends issuing that layer's work (metadata building, host syncs included)."""

    def timer(fn, sets, device, warmup, repeats) -> Timing:
        layers = [layer.self_attn for layer in model.model.layers]
        times: list[float] = []
        started: list[float] = []

        def pre(module, args, kwargs=None):
            started.append(time.perf_counter())

        def post(module, args, output):
            times.append((time.perf_counter() - started.pop()) * 1e3)

        n = len(sets)
        for i in range(warmup):
            fn(sets[i % n])
        handles = [layer.register_forward_pre_hook(pre) for layer in layers]
        handles += [layer.register_forward_hook(post) for layer in layers]
        try:
            for i in range(repeats):
                fn(sets[(warmup + i) % n])
        finally:
            for handle in handles:
                handle.remove()
        if not times:
            raise RuntimeError("no attention-layer call was observed")
        times.sort()
        return Timing(times[0], times[len(times) // 2], times[-1], len(times))

    return timer


def e2e_cases(size: E2ESize, dtype, device) -> list[Case]:
    model = _tiny_model(size, dtype, device)
    lengths = [size.prompt - (i * 3) % max(1, size.prompt // 2) for i in range(size.batch)]
    width = max(lengths)

    def make(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.zeros(size.batch, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, width - n :] = torch.randint(1, size.vocab, (n,), generator=gen)
            mask[row, width - n :] = 1
        return {"ids": ids.to(device), "mask": mask.to(device)}

    def rollout(logprobs_fn):
        def run(d):
            model.eval()
            with torch.no_grad():
                out = model.generate(
                    input_ids=d["ids"],
                    attention_mask=d["mask"],
                    max_new_tokens=size.new_tokens,
                    min_new_tokens=size.new_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
                generated = out.sequences[:, width:]
                return logprobs_fn(torch.stack(out.logits, 1), generated)

        return run

    def stock_logprobs(logits, labels):
        return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, labels[..., None])[..., 0]

    def ours_logprobs(logits, labels):
        return samepath.logprobs(logits, labels, TEMPERATURE)

    def make_trainer(seed: int) -> dict:
        d = make(seed)
        ids = torch.randint(
            1, size.vocab, (size.batch, width + size.new_tokens), generator=torch.Generator().manual_seed(seed)
        )
        mask = torch.cat([d["mask"].cpu(), torch.ones(size.batch, size.new_tokens, dtype=torch.long)], 1)
        return {"ids": ids.to(device), "mask": mask.to(device)}

    def trainer(logprobs_fn):
        def run(d):
            model.train()
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=d["ids"], attention_mask=d["mask"], use_cache=False).logits
            lp = logprobs_fn(logits[:, width - 1 : -1], d["ids"][:, width:])
            (-lp.mean()).backward()
            return lp.detach()

        return run

    def fused_trainer(d):
        from samepath.integrations.hf import causal_lm_logprobs

        model.train()
        model.zero_grad(set_to_none=True)
        positions = (d["mask"].cumsum(1) - 1).clamp(min=0)
        lp = causal_lm_logprobs(
            model, d["ids"], attention_mask=d["mask"], position_ids=positions, temperature=TEMPERATURE
        )[:, width - 1 :]
        (-lp.mean()).backward()
        return lp.detach()

    def forward(d):
        model.eval()
        with torch.no_grad():
            return model(input_ids=d["ids"], attention_mask=d["mask"], use_cache=False).logits

    label = (
        f"qwen3 L={size.layers} hidden={size.hidden} H={size.heads}/{size.kv_heads} D={size.head} "
        f"V={size.vocab} B={size.batch} prompt<={width}"
    )
    stock_name = "stock HF (sdpa, torch ops)"
    host = _host_timer(model)
    host_what = "host ms per attention-layer call, no device sync (min/median/max over calls)"
    return [
        Case(
            "e2e",
            f"rollout generate +{size.new_tokens} tok, {label}",
            make,
            rollout(ours_logprobs),
            {stock_name: rollout(stock_logprobs)},
            tokens=size.batch * size.new_tokens,
            context=_samepath_for,
            repeat_scale=0.25,
        ),
        Case(
            "e2e",
            f"trainer fwd+bwd {width + size.new_tokens} tok/seq, {label}",
            make_trainer,
            trainer(ours_logprobs),
            {stock_name: trainer(stock_logprobs)},
            tokens=size.batch * (width + size.new_tokens),
            context=_samepath_for,
            repeat_scale=0.25,
        ),
        Case(
            "e2e",
            f"trainer fwd+bwd {width + size.new_tokens} tok/seq, fused lm_head (causal_lm_logprobs), {label}",
            make_trainer,
            fused_trainer,
            {stock_name: trainer(stock_logprobs), "samepath, full logits (model(...).logits)": trainer(ours_logprobs)},
            tokens=size.batch * (width + size.new_tokens),
            context=_samepath_for,
            repeat_scale=0.25,
        ),
        Case(
            "e2e",
            f"host time per attention layer, generate +{size.new_tokens} tok (prefill + decode steps), {label}",
            make,
            rollout(ours_logprobs),
            {stock_name: rollout(stock_logprobs)},
            context=_samepath_for,
            repeat_scale=0.25,
            timer=host,
            what=host_what,
        ),
        Case(
            "e2e",
            f"host time per attention layer, trainer forward {width + size.new_tokens} tok/seq, {label}",
            make_trainer,
            forward,
            {stock_name: forward},
            context=_samepath_for,
            repeat_scale=0.25,
            timer=host,
            what=host_what,
        ),
    ]


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------


def plan(ops: list[str], device: torch.device, dtype: torch.dtype, quick: bool, found: Baselines) -> Iterator[Case]:
    """The cases of ``ops`` for this device and mode, built lazily (one case's inputs at a time)."""
    cpu = device.type == "cpu"
    args = (dtype, device, found)
    for op in ops:
        if op in ("varlen_fwd", "varlen_fwdbwd"):
            if cpu:
                shapes = [([12, 5], 2, 1, 16)] if quick else [([100, 37], 4, 2, 64)]
                if op == "varlen_fwdbwd" and not quick:
                    shapes = [([48, 21], 4, 2, 64)]
            else:
                shapes = [([1024] * 8, 32, 8, 128)]
                if not quick:
                    shapes += [([4093] * 4, 32, 8, 128), ([3000, 517, 2048, 7000, 129, 3690], 32, 8, 128)]
            for lens, h, hk, d in shapes:
                yield varlen_case(op, lens, h, hk, d, *args)
        elif op == "chunked_prefill":
            if cpu:
                shapes = [(2, 16, 4, 2, 1, 16)] if quick else [(2, 64, 16, 4, 2, 64)]
            else:
                shapes = [(4, 4096, 512, 32, 8, 128)]
                if not quick:
                    shapes += [(16, 2048, 256, 32, 8, 128), (1, 16384, 2048, 32, 8, 128)]
            for b, ctx, c, h, hk, d in shapes:
                yield paged_case(op, b, ctx, c, h, hk, d, *args)
        elif op == "paged_decode":
            if cpu:
                shapes = [(2, 31)] if quick else [(b, c) for b in (1, 4) for c in (63, 255)]
                h, hk, d = (2, 1, 16) if quick else (4, 2, 64)
            else:
                shapes = [(b, c - 1) for b in (1, 64) for c in (2048,)]
                if not quick:
                    shapes = [(b, c - 1) for b in (1, 32, 128) for c in (1024, 8192)]
                h, hk, d = 32, 8, 128
            for b, ctx in shapes:
                yield paged_case(op, b, ctx, 1, h, hk, d, *args)
        elif op == "paged_decode_gqa":
            # 8 query heads over 2 KV heads against 8 over 8 (decode, one query per sequence)
            if cpu:
                b, ctx, d = (2, 31, 16) if quick else (2, 127, 64)
            else:
                b, ctx, d = (64, 2047, 128) if quick else (128, 4095, 128)
            yield gqa_decode_case(b, ctx, 8, 2, d, dtype, device)
        elif op == "linear":
            if cpu:
                shapes = [(4, 64, 64)] if quick else [(1, 256, 256), (64, 256, 256)]
            else:
                shapes = [(64, 4096, 4096), (4096, 4096, 4096)]
                if not quick:
                    shapes = [(1, 4096, 4096), *shapes, (4096, 4096, 14336)]
            for m, k, n in shapes:
                yield linear_case(m, k, n, *args)
        elif op == "token_logprobs":
            rows = ([1] if quick else [4]) if cpu else ([1024] if quick else [256, 4096])
            for r in rows:
                yield logprobs_case(r, 4096 if cpu and quick else VOCAB, *args)
        elif op in ("lm_head_logprobs", "lm_head_memory"):
            # (rows, hidden, vocab, token_chunk): on the CPU a small token chunk so that the tiny
            # sizes still cut the rows into several chunks
            if cpu:
                shapes = [(32 if op == "lm_head_logprobs" else 64, 16, 256, 8)] if quick else [(64, 64, 4096, 16)]
            else:
                shapes = [(4096, 4096, VOCAB, LM_HEAD_TOKEN_CHUNK)]
                if not quick:
                    shapes += [(16384, 4096, VOCAB, LM_HEAD_TOKEN_CHUNK)]
            build = lm_head_logprobs_case if op == "lm_head_logprobs" else lm_head_memory_case
            for r, hidden, vocab, chunk in shapes:
                yield build(r, hidden, vocab, chunk, *args)
        elif op == "rms_norm":
            if cpu:
                shapes = [(4, 256)] if quick else [(64, 1024)]
            else:
                shapes = [(4096, 4096)] if quick else [(1, 4096), (4096, 4096), (32768, 4096)]
            for r, hidden in shapes:
                yield rms_norm_case(r, hidden, *args)
        elif op == "swiglu":
            if cpu:
                shapes = [(4, 128)] if quick else [(64, 1024)]
            else:
                shapes = [(4096, 12288)] if quick else [(1, 12288), (4096, 12288), (16384, 12288)]
            for r, inter in shapes:
                yield swiglu_case(r, inter, *args)
        elif op == "rotary":
            if cpu:
                shapes = [(1, 8, 2, 1, 16)] if quick else [(2, 64, 4, 2, 64)]
            else:
                shapes = [(8, 1024, 32, 8, 128)] if quick else [(1, 1, 32, 8, 128), (8, 1024, 32, 8, 128)]
            for b, s, h, hk, d in shapes:
                yield rotary_case(b, s, h, hk, d, *args)
        elif op == "moe_experts":
            # (tokens, hidden, intermediate, experts, top_k): Qwen3-30B-A3B's expert layer on a GPU
            if cpu:
                shapes = [(8, 32, 16, 4, 2)] if quick else [(64, 64, 32, 8, 2)]
            else:
                shapes = [(4096, 2048, 768, 128, 8)]
                if not quick:
                    shapes = [(16, 2048, 768, 128, 8), *shapes, (16384, 2048, 768, 128, 8)]
            for t, hidden, inter, e, k in shapes:
                yield moe_experts_case(t, hidden, inter, e, k, *args)
        elif op in ("mla_train", "mla_decode"):  # bench/mla.py: DeepSeek's latent attention
            from bench import mla

            yield from mla.cases(op, device, dtype, quick, found)
        elif op in ("gdn_train", "gdn_decode"):  # bench/gdn.py: Gated DeltaNet (Qwen3-Next, Qwen3.5)
            from bench import gdn

            yield from gdn.cases(op, device, dtype, quick, found)
        elif op == "e2e":
            try:
                import transformers  # noqa: F401
            except ImportError:
                found.missing["e2e (Hugging Face)"] = "transformers is not installed (pip install -e .[hf])"
                continue
            if cpu:
                size = E2ESize(256, 64, 96, 1 if quick else 2, 4, 2, 16, 2, 6 if quick else 12, 2 if quick else 4)
            else:
                size = E2ESize(VOCAB, 1024, 3072, 4, 16, 8, 128, 8, 256, 16 if quick else 64)
            yield from e2e_cases(size, dtype, device)
        elif op == "vllm_decode_step":  # bench/decode_width.py: host time of vLLM's patched decode step
            from bench import decode_width

            b, ctx, width, layers = (2, 31, 64, 2) if cpu else (64, 1023, 2048, 4)
            h, hk, d = (4, 2, 16) if cpu else (32, 8, 128)
            case = decode_width.vllm_decode_step_case(b, ctx, width, layers, h, hk, d, *args)
            if case is not None:
                yield case
        else:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
