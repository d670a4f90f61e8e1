"""The benchmark cases: one builder per op, sized per device and mode, each with its baselines.

Every case builds its inputs from a seed (so several sets can be cycled) and names its samepath
call and the stock baselines it is compared with, measured in the same run on the same device:

* stock PyTorch: SDPA and eager math (Hugging Face's ``eager_attention_forward``) for attention,
  ``F.linear`` (cuBLAS / CPU BLAS) for matmul, ``F.log_softmax`` + ``gather`` for token logprobs,
  Hugging Face's RMSNorm math and ``F.rms_norm``;
* flash-attn (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``) and vLLM's batch-invariant
  Triton kernels (``vllm.model_executor.layers.batch_invariant``), only where they import and the
  device and dtype suit them; otherwise the column is skipped with a note.

Baselines read the KV cache as a dense, contiguous ``[batch, kv_heads, seq, head]`` tensor (what
Hugging Face's cache holds); samepath reads it through a shuffled page table, as vLLM serves it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import samepath
from samepath.kernels.attention import paged_attention, varlen_attention

#: Op groups, in the order they run (``--ops`` takes a comma-separated subset).
OPS = (
    "varlen_fwd",
    "varlen_fwdbwd",
    "chunked_prefill",
    "paged_decode",
    "linear",
    "token_logprobs",
    "rms_norm",
    "e2e",
)

VOCAB = 151936  # Qwen2/Qwen3's padded vocabulary
TEMPERATURE = 0.7
PAGE_SIZE = 16


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


# ----------------------------------------------------------------------------------------------
# Optional third-party baselines
# ----------------------------------------------------------------------------------------------


@dataclass
class Optional3p:
    flash_attn: Any = None
    vllm_bi: Any = None
    notes: list[str] = field(default_factory=list)


def optional_baselines(device: torch.device, dtype: torch.dtype) -> Optional3p:
    """flash-attn and vLLM's batch-invariant kernels, when they import and suit device and dtype."""
    found = Optional3p()
    try:
        import flash_attn

        if device.type != "cuda" or dtype == torch.float32:
            found.notes.append("flash-attn: installed, but it runs on CUDA in fp16/bf16 only — column skipped")
        else:
            found.flash_attn = flash_attn
    except Exception as exc:  # ImportError, or a broken build (undefined symbols)
        found.notes.append(f"flash-attn: not importable ({type(exc).__name__}) — column skipped")
    try:
        from vllm.model_executor.layers import batch_invariant as vllm_bi

        if device.type != "cuda":
            found.notes.append("vLLM batch-invariant kernels: installed, but CUDA only — column skipped")
        else:
            found.vllm_bi = vllm_bi
    except Exception as exc:
        found.notes.append(f"vLLM batch-invariant kernels: not importable ({type(exc).__name__}) — column skipped")
    return found


# ----------------------------------------------------------------------------------------------
# Attention helpers
# ----------------------------------------------------------------------------------------------


def _randn(shape, dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)


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


def varlen_case(op: str, lens: list[int], heads: int, kv_heads: int, head: int, dtype, device, opt: Optional3p) -> Case:
    """Packed causal self-attention (the trainer's forward, or forward + backward)."""
    backward = op == "varlen_fwdbwd"
    total = sum(lens)
    scale = head**-0.5
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        d = {
            "q": _randn((total, heads, head), dtype, device, gen),
            "k": _randn((total, kv_heads, head), dtype, device, gen),
            "v": _randn((total, kv_heads, head), dtype, device, gen),
            "cu": torch.tensor(starts, dtype=torch.int32, device=device),
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
            return finish(d, varlen_attention(d["q"], d["k"], d["v"], d["cu"], scale, validate=False))

    def per_sequence(attend):
        def run(d):
            with torch.set_grad_enabled(backward):
                outs = []
                for s, e in itertools.pairwise(starts):
                    q, k, v = (d[n][s:e].transpose(0, 1) for n in ("q", "k", "v"))
                    outs.append(attend(q, k, v).transpose(0, 1))
                return finish(d, torch.cat(outs))

        return run

    baselines = {
        "torch SDPA": per_sequence(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        ),
        "eager math": per_sequence(lambda q, k, v: eager_attention(q, k, v, scale, offset=0)),
    }
    if opt.flash_attn is not None:
        fa = opt.flash_attn

        def flash(d):
            with torch.set_grad_enabled(backward):
                m = max(lens)
                out = fa.flash_attn_varlen_func(d["q"], d["k"], d["v"], d["cu"], d["cu"], m, m, causal=True)
                return finish(d, out)

        baselines["flash-attn varlen"] = flash
    flops = 4.0 * heads * head * sum(_causal_pairs(n) for n in lens) * (3.5 if backward else 1.0)
    shape = f"lens={_lens_label(lens)} H={heads}/{kv_heads} D={head}"
    return Case(op, shape, make, ours, baselines, flops=flops, repeat_scale=0.5 if backward else 1.0)


def _lens_label(lens: list[int]) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)}x{lens[0]}"
    return "[" + ",".join(map(str, lens)) + "]"


