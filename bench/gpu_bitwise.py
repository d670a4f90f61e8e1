"""Bitwise consistency checks on a device (compiled Triton), each with its negative control.

    python bench/gpu_bitwise.py [--device cuda] [--out bitwise.json] [--checks attention,rest,...]
    python bench/gpu_bitwise.py --dry-run      # list the checks and exit (no device needed)

The test suite proves the contract under the CPU interpreter; this script re-checks the central
claims where the kernels are compiled, for fp32 / bf16 / fp16 and head sizes 64, 128 and 80:

* ``attention``: every row of ``varlen_attention`` (trainer) equals the row ``paged_attention``
  (rollout) returns for that token under one-shot prefill, chunked prefill (random chunks, then
  decode steps) and token-by-token decode, with shuffled batches and page sizes 16 / 128;
* ``attention_backward``: ``varlen_attention``'s gradients are equal run to run and with the batch
  reversed (on the Ascend C backward when ``SAMEPATH_ATTENTION_BACKEND=ascendc``);
* ``backward``: gradients of linear, rms_norm, silu_mul and token_logprobs are equal run to run;
* ``split_k``: ``matmul(k_slices=S)`` equals the fp32 shard partials summed in rank order (what a
  TP-S row-parallel layer computes), and its rows do not depend on the batch;
* ``rest``: ``linear``, ``token_logprobs``, ``log_softmax`` and ``rms_norm`` rows do not depend on
  the batch;
* ``hf``: Hugging Face ``generate`` log-probs equal the trainer forward's with ``patch_all()``
  for a small Qwen3 and Qwen3-MoE (samepath.check.harness);
* ``vllm``: samepath's vLLM plugin on a real vLLM rollout (CUDA backend patch) equals the
  trainer, when vLLM is importable.

Each consistency check has a negative control with a deliberate schedule difference (half the
KV tile, half the vocab chunk, a different k_slices) that must report a difference, otherwise the
check proves nothing. Results are written to ``--out`` after every check group, so a timeout
keeps what finished. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import samepath
from bench.timing import device_for
from samepath.kernels import config as config_module
from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import attention_config, row_reduce_config

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_SIZES = (64, 128, 80)

#: Problem sizes: ``device`` for the compiled kernels, ``small`` (``--small``) to smoke-test this
#: script on a CPU under Triton's interpreter.
SIZES = {
    "device": dict(
        small=False,
        lens=[300, 77, 1, 129],
        bwd_lens=[257, 64, 3],
        rows=300,
        lp_rows=1024,
        hidden=1024,
        k=4096,
        n=1024,
        vocab=151936,
    ),
    "small": dict(
        small=True, lens=[40, 7, 1], bwd_lens=[40, 9], rows=5, lp_rows=256, hidden=64, k=256, n=32, vocab=20000
    ),
}
#: The Hugging Face models of the ``hf`` check: (vocab, hidden, intermediate, head size, new tokens).
HF_SIZES = {
    "device": dict(vocab=4096, hidden=256, intermediate=512, head=64, new_tokens=24, max_prompt=60),
    "small": dict(vocab=320, hidden=64, intermediate=96, head=32, new_tokens=4, max_prompt=30),
}
SIZE = dict(SIZES["device"])


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _schedule(lens: list[int], mode: str, rng: random.Random) -> list[list[int]]:
    """Per sequence, the query counts of its steps: ``prefill`` (one chunk), ``chunked`` (random
    chunks, then three decode steps) or ``decode`` (one token per step)."""
    chunks = []
    for n in lens:
        if mode == "prefill":
            chunks.append([n])
        elif mode == "decode":
            chunks.append([1] * n)
        else:
            tail, left, c = min(3, n - 1), n - min(3, n - 1), []
            while left:
                c.append(rng.randint(1, min(64, left)))
                left -= c[-1]
            chunks.append(c + [1] * tail)
    return chunks


def serve(q, k, v, lens, page_size: int, seed: int, mode: str = "chunked", config=None) -> torch.Tensor:
    """vLLM-style serving of the packed sequences (``mode`` as in :func:`_schedule`), sequences
    shuffled each step, KV written into a NaN-filled cache with shuffled pages. Returns each
    token's output row at its packed index."""
    device = q.device
    rng = random.Random(seed)
    pages = [(n + page_size - 1) // page_size for n in lens]
    order = list(range(sum(pages) + 2))
    rng.shuffle(order)
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(pages):
        table[seq, :count] = torch.tensor(order[taken : taken + count])
        taken += count
    shape = (len(order), page_size, k.shape[1], k.shape[2])
    k_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=device)
    v_cache = k_cache.clone()
    chunks = _schedule(lens, mode, rng)
    starts = _cu(lens, "cpu").tolist()
    out = torch.full_like(q, float("nan"))
    done = [0] * len(lens)
    for step in range(max(map(len, chunks))):
        active = [i for i, c in enumerate(chunks) if step < len(c)]
        rng.shuffle(active)
        index, slots, q_lens, kv_lens = [], [], [], []
        for seq in active:
            positions = range(done[seq], done[seq] + chunks[seq][step])
            index += [starts[seq] + p for p in positions]
            slots += [int(table[seq, p // page_size]) * page_size + p % page_size for p in positions]
            q_lens.append(len(positions))
            done[seq] += len(positions)
            kv_lens.append(done[seq])
        idx = torch.tensor(index, device=device)
        write_kv_cache(k[idx], v[idx], k_cache, v_cache, torch.tensor(slots, device=device))
        out[idx] = paged_attention(
            q[idx],
            k_cache,
            v_cache,
            table[torch.tensor(active)].to(device),
            _cu(q_lens, device),
            torch.tensor(kv_lens, dtype=torch.int32, device=device),
            q.shape[-1] ** -0.5,
            config=config,
        )
    return out


def bad_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape:
        return max(a.shape[0], b.shape[0])
    return sum(not torch.equal(a[i], b[i]) for i in range(a.shape[0]))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_attention(device) -> list[dict]:
    results = []
    lens = SIZE["lens"]
    for dtype in DTYPES:
        for head in HEAD_SIZES:
            gen = torch.Generator().manual_seed(head)
            total = sum(lens)
            q = torch.randn(total, 8, head, generator=gen).to(device, dtype)
            k = torch.randn(total, 2, head, generator=gen).to(device, dtype)
            v = torch.randn(total, 2, head, generator=gen).to(device, dtype)
            train = varlen_attention(q, k, v, _cu(lens, device))
            name = f"attention {_name(dtype)} D={head}"
            for mode, page in (("prefill", 16), ("chunked", 16), ("chunked", 128), ("decode", 16)):
                served = serve(q, k, v, lens, page, seed=page, mode=mode)
                results.append(
                    dict(check=f"{name} {mode} page={page}: training == {mode}", bad_rows=bad_rows(train, served))
                )
            cfg = attention_config(head, dtype, device)
            other = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2)
            served = serve(q, k, v, lens, 16, seed=1, config=other)
            results.append(
                dict(check=f"{name}: negative control tile_n/2", bad_rows=bad_rows(train, served), expect_diff=True)
            )
    return results


def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor, *extra, **kwargs):
    """Gradients of ``fn(*inputs, *extra, **kwargs)`` with respect to ``inputs``, for ``grad_out``."""
    for t in inputs:
        t.grad = None
    fn(*inputs, *extra, **kwargs).backward(grad_out)
    return [t.grad.clone() for t in inputs]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))


