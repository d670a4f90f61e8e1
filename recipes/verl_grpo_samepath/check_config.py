"""Check the recipe's overrides against the installed verl, as far as verl runs without Ray workers.

    python recipes/verl_grpo_samepath/check_config.py [--model DIR] [--train FILE] [key=value ...]

What ``python -m verl.trainer.main_ppo`` does before it starts Ray, without Hydra (which the
project's verl environment does not have): verl's packaged trainer config
(``verl/trainer/config/_generated_ppo_trainer.yaml``, what Hydra composes from ``ppo_trainer.yaml``)
with every line of ``overrides.txt`` applied — a key without ``+`` must already exist there — then
verl's own ``auto_set_device`` and ``validate_config``, and verl's typed configs built from it
(``omega_conf_to_dataclass``: the rollout, the actor and its FSDP engine, the algorithm with its
rollout correction), whose ``__post_init__`` checks the values. Prints the settings samepath relies
on and exits 0; a key verl does not know, or a value it refuses, exits 1 with verl's message.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The settings the recipe relies on, and the values they must resolve to.
EXPECTED = {
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32",
    "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.use_fused_kernels": True,
    "actor_rollout_ref.actor.use_torch_compile": False,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.calculate_log_probs": True,
    "actor_rollout_ref.rollout.logprobs_mode": "processed_logprobs",
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "ray_kwargs.ray_init.runtime_env.env_vars.SAMEPATH_VERL": "1",
    "ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES": "samepath.integrations.verl",
    "ray_kwargs.ray_init.runtime_env.env_vars.SAMEPATH_VLLM": "1",
}


def read_overrides(fingerprint: str) -> list[str]:
    """``overrides.txt`` without comments, ``${SAMEPATH_FINGERPRINT}`` filled in."""
    lines = (HERE / "overrides.txt").read_text().splitlines()
    return [
        line.strip().replace("${SAMEPATH_FINGERPRINT}", fingerprint)
        for line in lines
        if line.strip() and not line.lstrip().startswith("#")
    ]


def compose(overrides: list[str]):
    """verl's packaged trainer config with ``overrides`` applied (Hydra's rules: a key without
    ``+`` must exist)."""
    import verl
    from omegaconf import OmegaConf, open_dict

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    for override in overrides:
        key, _, value = override.partition("=")
        add = key.startswith("+")
        key = key.lstrip("+")
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(config, parent) if parent else config
        if not add and (node is None or leaf not in list(node.keys())):
            raise KeyError(f"verl's trainer config has no key {key!r} (override {override!r})")
        parsed = OmegaConf.from_dotlist([f"{key}={value}"])
        with open_dict(config):
            config = OmegaConf.merge(config, parsed)
    return config


def check(overrides: list[str]) -> dict:
    """Compose, then run verl's own checks; returns the resolved :data:`EXPECTED` settings."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.device import auto_set_device

    config = compose(overrides)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    algorithm = omega_conf_to_dataclass(config.algorithm)
    assert rollout.logprobs_mode == "processed_logprobs" and rollout.calculate_log_probs
    assert actor.strategy == "fsdp2" and algorithm.rollout_correction is not None
    resolved = {key: OmegaConf.select(config, key) for key in EXPECTED}
    wrong = {key: (value, EXPECTED[key]) for key, value in resolved.items() if value != EXPECTED[key]}
    if wrong:
        raise ValueError(f"settings resolved to other values (got, expected): {wrong}")
    return resolved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("MODEL", "/path/to/model"))
    parser.add_argument("--train", default=os.environ.get("TRAIN", "/path/to/train.parquet"))
    parser.add_argument("extra", nargs="*", help="more overrides, key=value")
    args = parser.parse_args(argv)
    import samepath

    overrides = read_overrides(samepath.fingerprint())
    overrides += [f"actor_rollout_ref.model.path={args.model}", f"data.train_files={args.train}"]
    overrides += ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "data.train_batch_size=8"]
    overrides += ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    overrides += ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    overrides += ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", *args.extra]
    try:
        resolved = check(overrides)
    except Exception as exc:  # verl's refusal, reported as one line
        print(f"verl refuses the recipe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for key, value in resolved.items():
        print(f"{key}={value}")
    print("verl accepts the recipe (config composed, validate_config passed, typed configs built)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