def paged_case(
    op: str, batch: int, context: int, chunk: int, heads: int, kv_heads: int, head: int, dtype, device, opt
) -> Case:
    """``chunk`` new queries per sequence over ``context`` cached positions (``chunk = 1``: decode)."""
    span = context + chunk  # KV positions per sequence after this step
    pages = (span + PAGE_SIZE - 1) // PAGE_SIZE
    scale = head**-0.5

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        kd = _randn((batch, kv_heads, span, head), dtype, device, gen)
        vd = _randn((batch, kv_heads, span, head), dtype, device, gen)
        q = _randn((batch * chunk, heads, head), dtype, device, gen)
        perm = torch.randperm(batch * pages, generator=gen, device=gen.device).to(device)

        def paged(dense):
            padded = torch.zeros(batch, pages * PAGE_SIZE, kv_heads, head, dtype=dtype, device=device)
            padded[:, :span] = dense.transpose(1, 2)
            cache = torch.empty(batch * pages, PAGE_SIZE, kv_heads, head, dtype=dtype, device=device)
            cache[perm] = padded.view(batch * pages, PAGE_SIZE, kv_heads, head)
            return cache

        return {
            "q": q,
            "qd": q.view(batch, chunk, heads, head).transpose(1, 2).contiguous(),
            "kd": kd,
            "vd": vd,
            "kc": paged(kd),
            "vc": paged(vd),
            "table": perm.view(batch, pages).to(torch.int32),
            "qsl": torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device),
            "seq_lens": torch.full((batch,), span, dtype=torch.int32, device=device),
            "mask": torch.ones(chunk, span, dtype=torch.bool, device=device).tril(context),
        }

    def ours(d):
        return paged_attention(d["q"], d["kc"], d["vc"], d["table"], d["qsl"], d["seq_lens"], scale, validate=False)

    def sdpa(d):
        mask = None if chunk == 1 else d["mask"]
        return F.scaled_dot_product_attention(d["qd"], d["kd"], d["vd"], attn_mask=mask, scale=scale, enable_gqa=True)

    baselines = {
        "torch SDPA": sdpa,
        "eager math": lambda d: eager_attention(d["qd"], d["kd"], d["vd"], scale, offset=context),
    }
    if opt.flash_attn is not None:
        fa = opt.flash_attn

        def flash(d):
            q = d["qd"].transpose(1, 2)  # [B, chunk, H, D]
            return fa.flash_attn_with_kvcache(
                q, d["kd"].transpose(1, 2), d["vd"].transpose(1, 2), cache_seqlens=d["seq_lens"], causal=True
            )

        baselines["flash-attn kvcache"] = flash
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * span * kv_heads * head * element
    if op == "paged_decode":
        label = f"B={batch} ctx={span} H={heads}/{kv_heads} D={head} page={PAGE_SIZE}"
        return Case(op, label, make, ours, baselines, bytes=kv_bytes + 2 * q_bytes(batch, heads, head, element))
    pairs = batch * sum(context + i + 1 for i in range(chunk))
    label = f"B={batch} ctx={context}+{chunk} H={heads}/{kv_heads} D={head} page={PAGE_SIZE}"
    return Case(op, label, make, ours, baselines, flops=4.0 * heads * head * pairs)


def q_bytes(batch: int, heads: int, head: int, element: int) -> int:
    return batch * heads * head * element


# ----------------------------------------------------------------------------------------------
# The rest of the model
# ----------------------------------------------------------------------------------------------


def linear_case(m: int, k: int, n: int, dtype, device, opt: Optional3p) -> Case:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {"x": _randn((m, k), dtype, device, gen), "w": _randn((n, k), dtype, device, gen) * k**-0.5}

    blas = "cuBLAS" if device.type == "cuda" else "CPU BLAS"
    baselines = {f"torch F.linear ({blas})": lambda d: F.linear(d["x"], d["w"])}
    if opt.vllm_bi is not None and hasattr(opt.vllm_bi, "matmul_persistent"):
        baselines["vLLM batch-invariant matmul"] = lambda d: opt.vllm_bi.matmul_persistent(d["x"], d["w"].t())
    return Case(
        "linear",
        f"M={m} K={k} N={n}",
        make,
        lambda d: samepath.linear(d["x"], d["w"]),
        baselines,
        flops=2.0 * m * n * k,
    )


