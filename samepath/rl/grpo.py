"""A small GRPO loop whose rollout and trainer log-probs are bit-identical at every step.

Read it top to bottom; it is meant to be copied. One step:

1. the rollout engine samples ``group_size`` completions per prompt with the weights it was last
   sent (:class:`HFRollout`: Hugging Face ``generate``; :class:`samepath.rl.vllm_engine.VLLMRollout`:
   vLLM in-process) and reports their log-probs;
2. a rule-based reward scores each completion (:class:`CopyTask`), and advantages are normalised
   within each prompt's group (:func:`group_advantages`);
3. the trainer recomputes the completions' log-probs with gradients, forms the importance ratio
   ``exp(trainer_logp - rollout_logp)`` and the clipped policy-gradient loss
   (:func:`clipped_pg_loss`), clips the gradient norm and takes an optimizer step;
4. the new weights go to the rollout engine — the bf16 cast of the trainer's weights that its
   next forward will compute with (:meth:`Trainer.rollout_state_dict`).

With ``samepath.integrations.patch_all()`` (and samepath's vLLM plugin for a vLLM rollout) the
ratio is exactly 1.0 for every token of every step: :func:`step_metrics` reports it, with the
mismatch metrics RL frameworks log (max / mean ``|Δlogp|``, ratio min / max, k3 KL, verl's
``rollout_probs_diff_max / mean / std``), all from samepath's own log-probs.

Completions of real lengths: with ``eos_token_id``, a completion ends at its first EOS (kept, and
trained on) or at ``new_tokens`` (capped); both kinds mix in one batch. The rollout engines return
``[B, new_tokens]`` tokens with the pad id and log-prob 0 after a completion's end
(:func:`completion_mask`); the trainer's forward sees each prompt + its own completion only and
its log-probs after the end are 0 with no gradient; the loss and every metric count the
completions' tokens only.

Reproducible rollouts: every request is sampled with its own seed, :func:`request_seed` (``base +
index * 1000003 + sample * 1009 + step * 9176``): prompt ``index``, sample ``sample`` within its
group, RL ``step``. The same seeds give the same completions, bit for bit, whatever else is in the
batch (samepath's log-probs do not depend on the batch): vLLM through ``SamplingParams(seed=...)``,
``generate`` through a logits processor drawing each row from its own ``torch.Generator``
(:func:`samepath.rl.hf_harness.rollout_hf`).

Trainer precisions (see docs/numerics.md, "Training loop cast points"):

- ``"bf16"``: bf16 parameters, optimizer on them. The rollout serves the same tensors.
- ``"fp32_master"``: fp32 master parameters; the forward computes with their bf16 cast
  (``torch.func.functional_call`` over ``p.to(bf16)``, what FSDP's ``MixedPrecision(param_dtype=
  bf16)`` and Megatron do), inside ``torch.autocast(bf16)``, which is then a no-op for every matmul.
  Gradients reach the fp32 masters through the cast; the rollout serves the same bf16 cast.

Plain ``torch.autocast(bf16)`` over fp32 modules is refused (:data:`AUTOCAST_REFUSAL`): autocast
casts the inputs of each matmul (every linear, the lm_head) to bf16 per op, but the embedding
output, RMSNorm, the residual stream and rotary stay fp32, and a norm whose input is a bf16 matmul
output meets an fp32 weight (Qwen3's ``q_norm`` / ``k_norm``; Hugging Face promotes to fp32) —
nothing a bf16-weight rollout engine computes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from samepath.kernels.logprobs import token_logprobs

#: The trainer precisions :class:`Trainer` implements.
PRECISIONS = ("bf16", "fp32_master")

#: Why ``Trainer(precision="autocast")`` is refused.
AUTOCAST_REFUSAL = (
    "precision='autocast' (torch.autocast(bf16) over fp32 modules) cannot equal a rollout on bf16 weights: autocast "
    "casts only each matmul's inputs to bf16, while the embedding output, RMSNorm, the residual adds and rotary run "
    "in fp32, and a norm fed by a bf16 matmul output meets an fp32 weight (Qwen3's q_norm / k_norm). Use "
    "precision='fp32_master': fp32 master weights, the forward (under autocast if you like) on their bf16 cast, "
    "which is also what the rollout is sent"
)


# ----------------------------------------------------------------------------------------------
# Task: prompts and a rule-based reward
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyTask:
    """Copy the prompt: ``num_prompts`` prompts of random token ids (lengths ``min_len`` to
    ``max_len``, ids from 1), the same every step. A completion's reward is ``1 - mean_i |c_i -
    p_(i mod L)| / (vocab_size - 1)``: how close each token id is to the prompt's token at the same
    offset (cycling through the prompt). Dense and continuous, so a group's samples almost never
    tie and every group has an advantage signal."""

    vocab_size: int
    num_prompts: int = 2
    min_len: int = 3
    max_len: int = 7
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")

    def prompts(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.min_len, self.max_len + 1, (self.num_prompts,), generator=gen).tolist()
        return [torch.randint(1, self.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        if not completion:
            return 0.0
        distance = sum(abs(token - prompt[i % len(prompt)]) for i, token in enumerate(completion))
        return 1.0 - distance / (len(completion) * (self.vocab_size - 1))


def request_seed(base: int, index: int, sample: int, step: int) -> int:
    """The seed of one request: prompt ``index``, sample ``sample`` of its group, RL ``step``."""
    return base + index * 1000003 + sample * 1009 + step * 9176


def request_seeds(base: int, num_prompts: int, group_size: int, step: int) -> list[int]:
    """:func:`request_seed` of every request of a step, in the loop's order (each prompt's group
    consecutively)."""
    return [request_seed(base, i, j, step) for i in range(num_prompts) for j in range(group_size)]


def completion_mask(tokens: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """``[B, T]`` bool: the tokens of each completion, up to and including its first
    ``eos_token_id`` (everything when ``eos_token_id`` is None)."""
    if eos_token_id is None:
        return torch.ones(tokens.shape, dtype=torch.bool)
    is_eos = (tokens == eos_token_id).long()
    return (is_eos.cumsum(1) - is_eos) == 0


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation
    (population, plus ``eps``). ``rewards`` ``[num_prompts * group_size]``, grouped consecutively."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    groups = rewards.double().view(-1, group_size)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True, correction=0)
    return ((groups - mean) / (std + eps)).flatten().float()


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO / GRPO clipped policy-gradient loss, mean over tokens: ``-min(r A, clip(r, 1-ε, 1+ε) A)``
    with ``r = exp(logprobs - old_logprobs)``. ``logprobs`` / ``old_logprobs`` ``[B, T]``
    (``old_logprobs`` are the rollout's: the behaviour policy), ``advantages`` ``[B]``; ``mask``
    ``[B, T]`` (:func:`completion_mask`): the mean over its tokens only."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(ratio.dtype)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.device)
    return per_token.masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


@dataclass
class StepMetrics:
    """One step's rollout-vs-trainer agreement (over every completion token) and training state.

    ``bitwise_equal``: ``torch.equal`` of the two ``[B, T]`` fp32 log-prob tensors. ``ratio_*``:
    ``exp(trainer - rollout)``; ``k3_kl``: the mean of ``exp(d) - 1 - d`` with ``d = trainer -
    rollout`` (an estimate of KL(rollout || trainer) from the rollout's samples);
    ``rollout_probs_diff_*``: verl's ``|exp(rollout) - exp(trainer)|``. All computed in fp64.
    ``weight_change``: the largest ``|Δw|`` of this step's update over the weights the rollout is
    sent (0 means the update changed nothing the rollout sees). With EOS completions, ``tokens`` and
    every comparison cover the completions' own tokens (:func:`completion_mask`), not the padding.
    """

    step: int
    tokens: int
    bitwise_equal: bool
    equal_tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    ratio_min: float
    ratio_max: float
    k3_kl: float
    rollout_probs_diff_max: float
    rollout_probs_diff_mean: float
    rollout_probs_diff_std: float
    reward_mean: float
    loss: float
    weight_change: float
    #: Completions that ended at EOS / at the length limit (all capped without an EOS id).
    eos_completions: int = 0
    capped_completions: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def step_metrics(
    step: int,
    rollout_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    reward_mean: float = math.nan,
    loss: float = math.nan,
    weight_change: float = math.nan,
    mask: torch.Tensor | None = None,
    eos_completions: int = 0,
) -> StepMetrics:
    """:class:`StepMetrics` of two ``[B, T]`` log-prob tensors (the rollout's and the trainer's),
    over the tokens of ``mask`` (all when None)."""
    if rollout_logprobs.shape != trainer_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs {tuple(rollout_logprobs.shape)} and trainer_logprobs "
            f"{tuple(trainer_logprobs.shape)} differ in shape"
        )
    if mask is not None and mask.shape != rollout_logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and the log-probs {tuple(rollout_logprobs.shape)} differ in shape")
    rollout = rollout_logprobs.detach().cpu()
    trainer = trainer_logprobs.detach().cpu()
    completions = rollout.shape[0] if rollout.dim() == 2 else 1
    if mask is not None:
        mask = mask.cpu()
        rollout, trainer = rollout[mask], trainer[mask]
    d = trainer.double() - rollout.double()
    ratio = torch.exp(d)
    probs_diff = (torch.exp(rollout.double()) - torch.exp(trainer.double())).abs().flatten()
    return StepMetrics(
        step=step,
        tokens=rollout.numel(),
        bitwise_equal=torch.equal(rollout, trainer),
        equal_tokens=int((rollout == trainer).sum()),
        max_abs_diff=float(d.abs().max()),
        mean_abs_diff=float(d.abs().mean()),
        ratio_min=float(ratio.min()),
        ratio_max=float(ratio.max()),
        k3_kl=float((ratio - 1 - d).mean()),
        rollout_probs_diff_max=float(probs_diff.max()),
        rollout_probs_diff_mean=float(probs_diff.mean()),
        rollout_probs_diff_std=float(probs_diff.std()) if probs_diff.numel() > 1 else 0.0,
        reward_mean=reward_mean,
        loss=loss,
        weight_change=weight_change,
        eos_completions=eos_completions,
        capped_completions=completions - eos_completions,
    )


# ----------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------


def _pad_right(prompts: list[list[int]], completions: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


class Trainer:
    """The policy being trained: a Hugging Face causal LM, an AdamW optimizer, and one precision of
    :data:`PRECISIONS` (see the module docstring).

    ``model`` is converted in place: to bf16 for ``"bf16"``, to fp32 otherwise. A completion's
    tokens are those of its ``mask`` (:func:`completion_mask`; all without one).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        precision: str = "fp32_master",
        lr: float = 1e-3,
        clip_eps: float = 0.2,
        max_grad_norm: float = 1.0,
        temperature: float = 1.0,
    ) -> None:
        if precision == "autocast":
            raise ValueError(AUTOCAST_REFUSAL)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the loop samples), got {temperature}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.precision = precision
        self.model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
        self.model.train()
        self.device = next(model.parameters()).device
        self.clip_eps = clip_eps
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        # No weight decay: every weight change comes from the policy gradient.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    #: The dtype of the weights the trainer's forward computes with, hence the rollout's.
    rollout_dtype = torch.bfloat16

    def _autocast(self):
        if self.precision == "bf16":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @torch.no_grad()
    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the rollout engine must serve, Hugging Face names: exactly the tensors the
        trainer's next forward computes with (``"fp32_master"``: each parameter and persistent
        buffer rounded to bf16 by ``Tensor.to``, round-to-nearest-even, as the forward does).
        Tied weights appear under each of their names (``model.embed_tokens.weight`` and
        ``lm_head.weight``), as ``state_dict`` gives them."""
        return {name: t.detach().to(self.rollout_dtype, copy=True) for name, t in self.model.state_dict().items()}

    def _forward_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        with self._autocast():
            if self.precision != "fp32_master":
                return self.model(**kwargs).logits
            # The forward on the bf16 cast of the masters; functional_call ties lm_head to the
            # embedding again (tie_weights=True), so a tied model uses one cast tensor for both.
            cast = {name: p.to(torch.bfloat16) for name, p in self.model.named_parameters()}
            cast |= {name: b.to(torch.bfloat16) for name, b in self.model.named_buffers() if b.is_floating_point()}
            return torch.func.functional_call(self.model, cast, (), kwargs).logits

    def logprobs(
        self, prompts: list[list[int]], completions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-probs ``[B, T]`` (fp32, with gradients) of ``completions`` after ``prompts``: one
        right-padded forward of each prompt + its completion's tokens (``mask``; every token when
        None), positions from 0, no cache; 0 (no gradient) after a completion's end."""
        if mask is None:
            mask = torch.ones(completions.shape, dtype=torch.bool)
        lengths = mask.sum(1).tolist()
        own = [c[:n].tolist() for c, n in zip(completions, lengths, strict=True)]
        pad = int(getattr(self.model.config, "pad_token_id", None) or 0)
        ids, attention = _pad_right(prompts, own, pad)
        logits = self._forward_logits(ids, attention)
        width = completions.shape[1]
        rows = []
        for row, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            labels = torch.tensor(own[row], dtype=torch.long, device=self.device)
            lp = self.token_logprobs(logits[row, len(p) - 1 : len(p) - 1 + n], labels)
            rows.append(torch.nn.functional.pad(lp, (0, width - n)))
        return torch.stack(rows)

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 log-probs of ``labels`` under ``logits`` at the trainer's temperature: samepath's
        (the temperature divided in fp32 inside the kernel, as the rollout does)."""
        return token_logprobs(logits, labels, self.temperature)

    def step(
        self,
        prompts: list[list[int]],
        completions: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float]:
        """One policy-gradient update over the tokens of ``mask`` (all when None); returns the
        trainer's log-probs (before the update, detached, on the CPU) and the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        logprobs = self.logprobs(prompts, completions, mask)
        old = rollout_logprobs.to(logprobs.device)
        loss = clipped_pg_loss(logprobs, old, advantages.to(logprobs.device), self.clip_eps, mask)
        loss.backward()
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return logprobs.detach().cpu(), float(loss.detach())


