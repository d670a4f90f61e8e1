"""Bitwise consistency checks on a device (compiled Triton), each with its negative control.

    python bench/gpu_bitwise.py [--device cuda] [--out bitwise.json]

The test suite proves the contract under the CPU interpreter; this script re-checks the central
claims where the kernels are compiled: every row of ``varlen_attention`` (trainer) equals the row
``paged_attention`` (rollout) returns for that token under chunked prefill, decode, shuffled
batches and page sizes 16 / 128; ``linear``, ``token_logprobs`` and ``rms_norm`` rows do not depend
on the batch; ``log_softmax(..).gather`` equals ``token_logprobs``; Hugging Face ``generate``
log-probs equal the trainer's with ``patch_all()``. Each consistency check has a negative control
that must report a difference (otherwise the check proves nothing). Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import samepath
from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import attention_config, row_reduce_config


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def serve(q, k, v, lens, page_size: int, seed: int, config=None) -> torch.Tensor:
    """vLLM-style serving: random prefill chunks then decode steps, sequences shuffled each step,
    KV written into a NaN-filled cache with shuffled pages. Returns rows at each token's index."""
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
    chunks = []
    for n in lens:
        tail, left, c = min(3, n - 1), n - min(3, n - 1), []
        while left:
            c.append(rng.randint(1, min(64, left)))
            left -= c[-1]
        chunks.append(c + [1] * tail)
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
    return sum(not torch.equal(a[i], b[i]) for i in range(a.shape[0]))


def check_attention(device) -> list[dict]:
    results = []
    lens = [300, 77, 1, 129]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head in (64, 128, 80):
            gen = torch.Generator().manual_seed(head)
            total = sum(lens)
            q = torch.randn(total, 8, head, generator=gen).to(device, dtype)
            k = torch.randn(total, 2, head, generator=gen).to(device, dtype)
            v = torch.randn(total, 2, head, generator=gen).to(device, dtype)
            train = varlen_attention(q, k, v, _cu(lens, device))
            name = f"attention {str(dtype)[6:]} D={head}"
            for page in (16, 128):
                served = serve(q, k, v, lens, page, seed=page)
                results.append(dict(check=f"{name} page={page}: varlen == paged", bad_rows=bad_rows(train, served)))
            cfg = attention_config(head, dtype, device)
            other = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2)
            served = serve(q, k, v, lens, 16, seed=1, config=other)
            results.append(
                dict(check=f"{name}: negative control tile_n/2", bad_rows=bad_rows(train, served), expect_diff=True)
            )
    return results


def check_rest(device) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype)[6:]
        x = torch.randn(257, 4096, generator=gen).to(device, dtype)
        w = (torch.randn(1024, 4096, generator=gen) * 4096**-0.5).to(device, dtype)
        full = samepath.linear(x, w)
        alone = torch.cat([samepath.linear(x[i : i + 1], w) for i in range(0, 257, 32)])
        results.append(dict(check=f"linear {tag}: M=1 rows == M=257 rows", bad_rows=bad_rows(full[::32], alone)))
        stock = torch.nn.functional.linear
        stock_alone = torch.cat([stock(x[i : i + 1], w) for i in range(0, 257, 32)])
        results.append(
            dict(
                check=f"linear {tag}: stock F.linear M=1 vs M=257 (informative)",
                bad_rows=bad_rows(stock(x, w)[::32], stock_alone),
                informative=True,
            )
        )

        logits = (torch.randn(64, 151936, generator=gen) * 4).to(device, dtype)
        labels = torch.randint(0, 151936, (64,), generator=gen).to(device)
        lp = samepath.token_logprobs(logits, labels, 0.7)
        few = samepath.token_logprobs(logits[5:9], labels[5:9], 0.7)
        results.append(dict(check=f"token_logprobs {tag}: rows independent of batch", bad_rows=bad_rows(lp[5:9], few)))
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

        h = torch.randn(300, 4096, generator=gen).to(device, dtype)
        nw = torch.randn(4096, generator=gen).to(device, dtype)
        y = samepath.rms_norm(h, nw)
        results.append(
            dict(
                check=f"rms_norm {tag}: rows independent of batch",
                bad_rows=bad_rows(y[7:9], samepath.rms_norm(h[7:9], nw)),
            )
        )
    return results


def check_hf(device) -> list[dict]:
    try:
        import transformers
    except ImportError:
        return [dict(check="hf generate == trainer", skipped="transformers is not installed")]
    from samepath import integrations

    config = transformers.Qwen3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(device, torch.bfloat16).eval()
    prompts = [torch.randint(1, 2048, (n,)).tolist() for n in (17, 5, 40)]
    width, new = max(map(len, prompts)), 24
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    results = []
    for patched in (True, False):
        ctx = integrations.patched() if patched else torch.no_grad()
        with ctx, torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            gen_tokens = out.sequences[:, width:]
            rollout = samepath.logprobs(torch.stack(out.logits, 1), gen_tokens, 1.0)
            rows = []
            for row, p in enumerate(prompts):
                seq = torch.cat([torch.tensor(p, device=device), gen_tokens[row]])[None]
                logits = model(input_ids=seq, use_cache=False).logits[0]
                rows.append(samepath.logprobs(logits[len(p) - 1 : -1], gen_tokens[row], 1.0))
            trainer = torch.stack(rows)
        name = "hf generate == trainer (patch_all)" if patched else "hf generate vs trainer, stock: negative control"
        results.append(dict(check=name, bad_rows=bad_rows(rollout, trainer), expect_diff=not patched))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for fn in (check_attention, check_rest, check_hf):
        started = time.perf_counter()
        try:
            results += fn(device)
        except Exception as exc:
            results.append(dict(check=fn.__name__, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()))
        print(f"{fn.__name__}: {time.perf_counter() - started:.1f}s", flush=True)
    failed = 0
    for r in results:
        if "skipped" in r:
            status = "SKIP"
        elif "error" in r:
            status = "ERROR"
        elif r.get("informative"):
            status = "INFO"
        elif r.get("expect_diff"):
            status = "PASS" if r["bad_rows"] > 0 else "FAIL"
        else:
            status = "PASS" if r["bad_rows"] == 0 else "FAIL"
        r["status"] = status
        failed += status in ("FAIL", "ERROR")
        detail = r.get("error") or r.get("skipped") or f"{r['bad_rows']} rows differ"
        print(f"{status:5} {r['check']}: {detail}")
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
    summary.update(fingerprint=samepath.fingerprint(), torch=torch.__version__, failed=failed, results=results)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