def check_attention_backward(device) -> list[dict]:
    """``varlen_attention``'s gradients equal run to run and with the batch reversed (no atomics, no order
    that depends on scheduling), on the backend ``SAMEPATH_ATTENTION_BACKEND`` selects (the Ascend C
    backward under ``ascendc``); negative control: half the forward's KV tile."""
    results = []
    lens = SIZE["bwd_lens"]
    for dtype in DTYPES:
        tag = _name(dtype)
        for head in HEAD_SIZES:
            gen = torch.Generator().manual_seed(7 + head)
            total = sum(lens)
            q, k, v = (
                torch.randn(total, h, head, generator=gen).to(device, dtype).requires_grad_(True) for h in (8, 2, 2)
            )
            g = torch.randn(total, 8, head, generator=gen).to(device, dtype)
            cu = _cu(lens, device)
            first = _grads(varlen_attention, [q, k, v], g, cu)
            second = _grads(varlen_attention, [q, k, v], g, cu)
            results.append(dict(check=f"backward attention {tag} D={head}: run == run", bad_rows=_same(first, second)))
            # The batch reversed: each sequence's gradient rows keep their bits (dQ order is per sequence).
            order = list(reversed(range(len(lens))))
            starts = [sum(lens[:i]) for i in range(len(lens))]
            index = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in order]).to(device)
            leaves = [t.detach()[index].requires_grad_(True) for t in (q, k, v)]
            flipped = _grads(varlen_attention, leaves, g[index], _cu([lens[i] for i in order], device))
            back = [torch.empty_like(t).index_copy_(0, index, t) for t in flipped]
            check = f"backward attention {tag} D={head}: reversed batch"
            results.append(dict(check=check, bad_rows=_same(first, back)))
            cfg = attention_config(head, dtype, device)
            other = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2)
            third = _grads(varlen_attention, [q, k, v], g, cu, config=other)
            results.append(
                dict(
                    check=f"backward attention {tag} D={head}: negative control tile_n/2",
                    bad_rows=_same(first, third),
                    expect_diff=True,
                )
            )
    return results


