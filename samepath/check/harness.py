"""The two sides of an RL step on one machine: the rollout (Hugging Face ``generate``) and the
trainer (a right-padded forward of the finished sequences), for ``samepath check`` and
``samepath doctor``.

Everything here works on any Hugging Face causal LM of the model types samepath patches; with no
model directory the embedded default (a tiny random-weight Qwen3 built from a config, saved with
``save_pretrained`` and loaded back, so the load path is exercised) runs on a fresh machine with
nothing downloaded.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass

import torch

from samepath.kernels.config import fingerprint
from samepath.rl.hf_harness import (  # noqa: F401 (the names samepath check always had here)
    DEFAULT_MODEL_CONFIG,
    DTYPE_ALIASES,
    DTYPES,
    DTYPES_BY_TORCH,
    CheckInputError,
    LoadedModel,
    build_default_model,
    canonical_dtype_name,
    check_model_config,
    check_model_dir,
    check_model_head_size,
    import_transformers,
    load_default_model,
    load_model,
    one_line,
    pad_token_id,
    random_prompts,
    rollout_hf,
    trainer_forward,
)


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    canonical = canonical_dtype_name(name)
    if canonical is None:
        raise CheckInputError(
            f"unsupported dtype {name!r} for {flag}; choose float32 (fp32), bfloat16 (bf16) or float16 (fp16, half)"
        )
    return DTYPES[canonical]


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------


class Progress:
    """What runs, how far it is, and how long it took, on stderr: one phase at a time.

    ``start(phase, total, unit)`` begins a phase (ending the one before), ``advance(n)`` counts
    ``n`` of its ``total`` units done, ``end()`` ends it with its time. On a terminal (``mode``
    ``"live"``) one line per phase is rewritten in place with the count done and the time elapsed;
    otherwise (``"lines"``) a plain line when each phase starts and one when it ends, with its count
    and time, and never a carriage return. There is no estimate of the time left: on the CPU the
    samepath phases run orders of magnitude slower than the stock ones, so any rate measured so far
    would mislead. ``"off"`` writes nothing.
    """

    MODES = ("live", "lines", "off")

    def __init__(self, command: str, mode: str = "lines", stream=None, *, phases: int | None = None) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.enabled = mode != "off"
        self._stream = sys.stderr if stream is None else stream
        self._command = command
        self._phases = phases
        self._index = 0
        self._phase: str | None = None
        self._total: int | None = None
        self._unit = ""
        self._done = 0
        self._began = 0.0
        self._first = None

    def start(self, phase: str, total: int | None = None, unit: str = "", detail: str = "") -> None:
        """Begin ``phase`` (ending the current one): ``total`` units of ``unit`` when it can count."""
        import time

        self.end()
        self._index += 1
        self._phase, self._total, self._unit, self._done = phase, total, unit, 0
        self._began = time.perf_counter()
        if self._first is None:
            self._first = self._began
        if self.mode == "lines":
            what = f" ({detail})" if detail else ""
            self._write(f"{self._prefix()}{phase}{what} ...\n")
        elif self.mode == "live":
            self._live()

    def advance(self, n: int = 1) -> None:
        """``n`` more units of the current phase are done."""
        if self._phase is None:
            return
        self._done += n
        if self.mode == "live":
            self._live()

    def end(self) -> None:
        """End the current phase (if any) with the count done and the time it took."""
        if self._phase is None:
            return
        line = f"{self._prefix()}{self._phase} done: {self._count()}{self._format_elapsed()}"
        self._phase = None
        if self.mode == "lines":
            self._write(line + "\n")
        elif self.mode == "live":
            self._write(f"\r{line}\x1b[K\n")

    def close(self) -> None:
        """After the last phase: with more than one phase, a line with the time of all. A phase still
        open (an error left it) is reported stopped, not done."""
        import time

        if self._phase is not None:
            line = f"{self._prefix()}{self._phase} stopped: {self._count()}{self._format_elapsed()}"
            self._phase = None
            self._write(("\r" if self.mode == "live" else "") + line + ("\x1b[K\n" if self.mode == "live" else "\n"))
            self._first = None
            return
        if self.enabled and self._first is not None and self._index > 1:
            self._write(f"{self._command}: {self._index} phases in {_seconds(time.perf_counter() - self._first)}\n")
        self._first = None

    # -- formatting ---------------------------------------------------------------------------

    def _prefix(self) -> str:
        step = f"[{self._index}/{self._phases}] " if self._phases else ""
        return f"{self._command}: {step}"

    def _count(self) -> str:
        if self._total is None:
            return f"{self._done} {self._unit}, " if self._done and self._unit else ""
        return f"{self._done}/{self._total} {self._unit}, ".replace(" ,", ",")

    def _format_elapsed(self) -> str:
        import time

        return _seconds(time.perf_counter() - self._began)

    def _live(self) -> None:
        self._write(f"\r{self._prefix()}{self._phase}: {self._count()}{self._format_elapsed()}\x1b[K")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        self._stream.write(text)
        self._stream.flush()


def _seconds(elapsed: float) -> str:
    if elapsed < 60:
        return f"{elapsed:.1f} s"
    minutes, seconds = divmod(round(elapsed), 60)
    return f"{minutes} min {seconds:02d} s"


def progress_mode(setting: str, stream=None) -> str:
    """The :class:`Progress` mode for a ``--progress`` setting: ``auto`` / ``on`` give a live line
    on a terminal and plain lines elsewhere, ``lines`` plain lines always, ``off`` nothing."""
    stream = sys.stderr if stream is None else stream
    if setting == "off":
        return "off"
    if setting == "lines":
        return "lines"
    isatty = getattr(stream, "isatty", None)
    return "live" if isatty is not None and isatty() else "lines"


# ----------------------------------------------------------------------------------------------
# Rollout and trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class SideBySide:
    """One rollout and the trainer's recomputation of the same tokens."""

    numerics: str  #: "stock" or "samepath"
    prompts: list[list[int]]
    generated: torch.Tensor
    rollout_logprobs: torch.Tensor
    trainer_logprobs: torch.Tensor
    rollout_fingerprint: str
    trainer_fingerprint: str


