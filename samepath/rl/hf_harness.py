"""The Hugging Face side of an RL step on one machine, shared by ``samepath.rl`` and ``samepath check``
/ ``doctor`` / ``train-check`` (:mod:`samepath.check.harness` re-exports these names): the embedded
default model (a tiny random-weight Qwen3 built from a config, saved with ``save_pretrained`` and
loaded back, so the load path is exercised), the gate a model directory passes before its weights
load, the rollout (left-padded ``generate``) and the trainer's forward of the finished sequences.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from samepath.kernels.logprobs import token_logprobs

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
    """Bad input to ``samepath check`` / ``doctor`` / ``train-check``: reported as one line, exit status 2."""


def import_transformers():
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
    transformers = import_transformers()
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
    transformers = import_transformers()
    config = check_model_config(directory)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise CheckInputError(f"cannot load the model in {directory!r}: {one_line(exc)}") from None
    return LoadedModel(model.eval(), directory, config.model_type, dtype)


def check_model_config(directory: str):
    """The gate every command runs on ``--model DIR`` before any weights load: a decoder-only causal
    LM of a model type samepath patches, with formulas and an attention head size samepath
    implements. Returns the config; raises :class:`CheckInputError` with the reason."""
    transformers = import_transformers()
    from samepath.integrations import hf
    from samepath.models.formulas import UnsupportedModelError, model_formulas, unsupported_reason

    check_model_dir(directory)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # malformed or unknown config
        raise CheckInputError(f"cannot read the model config in {directory!r}: {one_line(exc)}") from None
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


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
    *,
    seeds: list[int] | None = None,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded Hugging Face ``generate`` (KV cache; sampled, or greedy when ``temperature``
    is 0): the generated tokens ``[B, new_tokens]`` and their log-probs from the raw step logits.

    Sampling draws from ``torch``'s global generator seeded with ``seed``, or with ``seeds`` (one
    per prompt) each row from its own ``torch.Generator`` (:class:`SeededSampler`): a row's tokens
    then depend on its seed and its own logits only, so a request replays bit for bit in any batch.
    With ``eos_token_id`` a row ends at its first EOS (kept); after a row's end the tokens are the
    pad id and the log-probs 0. Without it every row has ``new_tokens`` tokens."""
    transformers = import_transformers()
    pad = pad_token_id(model)
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"seeds must have one entry per prompt ({len(prompts)}), got {len(seeds)}")
    processors = transformers.LogitsProcessorList()
    if temperature > 0 and seeds is not None:
        # Greedy over the processor's one-hot choice: generate adds no sampling of its own.
        processors.append(SeededSampler(seeds, temperature))
        sampling = dict(do_sample=False)
    elif temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        sampling = dict(do_sample=False)
    criteria = transformers.StoppingCriteriaList()
    if on_step is not None:
        criteria.append(_StepCallback(on_step))
    length = dict(min_new_tokens=new_tokens) if eos_token_id is None else dict(eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            repetition_penalty=1.0,
            stopping_criteria=criteria,
            logits_processor=processors,
            **length,
            **sampling,
        )
    generated = out.sequences[:, width:]
    step_logits = torch.stack(out.logits, 1)
    logprobs = token_logprobs(step_logits, generated, temperature or 1.0)
    if eos_token_id is None:
        return generated.cpu(), logprobs.cpu()
    # generate stops once every row has ended: pad to new_tokens; after a row's EOS, pad and 0.
    generated, logprobs = generated.cpu(), logprobs.cpu()
    is_eos = (generated == eos_token_id).long()
    after = (is_eos.cumsum(1) - is_eos) > 0
    tokens = torch.full((len(prompts), new_tokens), pad, dtype=torch.long)
    out_lp = torch.zeros((len(prompts), new_tokens), dtype=torch.float32)
    n = generated.shape[1]
    tokens[:, :n] = generated.masked_fill(after, pad)
    out_lp[:, :n] = logprobs.masked_fill(after, 0.0)
    return tokens, out_lp


class SeededSampler:
    """A logits processor that samples each row from its own ``torch.Generator`` (seeded
    ``seeds[row]``): ``softmax(fp32 logits / temperature)``, one ``torch.multinomial`` draw per row
    and step, and returns scores that are ``-inf`` except at the drawn token, so greedy decoding
    picks it. Finished rows draw too (their tokens are replaced by the pad), so a row's stream of
    draws depends on its seed alone."""

    def __init__(self, seeds: list[int], temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
        self.seeds = [int(s) for s in seeds]
        self.temperature = temperature
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        chosen = torch.stack([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(self.generators)])
        return torch.full_like(scores, -math.inf).scatter_(1, chosen, 0.0)


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
        rows.append(token_logprobs(logits[row, start : start + n], seq[len(prompt) :].to(device), temperature))
    return torch.stack(rows).cpu()


__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "DTYPES",
    "DTYPES_BY_TORCH",
    "DTYPE_ALIASES",
    "CheckInputError",
    "LoadedModel",
    "SeededSampler",
    "build_default_model",
    "canonical_dtype_name",
    "check_model_config",
    "check_model_dir",
    "check_model_head_size",
    "import_transformers",
    "load_default_model",
    "load_model",
    "one_line",
    "pad_token_id",
    "random_prompts",
    "rollout_hf",
    "trainer_forward",
]
