#!/usr/bin/env bash
# GRPO with verl, samepath on the FSDP trainer and in vLLM's processes: rollout and trainer
# log-probs bit-identical (verl logs training/rollout_probs_diff_* = 0 and rollout_corr/k3_kl = 0).
#
#   MODEL=/path/to/Qwen3-0.6B TRAIN=~/data/gsm8k/train.parquet VAL=~/data/gsm8k/test.parquet \
#     bash recipes/verl_grpo_samepath/run_grpo_samepath.sh [more Hydra overrides]
#
# Needs verl 0.9.1, vLLM (or vllm-ascend) and samepath installed with its vllm.general_plugins entry
# point (pip install -e .) in the environment every Ray worker runs; see README.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
: "${MODEL:?set MODEL to a local Hugging Face model directory}"
: "${TRAIN:?set TRAIN to a verl parquet training file}"
VAL="${VAL:-$TRAIN}"
GPUS="${GPUS:-1}"
# The trainer's numerics fingerprint; the vLLM plugin refuses any other table.
SAMEPATH_FINGERPRINT="$("$python" -c 'import samepath; print(samepath.fingerprint())')"
export SAMEPATH_FINGERPRINT
overrides=()
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  overrides+=("${line//'${SAMEPATH_FINGERPRINT}'/$SAMEPATH_FINGERPRINT}")
done < "$here/overrides.txt"
exec "$python" -m verl.trainer.main_ppo \
  "${overrides[@]}" \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.train_batch_size="${BATCH:-8}" data.max_prompt_length=512 data.max_response_length=512 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.ppo_mini_batch_size="${BATCH:-8}" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 \
  trainer.total_training_steps="${STEPS:-5}" trainer.val_before_train=False \
  trainer.project_name=samepath trainer.experiment_name=verl_grpo_samepath \
  "$@"