def rollout_vllm(
    model_dir: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    seed: int,
    with_samepath: bool,
    model_config=None,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A vLLM rollout of ``prompts`` in a child process (stock, or with samepath's plugin): the
    generated tokens ``[B, new_tokens]``, their log-probs at ``temperature`` and the fingerprint
    the child reported ("stock vLLM" without samepath). With ``model_config`` (the trainer's), the
    plugin also refuses a model it resolved to other formulas."""
    from samepath.check.vllm_rollout import VLLMRolloutSpec, run_vllm_rollout

    spec = VLLMRolloutSpec(
        model=model_dir,
        dtype=DTYPES_BY_TORCH[dtype],
        batches=[prompts],
        new_tokens=new_tokens,
        temperature=temperature,
        seed=seed,
        samepath=with_samepath,
        expect_fingerprint=fingerprint(model_config=model_config) if with_samepath else None,
        max_model_len=max(map(len, prompts)) + new_tokens,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=max(64, len(prompts)),  # vLLM needs at least one token per sequence
    )
    try:
        result = run_vllm_rollout(spec)
    except RuntimeError as exc:
        raise CheckInputError(f"the vLLM rollout failed: {one_line(exc)} (see the log above)") from exc
    generated = torch.tensor([r.tokens for r in result.requests])
    logprobs = torch.tensor([r.logprobs for r in result.requests], dtype=torch.float32)
    return generated, logprobs, result.fingerprint or "stock vLLM"


def run_side_by_side(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    seed: int,
    numerics: str,
    progress: Progress | None = None,
    vllm_model_dir: str | None = None,
) -> SideBySide:
    """Rollout (Hugging Face ``generate``, or vLLM on ``vllm_model_dir`` when given), then the
    trainer forward, with whatever numerics are in effect now."""
    progress = Progress("samepath", "off") if progress is None else progress
    batch = f"{len(prompts)} sequence" + ("s" if len(prompts) != 1 else "")
    if vllm_model_dir is None:
        progress.start(f"{numerics} rollout", new_tokens, "tokens", f"Hugging Face generate, {batch}")
        generated, rollout_lp = rollout_hf(model, prompts, new_tokens, temperature, seed, progress.advance)
        rollout_fp = fingerprint()
    else:
        progress.start(f"{numerics} rollout", None, "", f"vLLM in a child process, {batch} x {new_tokens} tokens")
        dtype = next(model.parameters()).dtype
        generated, rollout_lp, rollout_fp = rollout_vllm(
            vllm_model_dir,
            dtype,
            prompts,
            new_tokens,
            temperature,
            seed,
            with_samepath=numerics == "samepath",
            model_config=model.config,
        )
    width = max(map(len, prompts)) + new_tokens
    progress.start(f"{numerics} trainer", None, "", f"one forward of {batch} x {width} positions")
    trainer_lp = trainer_forward(model, prompts, generated, temperature or 1.0)
    progress.end()
    return SideBySide(numerics, prompts, generated, rollout_lp, trainer_lp, rollout_fp, fingerprint())


def run_stock_and_patched(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    seed: int,
    progress: Progress | None = None,
    vllm_model_dir: str | None = None,
) -> tuple[SideBySide, SideBySide]:
    """The same check twice: stock kernels, then under ``integrations.patch_all()`` (and, for a
    vLLM rollout, with samepath's vLLM plugin in the rollout process).

    ``progress`` shows the four phases (stock rollout and trainer, then samepath's) as they run.
    Leaves the patch state as it found it.
    """
    from samepath import integrations

    was_enabled = integrations.enabled()
    progress = Progress("samepath check", "off") if progress is None else progress
    try:
        integrations.unpatch_all()
        stock = run_side_by_side(model, prompts, new_tokens, temperature, seed, "stock", progress, vllm_model_dir)
        integrations.patch_all()
        try:
            patched = run_side_by_side(
                model, prompts, new_tokens, temperature, seed, "samepath", progress, vllm_model_dir
            )
        finally:
            integrations.unpatch_all()
    finally:
        progress.close()
        if was_enabled:
            integrations.patch_all()
    return stock, patched


def audit_model_dir(directory: str | None, dtype: torch.dtype = torch.float32):
    """Load a Hugging Face causal LM directory (default: ``samepath check``'s embedded tiny Qwen3),
    put it on samepath as ``patch_all`` would and return its audit
    (:class:`samepath.audit.AuditReport`; a model type samepath does not patch is reported, not
    raised), leaving the patch state as it was."""
    from samepath import integrations
    from samepath.integrations import hf
    from samepath.integrations.hf_audit import audit_hf_model
    from samepath.integrations.patcher import Patcher

    transformers = import_transformers()
    with tempfile.TemporaryDirectory(prefix="samepath-audit-") as scratch:
        if directory is None:
            build_default_model(scratch)
        source = directory or scratch
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True).eval()
    was = integrations.enabled()
    integrations.patch_all()
    try:
        hf.use_samepath(model, Patcher())  # a throwaway model: nothing to set back
        return audit_hf_model(model)
    finally:
        if not was:
            integrations.unpatch_all()


__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "DTYPES",
    "DTYPE_ALIASES",
    "CheckInputError",
    "LoadedModel",
    "Progress",
    "SideBySide",
    "audit_model_dir",
    "build_default_model",
    "canonical_dtype_name",
    "check_model_config",
    "check_model_dir",
    "load_default_model",
    "load_model",
    "pad_token_id",
    "parse_dtype",
    "random_prompts",
    "rollout_hf",
    "rollout_vllm",
    "run_side_by_side",
    "run_stock_and_patched",
    "trainer_forward",
]
