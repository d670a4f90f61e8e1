"""Multi-head latent attention (DeepSeek-V3's MLA) bench rows: samepath's absorbed form
(:mod:`samepath.kernels.mla`) for the trainer (forward + backward) and the paged decode, against the
stock paths a user would run on the same inputs:

* training: Hugging Face's decompressed form (``kv_b_proj`` expands K and V per head, attention at
  head size ``qk_nope + qk_rope`` with value ``v_head``) on torch SDPA, per sequence;
* decode: the absorbed form in torch (vLLM's MLA decode math: ``q_nope @ W_UK``, attention of one latent
  KV head gathered from the pages, ``@ W_UV``) on torch SDPA, and Hugging Face's decompressed decode
  (the whole cached latent expanded every step);
* FlashMLA (``flash_mla``) where it imports: its kernels take only DeepSeek's 576-wide latent heads
  (samepath's wide heads take 576 too, docs/numerics.md "Wide heads"); no row runs it yet (listed).

The rate column counts the model's FLOPs in the decompressed form (``4 * H * (qk_nope + qk_rope + v)/2``
per visible key pair and the expansion), the same number for every row: the absorbed form does more
(docs/numerics.md, "Multi-head latent attention")."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.baselines import Baselines
from bench.cases import PAGE_SIZE, Case
from samepath.kernels.attention import LaunchPlan
from samepath.kernels.mla import mla_attention, mla_paged_attention, split_kv_b


@dataclass(frozen=True)
class MLAShape:
    heads: int
    latent: int  # kv_lora_rank
    rope: int
    nope: int
    v_head: int

    @property
    def label(self) -> str:
        return f"H={self.heads} L={self.latent} R={self.rope} nope={self.nope} v={self.v_head}"


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def _weights(s: MLAShape, dtype, device, gen) -> torch.Tensor:
    return _randn((s.heads * (s.nope + s.v_head), s.latent), dtype, device, gen) * s.latent**-0.5


def _flash_mla_note(found: Baselines) -> None:
    if importlib.util.find_spec("flash_mla") is None:
        found.missing["FlashMLA"] = "not importable (pip install flash-mla; CUDA, Hopper)"
    else:
        found.missing["FlashMLA"] = "takes 576-wide latent heads only; no FlashMLA row is written yet"


def mla_train_case(lens: list[int], s: MLAShape, dtype, device, found: Baselines) -> Case:
    """The trainer's MLA, forward + backward, packed sequences."""
    total, scale = sum(lens), (s.nope + s.rope) ** -0.5
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    plan = LaunchPlan(cu, total)

    def make(seed: int) -> dict:
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
        d = {
            "q_nope": _randn((total, s.heads, s.nope), dtype, device, gen),
            "q_pe": _randn((total, s.heads, s.rope), dtype, device, gen),
            "c_kv": _randn((total, s.latent), dtype, device, gen),
            "k_pe": _randn((total, s.rope), dtype, device, gen),
            "kv_b": _weights(s, dtype, device, gen),
            "g": _randn((total, s.heads, s.v_head), dtype, device, gen),
        }
        for name in ("q_nope", "q_pe", "c_kv", "k_pe", "kv_b"):
            d[name].requires_grad_(True)
        return d

    def grads(d, out):
        return torch.autograd.grad(out, [d[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "kv_b")], d["g"])

    def ours(d):
        w_uk, w_uv = split_kv_b(d["kv_b"], s.heads, s.nope, s.v_head)
        out = mla_attention(
            d["q_nope"], d["q_pe"], d["c_kv"], d["k_pe"], w_uk, w_uv, cu, scale, validate=False, plan=plan
        )
        return grads(d, out)

    def decompressed(d):
        outs = []
        for a, b in itertools.pairwise(starts):
            n = b - a
            kv = F.linear(d["c_kv"][a:b], d["kv_b"]).view(n, s.heads, s.nope + s.v_head)
            k_nope, v = kv.split([s.nope, s.v_head], dim=-1)
            k = torch.cat((k_nope, d["k_pe"][a:b, None].expand(n, s.heads, s.rope)), dim=-1)
            q = torch.cat((d["q_nope"][a:b], d["q_pe"][a:b]), dim=-1)
            qkv = (t.transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)[0].transpose(0, 1))
        return grads(d, torch.cat(outs))

    _flash_mla_note(found)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    flops = 3.5 * (
        2.0 * s.heads * pairs * (s.nope + s.rope + s.v_head) + 2.0 * total * s.heads * s.latent * (s.nope + s.v_head)
    )
    baselines: dict[str, Callable[[dict], object]] = {
        "stock decompressed MLA (HF: kv_b_proj, torch SDPA)": decompressed
    }
    label = f"lens={lens} {s.label}"
    return Case("mla_train", label, make, ours, baselines, flops=flops, repeat_scale=0.5)


