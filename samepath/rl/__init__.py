"""True on-policy RL with samepath: a small GRPO loop (:mod:`samepath.rl.grpo`) whose rollout and
trainer log-probs are bit-identical at every step, with pluggable rollout engines (Hugging Face
``generate``; vLLM in its own worker processes with the weights pushed through its RPC,
:mod:`samepath.rl.vllm_workers`; vLLM in-process, :mod:`samepath.rl.vllm_engine`)."""

from samepath.rl.grpo import (
    AUTOCAST_REFUSAL,
    PRECISIONS,
    CopyTask,
    HFRollout,
    RolloutEngine,
    StepMetrics,
    Trainer,
    all_equal,
    check_pairing,
    clipped_pg_loss,
    completion_mask,
    group_advantages,
    numerics,
    request_seed,
    request_seeds,
    run_grpo,
    step_metrics,
)

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
