"""``samepath doctor``'s two recordings of one batch: the rollout path (a left-padded prefill, then
one token at a time with a KV cache) and the trainer path (one right-padded forward), each
module's inputs and outputs in execution order (:class:`Recorder`), with the op kinds and layer
names the report uses. :mod:`samepath.check.doctor` compares them and re-exports these names.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from samepath.kernels.logprobs import token_logprobs

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")

#: Pseudo-module names for the functions the doctor wraps.
ATTENTION_OP = "<attention>"
ROTARY_OP = "<apply_rotary_pos_emb>"
LOGPROBS_OP = "<token_logprobs>"


# ----------------------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------------------


def op_kind(module: torch.nn.Module) -> str:
    """A short operator class for a module: norm, linear, attention block, rotary, mlp, ..."""
    name = type(module).__name__.lower()
    if "rotary" in name:
        return "rotary"
    if isinstance(module, torch.nn.Embedding) or "embedding" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if isinstance(module, torch.nn.Linear) or "linear" in name:
        return "linear"
    if "experts" in name:
        return "moe experts"
    if "router" in name or "gate" in name:
        return "moe router"
    if "mlp" in name or "moe" in name:
        return "mlp"
    if "attention" in name or name.endswith("attn"):
        return "attention block"
    if "decoderlayer" in name or "block" in name or name.endswith("layer"):
        return "decoder layer"
    if "act" in name or "silu" in name or "gelu" in name:
        return "activation"
    return "module"


#: What a module's own code (not its submodules) computes, by op kind.
OWN_CODE = {
    "decoder layer": "residual add (the layer's own code between its submodules)",
    "attention block": "attention block's own code (reshape, cache update, or an unwrapped attention function)",
    "mlp": "SiLU·mul (the MLP's own code between its projections)",
    "attention": "attention kernel: softmax(QK^T)V (KV tiles, mask, exp, accumulation order)",
    "rotary": "rotary embedding",
    "norm": "RMSNorm / LayerNorm",
    "linear": "matmul (reduction order over K)",
    "logprobs": "log-softmax / token log-prob over the vocabulary",
}


def layer_of(name: str) -> tuple[int | None, str]:
    """``("model.layers.3.self_attn.q_proj")`` -> ``(3, "self_attn.q_proj")``."""
    match = _LAYER_RE.search(name)
    if match is None:
        return None, name
    return int(match.group(1)), name[match.end() :]


# ----------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------


@dataclass
class Record:
    name: str
    phase: str  # "input" | "output"
    op: str
    cls: str
    tensors: list[torch.Tensor]


def _floating(tensors: Iterator) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _flatten(value) -> Iterator:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # includes ModelOutput
        for item in value.values():
            yield from _flatten(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item)


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    for value in args:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return _floating([value])
    for key in ("hidden_states", "x", "input", "query"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return _floating([value])
    return []


class Recorder:
    """Forward hooks on every module of ``model`` (and wrappers on the attention and rotary
    functions); each forward call of the root model adds one list of records to :attr:`calls`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[list[Record]] = []
        self._names = {id(m): name for name, m in model.named_modules()}
        self._stack: list[str] = []
        self._active = False

    def _skip(self, name: str) -> bool:
        # containers of several decoder layers (the inner model): their output repeats a child's
        if name == "":
            return True
        if layer_of(name)[0] is not None:
            return False
        return any(layer_of(other)[0] is not None and other.startswith(name + ".") for other in self._names.values())

    def add(self, name: str, phase: str, op: str, cls: str, tensors: list[torch.Tensor]) -> None:
        if self._active and tensors:
            self.calls[-1].append(Record(name, phase, op, cls, tensors))

    @contextmanager
    def attached(self) -> Iterator[Recorder]:
        handles = []
        root = self.model

        def root_pre(module, args, kwargs):
            self.calls.append([])
            self._active = True

        def root_post(module, args, kwargs, output):
            self._active = False

        handles.append(root.register_forward_pre_hook(root_pre, with_kwargs=True))
        for name, module in root.named_modules():
            if self._skip(name):
                continue
            op, cls = op_kind(module), type(module).__name__

            def pre(module, args, kwargs, name=name, op=op, cls=cls):
                self._stack.append(name)
                self.add(name, "input", op, cls, _input_tensors(args, kwargs))

            def post(module, args, kwargs, output, name=name, op=op, cls=cls):
                self.add(name, "output", op, cls, _floating(_flatten(output)))
                if self._stack and self._stack[-1] == name:
                    self._stack.pop()

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        handles.append(root.register_forward_hook(root_post, with_kwargs=True))
        restore = self._wrap_functions()
        try:
            yield self
        finally:
            restore()
            for handle in reversed(handles):
                handle.remove()

    def _parent(self) -> str:
        return self._stack[-1] if self._stack else ""

    def _wrap_functions(self) -> Callable[[], None]:
        """Wrap transformers' attention dispatch and each modeling module's apply_rotary_pos_emb."""
        undo: list[Callable[[], None]] = []
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            ALL_ATTENTION_FUNCTIONS = None
        if ALL_ATTENTION_FUNCTIONS is not None:
            interface = ALL_ATTENTION_FUNCTIONS
            original_get = type(interface).get_interface
            had_own = "get_interface" in vars(interface)
            own = vars(interface).get("get_interface")

            def get_interface(attn_implementation, default):
                getter = own if had_own else (lambda i, d: original_get(interface, i, d))
                return self._wrap_attention(getter(attn_implementation, default))

            interface.get_interface = get_interface

            def undo_attention():
                if had_own:
                    interface.get_interface = own
                else:
                    del interface.get_interface

            undo.append(undo_attention)
        modules = {type(m).__module__ for m in self.model.modules()}
        for module_name in sorted(modules):
            modeling = inspect.getmodule(next(m for m in self.model.modules() if type(m).__module__ == module_name))
            original = getattr(modeling, "apply_rotary_pos_emb", None)
            if modeling is None or not callable(original):
                continue

            def rotary(*args, _original=original, **kwargs):
                name = f"{self._parent()}.{ROTARY_OP}".lstrip(".")
                self.add(name, "input", "rotary", "function", _floating(args[:1]))
                out = _original(*args, **kwargs)
                self.add(name, "output", "rotary", "function", _floating(_flatten(out)))
                return out

            modeling.apply_rotary_pos_emb = rotary
            undo.append(
                lambda modeling=modeling, original=original: setattr(modeling, "apply_rotary_pos_emb", original)
            )

        def restore() -> None:
            for fn in reversed(undo):
                fn()

        return restore

    def _wrap_attention(self, fn: Callable) -> Callable:
        def attention(module, query, *args, **kwargs):
            parent = self._names.get(id(module), self._parent())
            name = f"{parent}.{ATTENTION_OP}".lstrip(".")
            self.add(name, "input", "attention", getattr(fn, "__name__", "function"), _floating([query]))
            out = fn(module, query, *args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            self.add(name, "output", "attention", getattr(fn, "__name__", "function"), _floating([first]))
            return out

        return attention


# ----------------------------------------------------------------------------------------------
# The two paths
# ----------------------------------------------------------------------------------------------


@dataclass
class DoctorBatch:
    """The tokens both paths see: what ``samepath check`` compares.

    ``prompts`` of any lengths (the rollout left-pads them, as ``generate`` does); ``completions``
    ``[batch, new_tokens]``, the generated tokens. The rollout prefills the prompts and feeds the
    first ``new_tokens - 1`` completion tokens one decode step at a time; the trainer runs one
    right-padded forward of prompt + completion. Records are compared at every position both
    paths compute: position ``j`` of row ``r`` is token ``j`` of ``prompts[r] + completions[r]``.
    """

    prompts: list[list[int]]
    completions: torch.Tensor
    temperature: float = 1.0
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.completions.dim() != 2 or self.completions.shape[0] != len(self.prompts):
            raise ValueError(
                f"completions must be [batch, new_tokens] with batch = {len(self.prompts)} prompts, "
                f"got shape {tuple(self.completions.shape)}"
            )
        if self.completions.shape[1] < 1 or any(len(p) < 1 for p in self.prompts):
            raise ValueError("every prompt needs at least one token and completions at least one")

    @classmethod
    def from_ids(cls, input_ids: torch.Tensor, prompt_len: int, temperature: float = 1.0) -> DoctorBatch:
        """Equal-length rows: the first ``prompt_len`` tokens of each are its prompt."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, positions], got shape {tuple(input_ids.shape)}")
        if not 1 <= prompt_len < input_ids.shape[1]:
            raise ValueError(
                f"prompt_len must be at least 1 and leave at least one completion token; got {prompt_len} "
                f"of {input_ids.shape[1]} positions"
            )
        return cls([row.tolist() for row in input_ids[:, :prompt_len].cpu()], input_ids[:, prompt_len:], temperature)

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def new_tokens(self) -> int:
        return self.completions.shape[1]

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def width(self) -> int:
        """The rollout's prefill width: the longest prompt."""
        return max(self.prompt_lengths)

    def sequences(self) -> list[torch.Tensor]:
        completions = self.completions.cpu()
        return [torch.tensor(p + completions[r].tolist()) for r, p in enumerate(self.prompts)]

    def compared_positions(self) -> list[tuple[int, int]]:
        """``(row, position)`` of every token whose records both paths compute, row by row."""
        return [(r, j) for r, n in enumerate(self.prompt_lengths) for j in range(n + self.new_tokens - 1)]


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _add_logprobs(recorder: Recorder, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    recorder._active = True
    logprobs = token_logprobs(logits, labels.to(logits.device), temperature)
    recorder.add(LOGPROBS_OP, "output", "logprobs", "samepath.logprobs", [logprobs])
    recorder._active = False


def _next_tokens(sequence: torch.Tensor) -> torch.Tensor:
    """Each position's next token (the last position scores the first token: any fixed label)."""
    return torch.cat([sequence[1:], sequence[:1]])


def record_rollout(model: torch.nn.Module, batch: DoctorBatch) -> Recorder:
    """What ``generate`` computes: a left-padded prefill of the prompts (positions counted from
    each row's first real token, logits of the last position only), then one token at a time with
    the KV cache and the attention mask grown by one column per step."""
    recorder = Recorder(model)
    device = next(model.parameters()).device
    width, lengths = batch.width, batch.prompt_lengths
    ids = torch.full((batch.batch, width), batch.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, prompt in enumerate(batch.prompts):
        ids[r, width - len(prompt) :] = torch.tensor(prompt)
        mask[r, width - len(prompt) :] = 1
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)
    sequences = batch.sequences()
    labels = torch.stack(
        [_next_tokens(seq)[n - 1 : n - 1 + batch.new_tokens] for seq, n in zip(sequences, lengths, strict=True)]
    )
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    cache_kw = _cache_kwarg(model)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    with recorder.attached(), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **keep)
        _add_logprobs(recorder, out.logits[:, -1:], labels[:, :1], batch.temperature)
        for step in range(1, batch.new_tokens):
            mask = torch.cat([mask, mask.new_ones(batch.batch, 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=batch.completions[:, step - 1 : step].to(device),
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_kw: _cache_of(out)},
                **keep,
            )
            _add_logprobs(recorder, out.logits[:, -1:], labels[:, step : step + 1], batch.temperature)
    return recorder


def _cache_of(output) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def record_trainer(model: torch.nn.Module, batch: DoctorBatch) -> Recorder:
    """What ``samepath check``'s trainer computes: one right-padded forward of prompt +
    completion, no cache."""
    recorder = Recorder(model)
    device = next(model.parameters()).device
    sequences = batch.sequences()
    width = max(map(len, sequences))
    ids = torch.full((batch.batch, width), batch.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.zeros_like(ids)
    for r, sequence in enumerate(sequences):
        ids[r, : len(sequence)] = sequence
        mask[r, : len(sequence)] = 1
        labels[r, : len(sequence)] = _next_tokens(sequence)
    with recorder.attached(), torch.no_grad():
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        _add_logprobs(recorder, out.logits, labels, batch.temperature)
    return recorder


__all__ = [
    "ATTENTION_OP",
    "LOGPROBS_OP",
    "OWN_CODE",
    "ROTARY_OP",
    "DoctorBatch",
    "Record",
    "Recorder",
    "layer_of",
    "op_kind",
    "record_rollout",
    "record_trainer",
]