def mla_decode_case(batch: int, context: int, s: MLAShape, dtype, device, found: Baselines) -> Case:
    """One decode step of MLA over a paged latent cache (pages shuffled)."""
    span, scale = context + 1, (s.nope + s.rope) ** -0.5
    pages = (span + PAGE_SIZE - 1) // PAGE_SIZE
    perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(1234)).to(device)
    table = perm.view(batch, pages).to(torch.int32)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), span, dtype=torch.int32, device=device)
    plan = LaunchPlan(qsl, batch)
    width = s.latent + s.rope

    def make(seed: int) -> dict:
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
        dense = _randn((batch, pages * PAGE_SIZE, 1, width), dtype, device, gen)
        dense[:, span:] = 0
        cache = torch.empty(batch * pages, PAGE_SIZE, 1, width, dtype=dtype, device=device)
        cache[perm] = dense.view(batch * pages, PAGE_SIZE, 1, width)
        return {
            "q_nope": _randn((batch, s.heads, s.nope), dtype, device, gen),
            "q_pe": _randn((batch, s.heads, s.rope), dtype, device, gen),
            "cache": cache,
            "kv_b": _weights(s, dtype, device, gen),
        }

    def ours(d):
        w_uk, w_uv = split_kv_b(d["kv_b"], s.heads, s.nope, s.v_head)
        return mla_paged_attention(
            d["q_nope"], d["q_pe"], d["cache"], w_uk, w_uv, table, qsl, seq_lens, scale, validate=False, plan=plan
        )

    def gathered(d) -> torch.Tensor:  # [B, span, L + R]
        return d["cache"][table.long()].flatten(1, 2)[:, :span, 0]

    def absorbed_torch(d):
        w = d["kv_b"].view(s.heads, s.nope + s.v_head, s.latent)
        q_lat = torch.einsum("bhn,hnl->bhl", d["q_nope"], w[:, : s.nope])
        q = torch.cat((q_lat, d["q_pe"]), dim=-1)[:, :, None]  # [B, H, 1, L + R]
        kv = gathered(d)[:, None]  # [B, 1, span, L + R]
        out = F.scaled_dot_product_attention(q, kv, kv[..., : s.latent], scale=scale, enable_gqa=True)
        return torch.einsum("bhl,hvl->bhv", out[:, :, 0], w[:, s.nope :])

    def decompressed(d):
        kv_all = gathered(d)
        kv = F.linear(kv_all[..., : s.latent], d["kv_b"]).view(batch, span, s.heads, s.nope + s.v_head)
        k_nope, v = kv.split([s.nope, s.v_head], dim=-1)
        k = torch.cat((k_nope, kv_all[:, :, None, s.latent :].expand(batch, span, s.heads, s.rope)), dim=-1)
        q = torch.cat((d["q_nope"], d["q_pe"]), dim=-1)[:, :, None]
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=scale)

    _flash_mla_note(found)
    baselines: dict[str, Callable[[dict], object]] = {
        "stock absorbed MLA decode in torch (vLLM's math, gather pages, SDPA)": absorbed_torch,
        "stock decompressed MLA decode (HF generate: expand the cache, SDPA)": decompressed,
    }
    element = torch.empty((), dtype=dtype).element_size()
    label = f"B={batch} ctx={span} {s.label} page={PAGE_SIZE}"
    return Case("mla_decode", label, make, ours, baselines, bytes=batch * span * width * element)


def cases(op: str, device: torch.device, dtype, quick: bool, found: Baselines):
    """The MLA cases of ``op`` for this device: a scaled-down latent (the kernels' heads stop at 256) on
    a GPU, tiny shapes on the CPU."""
    if device.type == "cpu":
        shape = MLAShape(4, 32, 16, 32, 32)
        lens, (batch, ctx) = ([12, 5], (2, 31)) if quick else ([48, 21], (2, 127))
    else:
        shape = MLAShape(16, 192, 64, 128, 128)
        lens, (batch, ctx) = ([1024] * 4, (64, 2047)) if quick else ([4096] * 2, (128, 4095))
    if op == "mla_train":
        yield mla_train_case(lens, shape, dtype, device, found)
    else:
        yield mla_decode_case(batch, ctx, shape, dtype, device, found)
