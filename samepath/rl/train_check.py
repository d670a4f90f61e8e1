"""``samepath train-check``: N GRPO steps on the embedded default model (or ``--model DIR``), stock
and with samepath.

Each run starts from the same weights (the embedded default Qwen3, fp32, random weights, saved
with ``save_pretrained`` and loaded back; or the model directory given) and runs
:func:`samepath.rl.run_grpo` with the rollout engine and trainer precision asked for: "stock" with
the frameworks' own kernels on both sides and the trainer's log-probs as verl computes them
(:class:`StockTrainer`), "samepath" under ``patch_all()`` (and samepath's vLLM plugin). A vLLM run happens in a fresh
child process (``python -m samepath.rl.train_check SPEC_JSON``), since vLLM keeps process-global
state: the trainer and vLLM's client there, vLLM's engine core and worker in processes of their own
(``rollout="vllm"``, :mod:`samepath.rl.vllm_workers`) or in the child itself
(``rollout="vllm-inprocess"``, :mod:`samepath.rl.vllm_engine`); the child prints one
``SAMEPATH_RESULT {json}`` line with the per-step metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from samepath.rl.grpo import CopyTask, HFRollout, StepMetrics, Trainer, numerics, run_grpo

RESULT_PREFIX = "SAMEPATH_RESULT "


@dataclass
class TrainCheckSpec:
    """One run of the loop (``sync_steps``: see :func:`samepath.rl.run_grpo`; prompts of
    ``min_prompt_len`` to ``max_prompt_len`` tokens; ``reset_prefix_cache``: see
    :class:`samepath.rl.vllm_engine.VLLMRollout`). ``rollout``: ``"hf"``, ``"vllm"`` (vLLM in its own
    worker processes, the weights through its RPC: :class:`samepath.rl.vllm_workers.VLLMWorkerRollout`,
    ``transport`` one of its transports) or ``"vllm-inprocess"`` (vLLM in the trainer's process)."""

    steps: int = 3
    rollout: str = "hf"
    precision: str = "fp32_master"
    prompts: int = 2
    group_size: int = 4
    new_tokens: int = 4
    lr: float = 1e-3
    temperature: float = 1.0
    seed: int = 0
    numerics: str = "samepath"
    sync_steps: int | None = None
    min_prompt_len: int = 3
    max_prompt_len: int = 7
    reset_prefix_cache: bool = True
    tie_word_embeddings: bool = False
    device: str = "cpu"
    model: str | None = None  #: a Hugging Face model directory; None: the embedded default
    eos_token_id: int | None = None  #: completions end at this token or after new_tokens; None: all capped
    transport: str = "shm"  #: how rollout "vllm" receives the weights: "shm" or "rpc"

    def __post_init__(self) -> None:
        from samepath.rl.vllm_workers import TRANSPORTS

        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rollout must be one of {', '.join(ROLLOUTS)}, got {self.rollout!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")


#: The rollout engines of :class:`TrainCheckSpec`.
ROLLOUTS = ("hf", "vllm", "vllm-inprocess")


class StockTrainer(Trainer):
    """The stock trainer's log-probs the way verl computes them: the model's logits divided by the
    temperature in their own dtype (verl's ``logits.div_(temperature)`` on bf16 logits), then an fp32
    log-softmax — while the rollout engines (vLLM's sampler, ``generate``) divide fp32 logits. At a
    temperature that is not a power of two the two roundings differ on every machine, whatever its
    kernels: the drift samepath removes by dividing in fp32 inside one kernel on both sides."""

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scaled = (logits / self.temperature).float()
        return torch.log_softmax(scaled, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def parse_eos_token_id(value: str, own: int | list[int] | None, vocab_size: int) -> int | None:
    """``--eos-token-id``: ``none``, ``auto`` (the model's own EOS, the first of a list) or a token id."""
    from samepath.rl.hf_harness import CheckInputError

    key = str(value).strip().lower()
    if key == "none":
        return None
    if key == "auto":
        own = own[0] if isinstance(own, list) and own else own
        return None if own is None or isinstance(own, list) else int(own)
    try:
        eos = int(key)
    except ValueError:
        raise CheckInputError(f"--eos-token-id must be a token id, auto or none, got {value!r}") from None
    if not 0 <= eos < vocab_size:
        raise CheckInputError(f"--eos-token-id must be a token id below the vocabulary size {vocab_size}, got {eos}")
    return eos


def run_in_process(spec: TrainCheckSpec, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
    """Run ``spec`` here (the vLLM engine too, when ``spec.rollout == "vllm"``)."""
    from samepath.rl.hf_harness import build_default_model, load_model

    with tempfile.TemporaryDirectory(prefix="samepath-train-check-") as scratch:
        directory = spec.model or scratch
        if spec.model is None:
            build_default_model(directory, seed=0, tie_word_embeddings=spec.tie_word_embeddings)
        with numerics(spec.numerics):
            model = load_model(directory, torch.float32).model.to(spec.device)
            vocab = int(model.config.vocab_size)
            task = CopyTask(vocab, spec.prompts, spec.min_prompt_len, spec.max_prompt_len, seed=spec.seed)
            trainer_class = Trainer if spec.numerics == "samepath" else StockTrainer
            trainer = trainer_class(model, spec.precision, lr=spec.lr, temperature=spec.temperature)
            batch = spec.prompts * spec.group_size
            engine = dict(
                seed=spec.seed,
                max_model_len=spec.max_prompt_len + spec.new_tokens + 32,
                max_num_seqs=batch,
                reset_prefix_cache=spec.reset_prefix_cache,
            )
            if spec.rollout == "vllm":
                from samepath.rl.vllm_workers import VLLMWorkerRollout

                samepath = spec.numerics == "samepath"
                rollout = VLLMWorkerRollout(
                    directory, trainer.rollout_dtype, samepath=samepath, transport=spec.transport, **engine
                )
            elif spec.rollout == "vllm-inprocess":
                from samepath.rl.vllm_engine import VLLMRollout

                rollout = VLLMRollout(directory, trainer.rollout_dtype, **engine)
            else:
                rollout = HFRollout.for_trainer(trainer)
            try:
                return run_grpo(
                    trainer,
                    rollout,
                    task,
                    spec.steps,
                    spec.group_size,
                    spec.new_tokens,
                    seed=spec.seed,
                    sync_steps=spec.sync_steps,
                    on_step=on_step,
                    eos_token_id=spec.eos_token_id,
                )
            finally:
                if hasattr(rollout, "close"):
                    rollout.close()


def run_in_child(spec: TrainCheckSpec, timeout: float = 1800.0) -> list[StepMetrics]:
    """Run ``spec`` in a fresh Python process (the trainer and vLLM's client there; vLLM's engine
    core there too for ``"vllm-inprocess"``, in processes of its own for ``"vllm"``); raise
    ``RuntimeError`` with the child's stderr tail on failure."""
    env = dict(os.environ)
    env.update(
        SAMEPATH_VLLM="1" if spec.numerics == "samepath" else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if spec.rollout == "vllm" else "0",
        TOKENIZERS_PARALLELISM="false",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("SAMEPATH_EXPECT_FINGERPRINT", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "samepath.rl.train_check", json.dumps(asdict(spec))],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the training run did not finish within {timeout:g} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the training run failed (exit status {proc.returncode}):\n{proc.stderr[-6000:]}")
    return [StepMetrics(**m) for m in json.loads(lines[-1].removeprefix(RESULT_PREFIX))]


def run(spec: TrainCheckSpec, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
    """A vLLM run in a child process, a Hugging Face one here."""
    return run_in_process(spec, on_step) if spec.rollout == "hf" else run_in_child(spec)


def format_table(stock: list[StepMetrics], patched: list[StepMetrics]) -> str:
    """Per step: tokens bitwise equal, max |Δlogp|, the ratio's range and k3 KL, stock vs samepath,
    and how much the update moved the weights the rollout is sent."""

    def cells(m: StepMetrics) -> str:
        equal = f"{m.equal_tokens}/{m.tokens}"
        return f"{equal:>7} {m.max_abs_diff:>10.3g} {m.ratio_min:>8.6f}..{m.ratio_max:<8.6f} {m.k3_kl:>9.3g}"

    head = f"{'equal':>7} {'max|Δlogp|':>10} {'ratio min..max':^18} {'k3 KL':>9}"
    lines = [
        f"{'':4}  {'stock':^48}  {'samepath':^48}  {'':>9}",
        f"{'step':4}  {head}  {head}  {'max |Δw|':>9}",
    ]
    for s, p in zip(stock, patched, strict=True):
        lines.append(f"{p.step:>4}  {cells(s)}  {cells(p)}  {p.weight_change:>9.3g}")
    lines.append(
        "stock: the same loop with the frameworks' own kernels on both sides (samepath not patched in), the trainer "
        "dividing its bf16 logits by the temperature as verl does, the rollout its fp32 logits as vLLM and generate "
        "do; samepath: both sides on samepath's kernels"
    )
    return "\n".join(lines)


def plot(stock: list[StepMetrics], patched: list[StepMetrics], path: str) -> None:
    """A PNG of max |Δlogp| per step, stock and samepath (needs matplotlib)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, history in (("stock", stock), ("samepath", patched)):
        ax.plot([m.step for m in history], [m.max_abs_diff for m in history], marker="o", label=name)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel("max |Δlogp| rollout vs trainer (0 = bit-identical)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _child(spec: TrainCheckSpec) -> list[dict]:
    if spec.rollout == "vllm-inprocess" and spec.numerics == "samepath":
        from samepath.integrations import vllm_plugin

        vllm_plugin.register()
    return [m.to_json() for m in run_in_process(spec)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = TrainCheckSpec(**json.loads(argv[0]))
    print(RESULT_PREFIX + json.dumps(_child(spec)), flush=True)


if __name__ == "__main__":
    main()


__all__ = [
    "ROLLOUTS",
    "StockTrainer",
    "TrainCheckSpec",
    "format_table",
    "parse_eos_token_id",
    "plot",
    "run",
    "run_in_child",
    "run_in_process",
]
