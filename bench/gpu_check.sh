#!/usr/bin/env bash
# One lease on a CUDA machine (written for a lent H200: no network, Python 3.12, its own torch /
# triton / transformers): bitwise checks on the device first, then the bench (--quick), then the
# tuning sweep. Each stage has a time budget (its timeout) and writes its results into $OUT the
# moment it ends; the whole run stays within 8 minutes. No CPU-interpreter tests run here.
#
#   bash bench/gpu_check.sh --dry-run                 # list stages and budgets; check every Python entry
#   OUT=/some/dir bash bench/gpu_check.sh             # the real run (default OUT bench/results/cuda-<time>)
#   STAGES="setup bitwise" bash bench/gpu_check.sh    # a subset; BENCH_ARGS / TUNE_ARGS / BITWISE_ARGS add arguments
#
# Never installs torch: samepath goes in with `pip install --no-deps --no-build-isolation -e .`
# (PYTHONPATH if that fails); optional baselines (liger-kernel, flashinfer-python) come as wheels
# in a carried .whl/ folder, installed with --no-index --no-deps into /tmp/site.
#
# Files in $OUT (at most 8 come back from a lent machine): check.log, stages.tsv (stage, exit,
# seconds, budget), bitwise.json (rewritten after every check group), the bench's .csv / .txt
# (rewritten after every case) and .png, tuned-<device>.json. Exit status: non-zero if a stage failed.

DEVICE=cuda
KIND=CUDA
STAGE_ORDER=(setup bitwise bench tune)
declare -A BUDGET=([setup]=45 [bitwise]=210 [bench]=165 [tune]=60)
declare -A ABOUT=(
  [setup]="machine and versions into the log; carried wheels; samepath --no-deps (no torch install)"
  [bitwise]="bench/gpu_bitwise.py: training == prefill == chunked == decode, backward, split-K, logprobs, fused lm_head, HF, vLLM"
  [bench]="python -m bench --quick: min/median/max vs every importable baseline, e2e, host time per layer"
  [tune]="bench/tune.py: numerics-neutral num_warps/num_stages, bf16, head 128"
)
TOTAL_BUDGET=480
# shellcheck source=bench/device_check_lib.sh
source "$(dirname "$0")/device_check_lib.sh"

stage_setup() {
  install_wheels
  install_samepath
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
    timeout "$LIMIT" $PY - <<'PY'
import importlib, torch, triton, samepath
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
      "L2", getattr(torch.cuda.get_device_properties(0), "L2_cache_size", "?"))
for name in ("transformers", "flashinfer", "liger_kernel", "vllm", "flash_attn"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__)
print("samepath", samepath.__file__, "fingerprint", samepath.fingerprint())
PY
  } 2>&1 | tee -a "$LOG"
}

stage_bitwise() {
  timeout "$LIMIT" $PY bench/gpu_bitwise.py --device cuda --out "$OUT/bitwise.json" ${BITWISE_ARGS:-} 2>&1 | tee -a "$LOG"
}

stage_bench() {
  timeout "$LIMIT" $PY -m bench --device cuda --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
}

tuned_name() {
  $PY -c 'import re, torch; print(re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-"))'
}

stage_tune() {
  timeout "$LIMIT" $PY bench/tune.py --device cuda --dtypes bfloat16 --head-sizes 128 ${TUNE_ARGS:-} \
    --out "$OUT/tuned-$(tuned_name).json" 2>&1 | tee -a "$LOG"
}

dry_setup() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  echo "  ok   setup: would install ${#wheels[@]} carried wheel(s) and samepath --no-deps; never torch"
}
dry_bitwise() { dry_entry "bitwise: bench/gpu_bitwise.py" $PY bench/gpu_bitwise.py --device cuda --out "$OUT/bitwise.json" ${BITWISE_ARGS:-} --dry-run; }
dry_bench() { dry_entry "bench: python -m bench" $PY -m bench --device cuda --quick --out "$OUT" ${BENCH_ARGS:-} --dry-run; }
dry_tune() { dry_entry "tune: bench/tune.py" $PY bench/tune.py --device cuda --dtypes bfloat16 --head-sizes 128 ${TUNE_ARGS:-} --out "$OUT/tuned.json" --dry-run; }

main