# ----------------------------------------------------------------------------------------------
# Rollout engines
# ----------------------------------------------------------------------------------------------


class RolloutEngine(Protocol):
    """What the loop needs from a rollout engine."""

    #: The dtype of the weights it computes with.
    weight_dtype: torch.dtype

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Serve ``weights`` (Hugging Face names, :meth:`Trainer.rollout_state_dict`) from now on."""

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        temperature: float,
        seeds: list[int],
        eos_token_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample up to ``new_tokens`` per prompt, request ``i`` with its own seed ``seeds[i]``,
        stopping at ``eos_token_id`` (kept) when given; return the tokens ``[B, new_tokens]`` and
        their log-probs ``[B, new_tokens]`` (fp32, at ``temperature``) on the CPU, after a
        completion's end the pad id and 0."""


class HFRollout:
    """Hugging Face ``generate`` on a separate copy of the model, synchronised by a state-dict copy
    (``load_state_dict``, strict) after every step, the way frameworks feed an HF rollout worker."""

    def __init__(self, model: torch.nn.Module, weight_dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = model.to(weight_dtype).eval()
        self.weight_dtype = weight_dtype

    @classmethod
    def for_trainer(cls, trainer: Trainer) -> HFRollout:
        """A separate rollout model for ``trainer`` (a deep copy, in the dtype it must serve)."""
        return cls(copy.deepcopy(trainer.model), trainer.rollout_dtype)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in weights.items():
            if tensor.dtype != self.weight_dtype:
                raise ValueError(f"weight {name} is {tensor.dtype}; this rollout serves {self.weight_dtype}")
        self.model.load_state_dict(weights, strict=True)

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        temperature: float,
        seeds: list[int],
        eos_token_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from samepath.rl.hf_harness import rollout_hf

        return rollout_hf(self.model, prompts, new_tokens, temperature, seeds=seeds, eos_token_id=eos_token_id)


def check_pairing(trainer: Trainer, rollout: RolloutEngine) -> None:
    """Refuse a rollout that computes with another dtype than the trainer's forward
    (:attr:`Trainer.rollout_dtype`)."""
    if rollout.weight_dtype != trainer.rollout_dtype:
        raise ValueError(
            f"the rollout serves {rollout.weight_dtype} weights but trainer precision {trainer.precision!r} "
            f"computes with {trainer.rollout_dtype}"
        )


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def _max_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max(float((after[k].double() - before[k].double()).abs().max()) for k in before)


def run_grpo(
    trainer: Trainer,
    rollout: RolloutEngine,
    task: CopyTask,
    steps: int,
    group_size: int = 4,
    new_tokens: int = 4,
    seed: int = 0,
    sync_steps: int | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
    eos_token_id: int | None = None,
) -> list[StepMetrics]:
    """Run ``steps`` GRPO steps; return each step's :class:`StepMetrics`.

    The rollout is sent the trainer's weights before the first step and after every update — or,
    with ``sync_steps=k``, after the first ``k`` updates only: from step ``k + 1`` on it keeps old
    weights (the negative control). Sampling at the trainer's temperature, every request with its
    own seed (:func:`request_seeds` of ``seed``); completions end at ``eos_token_id`` (when given) or
    after ``new_tokens`` tokens.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (advantages are normalised within a group), got {group_size}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    if sync_steps is not None and sync_steps < 0:
        raise ValueError(f"sync_steps must be None or >= 0, got {sync_steps}")
    if eos_token_id is not None and not 0 <= eos_token_id < task.vocab_size:
        raise ValueError(f"eos_token_id must be None or a token id below {task.vocab_size}, got {eos_token_id}")
    check_pairing(trainer, rollout)
    task_prompts = task.prompts()
    prompts = [p for p in task_prompts for _ in range(group_size)]
    weights = trainer.rollout_state_dict()
    rollout.load_weights(weights)
    history = []
    for step in range(steps):
        seeds = request_seeds(seed, len(task_prompts), group_size, step)
        completions, rollout_lp = rollout.generate(prompts, new_tokens, trainer.temperature, seeds, eos_token_id)
        mask = completion_mask(completions, eos_token_id)
        rewards = torch.tensor(
            [task.reward(p, c[m].tolist()) for p, c, m in zip(prompts, completions, mask, strict=True)]
        )
        advantages = group_advantages(rewards, group_size)
        trainer_lp, loss = trainer.step(prompts, completions, rollout_lp, advantages, mask)
        new_weights = trainer.rollout_state_dict()
        change = _max_change(weights, new_weights)
        ended = 0 if eos_token_id is None else int((completions == eos_token_id).any(1).sum())
        metrics = step_metrics(step, rollout_lp, trainer_lp, float(rewards.mean()), loss, change, mask, ended)
        weights = new_weights
        if sync_steps is None or step < sync_steps:
            rollout.load_weights(weights)
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
    return history


@contextmanager
def numerics(name: str) -> Iterator[None]:
    """``"samepath"``: the block runs under :func:`samepath.integrations.patch_all`; ``"stock"``:
    without it. Restores the previous state."""
    from samepath import integrations

    if name not in ("stock", "samepath"):
        raise ValueError(f"numerics must be 'stock' or 'samepath', got {name!r}")
    was = integrations.enabled()
    if name == "samepath":
        integrations.patch_all()
    else:
        integrations.unpatch_all()
    try:
        yield
    finally:
        if was:
            integrations.patch_all()
        else:
            integrations.unpatch_all()


def all_equal(history: Iterable[StepMetrics]) -> bool:
    """Whether every step's rollout and trainer log-probs were bit-identical."""
    return all(m.bitwise_equal for m in history)


__all__ = [
    "AUTOCAST_REFUSAL",
    "PRECISIONS",
    "CopyTask",
    "HFRollout",
    "RolloutEngine",
    "StepMetrics",
    "Trainer",
    "all_equal",
    "check_pairing",
    "clipped_pg_loss",
    "completion_mask",
    "group_advantages",
    "numerics",
    "request_seed",
    "request_seeds",
    "run_grpo",
    "step_metrics",
]
