"""The two sides of an RL step on one machine: the rollout (Hugging Face ``generate``) and the
trainer (a right-padded forward of the finished sequences), for ``samepath check`` and
``samepath doctor``.

Everything here works on any Hugging Face causal LM of the model types samepath patches; with no
model directory the embedded default (a tiny random-weight Qwen3 built from a config, saved with
``save_pretrained`` and loaded back, so the load path is exercised) runs on a fresh machine with
nothing downloaded.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

import samepath

#: ``--dtype`` names and the torch dtypes they select (the canonical names; see :data:`DTYPE_ALIASES`).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: The usual spellings of each dtype, accepted wherever a dtype is asked for (``--dtype``,
#: ``--precision``), case-insensitive, with or without a ``torch.`` prefix.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
}

#: The embedded default model's shape: small enough for Triton's interpreter on a CPU.
DEFAULT_MODEL_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


class CheckInputError(ValueError):
    """Bad input to ``samepath check`` / ``doctor``: reported as one line, exit status 2."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise CheckInputError(
            "samepath check and doctor need Hugging Face transformers: from a samepath checkout, "
            'pip install -e ".[hf]" (or pip install "transformers>=5.19,<6")'
        ) from None
    return transformers


def canonical_dtype_name(name: str) -> str | None:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for any usual spelling of it (``bf16``,
    ``torch.bfloat16``, ``half``, ``fp32``, ...); ``None`` for anything else."""
    key = str(name).strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(key)


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    canonical = canonical_dtype_name(name)
    if canonical is None:
        raise CheckInputError(
            f"unsupported dtype {name!r} for {flag}; choose float32 (fp32), bfloat16 (bf16) or float16 (fp16, half)"
        )
    return DTYPES[canonical]


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: str  #: the directory, or "embedded-default"
    model_type: str
    dtype: torch.dtype

    def describe(self) -> str:
        cfg = self.model.config
        shape = f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"
        where = "embedded default, random weights" if self.source == "embedded-default" else self.source
        return f"{self.model_type} ({where}; {shape}), {DTYPES_BY_TORCH[self.dtype]}"


DTYPES_BY_TORCH = {v: k for k, v in DTYPES.items()}


def build_default_model(directory: str, seed: int = 0, tie_word_embeddings: bool = False) -> None:
    """Write the embedded default model (random-weight Qwen3, fp32) to ``directory`` (with
    ``tie_word_embeddings``, its lm_head is the embedding matrix)."""
    transformers = _transformers()
    config = transformers.Qwen3Config(**{**DEFAULT_MODEL_CONFIG, "tie_word_embeddings": tie_word_embeddings})
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # random init of this size gives near-uniform logits; spread them out
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    model.save_pretrained(directory)


def load_model(directory: str, dtype: torch.dtype) -> LoadedModel:
    """``AutoModelForCausalLM.from_pretrained(directory)`` in ``dtype``, after checking that the
    directory holds a decoder-only causal LM of a model type samepath patches."""
    transformers = _transformers()
    config = check_model_config(directory)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise CheckInputError(f"cannot load the model in {directory!r}: {_one_line(exc)}") from None
    return LoadedModel(model.eval(), directory, config.model_type, dtype)


def check_model_config(directory: str):
    """The gate every command runs on ``--model DIR`` before any weights load: a decoder-only causal
    LM of a model type samepath patches, with formulas and an attention head size samepath
    implements. Returns the config; raises :class:`CheckInputError` with the reason."""
    transformers = _transformers()
    from samepath.integrations import hf
    from samepath.models.formulas import UnsupportedModelError, model_formulas, unsupported_reason

    check_model_dir(directory)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # malformed or unknown config
        raise CheckInputError(f"cannot read the model config in {directory!r}: {_one_line(exc)}") from None
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise CheckInputError(f"{directory!r} holds a {model_type!r} encoder-decoder model, not a decoder-only LM")
    if model_type not in hf.MODEL_TYPES:
        raise CheckInputError(
            f"{directory!r} holds a {model_type!r} model, a type samepath does not patch: "
            f"{unsupported_reason(model_type)}"
        )
    try:  # the refusals patch_all(model) and the vLLM plugin would raise, before any weights load
        model_formulas(config)
    except UnsupportedModelError as exc:
        raise CheckInputError(f"{directory!r} holds a model samepath refuses: {exc}") from None
    check_model_head_size(config)
    return config


def check_model_dir(directory: str) -> None:
    """``--model``: an existing local directory with a ``config.json`` (a Hub id is named as one)."""
    if not os.path.isdir(directory):
        raise CheckInputError(_missing_model_dir(directory))
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise CheckInputError(f"{directory!r} has no config.json: not a Hugging Face model directory")


def _missing_model_dir(directory: str) -> str:
    """What to say about a ``--model`` that is not a directory: a Hub id (``Qwen/Qwen3-0.6B``) is
    not downloaded; say how to pass a local copy."""
    looks_like_hub_id = (
        not os.path.isabs(directory)
        and directory.count("/") == 1
        and all(part and not part.startswith(".") for part in directory.split("/"))
    )
    if looks_like_hub_id:
        return (
            f"--model {directory!r} is not a local directory; samepath does not download Hub ids. Download it first "
            f"(huggingface-cli download {directory} --local-dir DIR, or save_pretrained(DIR)) and pass --model DIR"
        )
    return f"model directory {directory!r} does not exist (--model takes a local Hugging Face model directory)"


def check_model_head_size(config) -> None:
    """A model whose attention head size samepath's kernels do not take is bad input, found from
    its config before any weights load."""
    from samepath.kernels.config import check_head_size

    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        check_head_size(head_size, "head size")
    except ValueError as exc:
        raise CheckInputError(f"the model's attention {exc}") from None


def load_default_model(dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """Build the embedded default into a temporary directory and load it from there."""
    with tempfile.TemporaryDirectory(prefix="samepath-check-") as directory:
        build_default_model(directory, seed)
        loaded = load_model(directory, dtype)
    loaded.source = "embedded-default"
    return loaded


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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


def random_prompts(batch: int, vocab_size: int, seed: int, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    """``batch`` prompts of different lengths (so the rollout batch is left-padded), tokens >= 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def pad_token_id(model: torch.nn.Module) -> int:
    for source in (model.config, getattr(model, "generation_config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


def rollout_hf(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    seed: int,
    on_step: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded Hugging Face ``generate`` (KV cache; sampled, or greedy when ``temperature``
    is 0): the generated tokens ``[B, new_tokens]`` and their log-probs from the raw step logits."""
    transformers = _transformers()
    pad = pad_token_id(model)
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    criteria = transformers.StoppingCriteriaList()
    if on_step is not None:
        criteria.append(_StepCallback(on_step))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            repetition_penalty=1.0,
            stopping_criteria=criteria,
            **sampling,
        )
    generated = out.sequences[:, width:]
    step_logits = torch.stack(out.logits, 1)
    return generated.cpu(), samepath.logprobs(step_logits, generated, temperature or 1.0).cpu()


class _StepCallback:
    """A stopping criterion that never stops: generate calls it once per new token."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.callback()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def trainer_forward(
    model: torch.nn.Module,
    prompts: list[list[int]],
    generated: torch.Tensor,
    temperature: float,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """The trainer's log-probs of the generated tokens: one right-padded forward of prompt +
    completion (positions from 0 in every row), no cache. ``[B, new_tokens]``. With ``fused``,
    through the fused lm_head + log-probs (:func:`samepath.integrations.hf.causal_lm_logprobs`, no
    ``[tokens, vocab]`` logits; needs the patched model) instead of the model's logits."""
    pad = pad_token_id(model)
    device = next(model.parameters()).device
    seqs = [torch.tensor(p + g.tolist()) for p, g in zip(prompts, generated, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    n = generated.shape[1]
    if fused:
        from samepath.integrations.hf import causal_lm_logprobs

        with torch.no_grad():
            lp = causal_lm_logprobs(model, ids.to(device), attention_mask=mask.to(device), temperature=temperature)
        return torch.stack([lp[row, len(prompt) - 1 : len(prompt) - 1 + n] for row, prompt in enumerate(prompts)]).cpu()
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    rows = []
    for row, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        start = len(prompt) - 1
        rows.append(samepath.logprobs(logits[row, start : start + n], seq[len(prompt) :].to(device), temperature))
    return torch.stack(rows).cpu()


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
        expect_fingerprint=samepath.fingerprint(model_config=model_config) if with_samepath else None,
        max_model_len=max(map(len, prompts)) + new_tokens,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=max(64, len(prompts)),  # vLLM needs at least one token per sequence
    )
    try:
        result = run_vllm_rollout(spec)
    except RuntimeError as exc:
        raise CheckInputError(f"the vLLM rollout failed: {_one_line(exc)} (see the log above)") from exc
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
        rollout_fp = samepath.fingerprint()
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
    return SideBySide(numerics, prompts, generated, rollout_lp, trainer_lp, rollout_fp, samepath.fingerprint())


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

    transformers = _transformers()
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