def check_backward(device) -> list[dict]:
    """Gradients of linear, rms_norm, silu_mul and token_logprobs equal run to run."""
    results = []
    rows, hidden = SIZE["rows"], SIZE["hidden"]
    for dtype in DTYPES:
        tag = _name(dtype)
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_(True)
        w = (torch.randn(hidden // 2, hidden, generator=gen) * hidden**-0.5).to(device, dtype).requires_grad_(True)
        gy = torch.randn(rows, hidden // 2, generator=gen).to(device, dtype)
        a = _grads(samepath.linear, [x, w], gy)
        b = _grads(samepath.linear, [x, w], gy)
        results.append(dict(check=f"backward linear {tag}: run == run", bad_rows=_same(a, b)))
        nw = torch.randn(hidden, generator=gen).to(device, dtype).requires_grad_(True)
        gx = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        a = _grads(samepath.rms_norm, [x, nw], gx)
        b = _grads(samepath.rms_norm, [x, nw], gx)
        results.append(dict(check=f"backward rms_norm {tag}: run == run", bad_rows=_same(a, b)))
        up = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_(True)
        a = _grads(samepath.silu_mul, [x, up], gx)
        b = _grads(samepath.silu_mul, [x, up], gx)
        results.append(dict(check=f"backward silu_mul {tag}: run == run", bad_rows=_same(a, b)))
        vocab = min(SIZE["vocab"], 32768)
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype).requires_grad_(True)
        labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        glp = torch.randn(rows, generator=gen).to(device)
        a = _grads(samepath.token_logprobs, [logits], glp, labels, 0.7)
        b = _grads(samepath.token_logprobs, [logits], glp, labels, 0.7)
        results.append(dict(check=f"backward token_logprobs {tag}: run == run", bad_rows=_same(a, b)))
    return results


def check_split_k(device) -> list[dict]:
    """TP slices: ``matmul(k_slices=S)`` == the fp32 partials of S row-parallel shards summed in
    rank order; rows independent of M; a different S is the negative control."""
    from samepath.distributed import sum_partials

    results = []
    gen = torch.Generator().manual_seed(3)
    k, n, m = SIZE["k"], SIZE["n"], (SIZE["rows"] if SIZE["small"] else 129)
    for dtype in DTYPES:
        tag = _name(dtype)
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
        for slices in (2, 4, 8):
            full = samepath.matmul(x, w.t(), k_slices=slices)
            width = k // slices
            partials = [
                samepath.matmul(
                    x[:, r * width : (r + 1) * width], w[:, r * width : (r + 1) * width].t(), out_dtype=torch.float32
                )
                for r in range(slices)
            ]
            results.append(
                dict(
                    check=f"split-K {tag} S={slices}: matmul(k_slices) == shard partials summed in rank order",
                    bad_rows=bad_rows(full, sum_partials(partials, None, dtype)),
                )
            )
            alone = torch.cat([samepath.matmul(x[i : i + 1], w.t(), k_slices=slices) for i in range(0, m, 16)])
            results.append(
                dict(check=f"split-K {tag} S={slices}: M=1 rows == M={m} rows", bad_rows=bad_rows(full[::16], alone))
            )
        results.append(
            dict(
                check=f"split-K {tag}: negative control S=2 vs S=1",
                bad_rows=bad_rows(samepath.matmul(x, w.t(), k_slices=2), samepath.matmul(x, w.t())),
                expect_diff=dtype == torch.float32,
                informative=dtype != torch.float32,  # low-precision outputs may round both to the same bits
            )
        )
    return results


def check_rest(device) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    k, n, vocab = SIZE["k"], SIZE["n"], SIZE["vocab"]
    m = 33 if SIZE["small"] else 257
    for dtype in DTYPES:
        tag = _name(dtype)
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
        full = samepath.linear(x, w)
        alone = torch.cat([samepath.linear(x[i : i + 1], w) for i in range(0, m, 32)])
        results.append(dict(check=f"linear {tag}: M=1 rows == M={m} rows", bad_rows=bad_rows(full[::32], alone)))
        stock = torch.nn.functional.linear
        stock_alone = torch.cat([stock(x[i : i + 1], w) for i in range(0, m, 32)])
        results.append(
            dict(
                check=f"linear {tag}: stock F.linear M=1 vs M={m} (informative)",
                bad_rows=bad_rows(stock(x, w)[::32], stock_alone),
                informative=True,
            )
        )

        # many rows: half the vocab chunk moves the last bit of only some rows' log-sum-exp
        n_rows = SIZE["lp_rows"]
        logits = (torch.randn(n_rows, vocab, generator=gen) * 4).to(device, dtype)
        labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(device)
        lp = samepath.token_logprobs(logits, labels, 0.7)
        few = samepath.token_logprobs(logits[5:9], labels[5:9], 0.7)
        results.append(dict(check=f"token_logprobs {tag}: rows independent of batch", bad_rows=bad_rows(lp[5:9], few)))
        one = torch.cat([samepath.token_logprobs(logits[i : i + 1], labels[i : i + 1], 0.7) for i in range(0, 64, 9)])
        results.append(
            dict(check=f"token_logprobs {tag}: B=1 rows == B={n_rows} rows", bad_rows=bad_rows(lp[:64:9], one))
        )
        gathered = samepath.log_softmax(logits, 0.7).gather(-1, labels[:, None])[:, 0]
        results.append(dict(check=f"log_softmax.gather == token_logprobs {tag}", bad_rows=bad_rows(lp, gathered)))
        other = dataclasses.replace(row_reduce_config(device), vocab_chunk=row_reduce_config(device).vocab_chunk // 2)
        results.append(
            dict(
                check=f"token_logprobs {tag}: negative control vocab_chunk/2",
                bad_rows=bad_rows(lp, samepath.token_logprobs(logits, labels, 0.7, config=other)),
                expect_diff=True,
            )
        )

        h = torch.randn(SIZE["rows"], k, generator=gen).to(device, dtype)
        nw = torch.randn(k, generator=gen).to(device, dtype)
        y = samepath.rms_norm(h, nw)
        results.append(
            dict(
                check=f"rms_norm {tag}: rows independent of batch",
                bad_rows=bad_rows(y[7:9], samepath.rms_norm(h[7:9], nw)),
            )
        )
    return results


@contextlib.contextmanager
def _half_tiles(head: int, dtype: torch.dtype, device) -> Iterator[None]:
    """The attention table with half the KV tile for one (head size, dtype): a deliberate schedule
    difference for the negative controls of the end-to-end checks."""
    key = (config_module.device_kind(device), config_module.dtype_name(dtype), config_module.padded_head_size(head))
    saved = config_module.ATTENTION_TABLE[key]
    config_module.ATTENTION_TABLE[key] = dataclasses.replace(saved, tile_n=saved.tile_n // 2)
    try:
        yield
    finally:
        config_module.ATTENTION_TABLE[key] = saved


def _hf_model(arch: str, dtype: torch.dtype, device, size: dict):
    import transformers

    from samepath.check.harness import DEFAULT_MODEL_CONFIG

    common = {key: value for key, value in DEFAULT_MODEL_CONFIG.items() if key != "head_dim"}
    common.update(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=size["head"],
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=size["intermediate"] // 4,
            norm_topk_prob=True,
            **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # random init gives near-uniform logits; spread them out
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def check_lm_head(device) -> list[dict]:
    """The fused lm_head + log-probs (the trainer's ``causal_lm_logprobs`` / verl's fused path) ==
    ``token_logprobs(linear(h, w))`` (the rollout's logits), forward; its hidden gradient == the
    unfused one; its weight gradient == the fp32 per-chunk partials summed in chunk order (the
    running sum taken in place by the matmul's epilogue). Negative control: a temperature one
    fp32 ulp above."""
    from samepath.kernels.logprobs import linear_token_logprobs
    from samepath.kernels.matmul import matmul

    results = []
    gen = torch.Generator().manual_seed(11)
    rows, hidden, vocab = SIZE["rows"], SIZE["hidden"], SIZE["vocab"]
    chunk = max(1, rows // 3 + 1)  # three chunks, the last one short
    for dtype in (torch.bfloat16, torch.float32):
        tag = _name(dtype)
        h = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
        labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        g = torch.randn(rows, generator=gen).to(device)
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        logits = samepath.linear(h1, w1)
        logits.retain_grad()
        unfused = samepath.token_logprobs(logits, labels, 0.7)
        unfused.backward(g)
        h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
        fused = linear_token_logprobs(h2, w2, labels, 0.7, token_chunk=chunk)
        fused.backward(g)
        results.append(dict(check=f"fused lm_head {tag}: == logprobs(linear)", bad_rows=bad_rows(fused, unfused)))
        results.append(dict(check=f"fused lm_head {tag}: dhidden == unfused", bad_rows=bad_rows(h2.grad, h1.grad)))
        dlogits = logits.grad
        total = None
        for start in range(0, rows, chunk):
            part = matmul(dlogits[start : start + chunk].t(), h[start : start + chunk], out_dtype=torch.float32)
            total = part if total is None else total + part
        results.append(
            dict(
                check=f"fused lm_head {tag}: dweight == chunk-ordered fp32 partials",
                bad_rows=bad_rows(w2.grad, total.to(dtype)),
            )
        )
        ulp = torch.nextafter(torch.tensor(0.7), torch.tensor(2.0)).item()
        results.append(
            dict(
                check=f"fused lm_head {tag}: negative control, temperature one fp32 ulp above",
                bad_rows=bad_rows(linear_token_logprobs(h, w, labels, ulp, token_chunk=chunk), unfused.detach()),
                expect_diff=True,
            )
        )
        del logits, dlogits, h1, w1, h2, w2
    return results


def check_hf(device) -> list[dict]:
    """HF generate (left-padded, KV cache, sampled) == trainer forward (right-padded), patched."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [dict(check="hf generate == trainer", skipped="transformers is not installed")]
    from samepath import integrations
    from samepath.check import harness

    results = []
    size = HF_SIZES["small" if SIZE["small"] else "device"]
    new = size["new_tokens"]
    prompts = harness.random_prompts(4, size["vocab"], seed=5, min_len=3, max_len=size["max_prompt"])
    for arch in ("qwen3", "qwen3_moe"):
        for dtype in (torch.bfloat16, torch.float32):
            model = _hf_model(arch, dtype, device, size)
            name = f"hf {arch} {_name(dtype)}"
            with integrations.patched():
                generated, rollout_lp = harness.rollout_hf(model, prompts, new, 0.7, seed=1)
                trainer_lp = harness.trainer_forward(model, prompts, generated, 0.7)
                results.append(
                    dict(check=f"{name}: generate == trainer (patch_all)", bad_rows=bad_rows(rollout_lp, trainer_lp))
                )
                fused_lp = harness.trainer_forward(model, prompts, generated, 0.7, fused=True)
                results.append(
                    dict(check=f"{name}: generate == fused lm_head trainer", bad_rows=bad_rows(rollout_lp, fused_lp))
                )
                with _half_tiles(size["head"], dtype, device):
                    perturbed = harness.trainer_forward(model, prompts, generated, 0.7)
                results.append(
                    dict(
                        check=f"{name}: negative control, trainer with tile_n/2",
                        bad_rows=bad_rows(rollout_lp, perturbed),
                        expect_diff=True,
                    )
                )
            stock_gen, stock_lp = harness.rollout_hf(model, prompts, new, 0.7, seed=1)
            stock_trainer = harness.trainer_forward(model, prompts, stock_gen, 0.7)
            results.append(
                dict(
                    check=f"{name}: stock generate vs trainer (informative)",
                    bad_rows=bad_rows(stock_lp, stock_trainer),
                    informative=True,
                )
            )
            del model
    return results


def check_vllm(device) -> list[dict]:
    """A real vLLM rollout with samepath's plugin (the CUDA attention backend patch) == the trainer."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return [dict(check="vllm rollout == trainer", skipped=f"vLLM is not importable ({type(exc).__name__})")]
    from samepath import integrations
    from samepath.check import harness

    results = []
    with tempfile.TemporaryDirectory(prefix="samepath-vllm-") as directory:
        harness.build_default_model(directory)
        loaded = harness.load_model(directory, torch.bfloat16)
        model = loaded.model.to(device)
        prompts = harness.random_prompts(4, model.config.vocab_size, seed=3)
        with integrations.patched():
            generated, rollout_lp, fingerprint = harness.rollout_vllm(
                directory, torch.bfloat16, prompts, 16, 0.7, 1, with_samepath=True
            )
            trainer_lp = harness.trainer_forward(model.to(device), prompts, generated, 0.7)
        results.append(
            dict(
                check=f"vllm rollout (plugin, {fingerprint}) == trainer (patch_all)",
                bad_rows=bad_rows(rollout_lp, trainer_lp),
            )
        )
        generated, stock_lp, _ = harness.rollout_vllm(
            directory, torch.bfloat16, prompts, 16, 0.7, 1, with_samepath=False
        )
        with integrations.patched():
            stock_trainer = harness.trainer_forward(model, prompts, generated, 0.7)
        results.append(
            dict(
                check="vllm rollout without the plugin vs trainer: negative control",
                bad_rows=bad_rows(stock_lp, stock_trainer),
                expect_diff=True,
            )
        )
    return results


#: Check groups in the order they run: the most valuable first, so a timeout loses the least.
CHECKS: dict[str, Callable[[torch.device], list[dict]]] = {
    "attention": check_attention,
    "hf": check_hf,
    "rest": check_rest,
    "lm_head": check_lm_head,
    "split_k": check_split_k,
    "attention_backward": check_attention_backward,
    "backward": check_backward,
    "vllm": check_vllm,
}


def _status(r: dict) -> str:
    if "skipped" in r:
        return "SKIP"
    if "error" in r:
        return "ERROR"
    if r.get("informative"):
        return "INFO"
    if r.get("expect_diff"):
        return "PASS" if r["bad_rows"] > 0 else "FAIL"
    return "PASS" if r["bad_rows"] == 0 else "FAIL"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="JSON results, rewritten after every check group")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS))
    parser.add_argument("--dry-run", action="store_true", help="list the checks and exit (no device needed)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: smoke-test the script on a CPU")
    args = parser.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown --checks {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(f"gpu_bitwise dry run: device={args.device} checks={','.join(args.checks)} out={args.out}")
        return 0
    SIZE.clear()
    SIZE.update(SIZES["small" if args.small else "device"])
    device = device_for(args.device)
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
    summary.update(fingerprint=samepath.fingerprint(), torch=torch.__version__, failed=0, results=[])
    results: list[dict] = summary["results"]
    for name in args.checks:
        started = time.perf_counter()
        try:
            group = CHECKS[name](device)
        except Exception as exc:
            group = [dict(check=name, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())]
        for r in group:
            r["status"] = _status(r)
            detail = r.get("error") or r.get("skipped") or f"{r['bad_rows']} rows differ"
            print(f"{r['status']:5} {r['check']}: {detail}", flush=True)
        results += group
        summary["failed"] = sum(r["status"] in ("FAIL", "ERROR") for r in results)
        print(f"{name}: {time.perf_counter() - started:.1f}s", flush=True)
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
    failed = summary["failed"]
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