def logprobs_case(rows: int, dtype, device, opt: Optional3p) -> Case:
    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        labels = torch.randint(0, VOCAB, (rows,), generator=gen, device=gen.device).to(device)
        return {"logits": _randn((rows, VOCAB), dtype, device, gen) * 4, "labels": labels}

    def stock(d):
        return torch.log_softmax(d["logits"].float() / TEMPERATURE, -1).gather(-1, d["labels"][:, None])[:, 0]

    baselines = {"F.log_softmax + gather (fp32)": stock}
    if opt.vllm_bi is not None and hasattr(opt.vllm_bi, "log_softmax"):

        def vllm_lp(d):
            lp = opt.vllm_bi.log_softmax(d["logits"].float() / TEMPERATURE, dim=-1)
            return lp.gather(-1, d["labels"][:, None])[:, 0]

        baselines["vLLM batch-invariant log_softmax"] = vllm_lp
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "token_logprobs",
        f"rows={rows} V={VOCAB} T={TEMPERATURE}",
        make,
        lambda d: samepath.token_logprobs(d["logits"], d["labels"], TEMPERATURE, validate=False),
        baselines,
        bytes=rows * VOCAB * element,
    )


def rms_norm_case(rows: int, hidden: int, dtype, device, opt: Optional3p) -> Case:
    eps = 1e-6

    def make(seed: int) -> dict:
        gen = _generator(seed, device)
        return {"x": _randn((rows, hidden), dtype, device, gen), "w": _randn((hidden,), dtype, device, gen)}

    def hf_eager(d):
        h = d["x"].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return d["w"] * h.to(d["x"].dtype)

    baselines = {
        "eager math (HF RMSNorm)": hf_eager,
        "torch F.rms_norm": lambda d: F.rms_norm(d["x"], (hidden,), d["w"], eps),
    }
    if opt.vllm_bi is not None and hasattr(opt.vllm_bi, "rms_norm_batch_invariant"):
        baselines["vLLM batch-invariant rms_norm"] = lambda d: opt.vllm_bi.rms_norm_batch_invariant(d["x"], d["w"], eps)
    element = torch.empty((), dtype=dtype).element_size()
    return Case(
        "rms_norm",
        f"rows={rows} hidden={hidden}",
        make,
        lambda d: samepath.rms_norm(d["x"], d["w"], eps),
        baselines,
        bytes=(2 * rows + 1) * hidden * element,
    )


# ----------------------------------------------------------------------------------------------
# End to end: Hugging Face generate (rollout) and a trainer forward + backward
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
    """``patch_all()`` around the samepath side of an end-to-end case; stock otherwise."""
    if impl != "samepath":
        yield
        return
    from samepath import integrations

    with integrations.patched():
        yield


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

    label = (
        f"qwen3 L={size.layers} hidden={size.hidden} H={size.heads}/{size.kv_heads} D={size.head} "
        f"V={size.vocab} B={size.batch} prompt<={width}"
    )
    stock_name = "stock HF (sdpa, torch ops)"
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
    ]


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------


def plan(ops: list[str], device: torch.device, dtype: torch.dtype, quick: bool, opt: Optional3p) -> Iterator[Case]:
    """The cases of ``ops`` for this device and mode, built lazily (one case's inputs at a time)."""
    cpu = device.type == "cpu"
    args = (dtype, device, opt)
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
                shapes = [(b, 31) for b in (1, 4)] if quick else [(b, c) for b in (1, 4) for c in (63, 255)]
                h, hk, d = (2, 1, 16) if quick else (4, 2, 64)
            else:
                shapes = [(b, c - 1) for b in (1, 64) for c in (2048,)]
                if not quick:
                    shapes = [(b, c - 1) for b in (1, 32, 128) for c in (1024, 8192)]
                h, hk, d = 32, 8, 128
            for b, ctx in shapes:
                yield paged_case(op, b, ctx, 1, h, hk, d, *args)
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
                yield logprobs_case(r, *args)
        elif op == "rms_norm":
            if cpu:
                shapes = [(4, 256)] if quick else [(64, 1024)]
            else:
                shapes = [(4096, 4096)] if quick else [(1, 4096), (4096, 4096), (32768, 4096)]
            for r, hidden in shapes:
                yield rms_norm_case(r, hidden, *args)
        elif op == "e2e":
            try:
                import transformers  # noqa: F401
            except ImportError:
                opt.notes.append("e2e: transformers is not installed (pip install -e .[hf]) — skipped")
                continue
            if cpu:
                size = E2ESize(256, 64, 96, 2, 4, 2, 16, 2, 6 if quick else 12, 2 if quick else 4)
            else:
                size = E2ESize(VOCAB, 1024, 3072, 4, 16, 8, 128, 8, 256, 16 if quick else 64)
            yield from e2e_cases(size, dtype, device)
        else:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
