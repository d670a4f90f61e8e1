#!/usr/bin/env bash
# One lease on an Ascend NPU machine (torch_npu, Triton-Ascend, CANN already installed; prepared
# like bench/gpu_check.sh for a machine without network): bitwise checks on the NPU first, then
# the bench (--quick), then the tuning sweep. Each stage has a time budget (its timeout) and writes
# its results into $OUT the moment it ends; the whole run stays within 8 minutes. No
# CPU-interpreter tests run here.
#
#   bash bench/npu_check.sh --dry-run                 # list stages and budgets; check every Python entry; run
#                                                     # the formula checks on the CPU and list the device steps skipped
#   OUT=/some/dir bash bench/npu_check.sh             # the real run (default OUT bench/results/npu-<time>)
#   STAGES="setup bitwise" bash bench/npu_check.sh    # a subset; BENCH_ARGS / TUNE_ARGS / BITWISE_ARGS add arguments
#   STAGES="setup ascendc" ASCENDC_BUDGET=400 bash bench/npu_check.sh   # a first Ascend C build can take minutes
#   ASCENDC_BENCH_ARGS="--passes decode" adds arguments to the Ascend C attention bench
#
# Never installs torch, torch_npu or triton: samepath goes in with `pip install --no-deps
# --no-build-isolation -e .` (PYTHONPATH if that fails); optional wheels come in a carried .whl/
# folder, installed with --no-index --no-deps into /tmp/site. The CUDA-only baselines (FlashInfer,
# Liger, vLLM's Triton attention, SDPA's flash / cuDNN / efficient kernels) are listed by the bench
# as not applicable, with the reason.
#
# Files in $OUT: check.log, stages.tsv (stage, exit, seconds, budget), bitwise.json (rewritten after
# every check group), ascendc_bitwise.json and ascendc_attention.json (the ascendc stage), formula.json (the
# formula stage: exp2 / log2 identities, fully masked tiles, Ascend C == Triton-Ascend per caller), the bench's
# .csv / .txt (rewritten after every case) and .png, tuned-npu.json, vllm_ascend.json (setup: the
# installed vllm-ascend through samepath's gate). Exit status: non-zero if a stage failed.

DEVICE=npu
KIND=Ascend
STAGE_ORDER=(setup ascendc formula bitwise bench tune)
declare -A BUDGET=([setup]=45 [ascendc]=${ASCENDC_BUDGET:-120} [formula]=60 [bitwise]=140 [bench]=75 [tune]=40)
declare -A ABOUT=(
  [setup]="npu-smi and versions (torch_npu, Triton-Ascend, CANN) into the log; wheels; samepath --no-deps; the vllm-ascend gate (vllm_ascend.json)"
  [ascendc]="samepath.ascendc_fallback build; on it: attention + backward bitwise checks; forward / decode / backward bench vs torch_npu and flash-attention-npu"
  [formula]="bench/npu_formula.py: exp2 / log2 identities compiled; a fully masked tile leaves (m, l, acc) unchanged; Ascend C == Triton-Ascend on every attention caller"
  [bitwise]="bench/gpu_bitwise.py --device npu: training == prefill == chunked == decode, backward, split-K, logprobs, HF"
  [bench]="python -m bench --device npu --quick: min/median/max vs stock torch_npu ops, e2e, host time per layer"
  [tune]="bench/tune.py --device npu: numerics-neutral launch parameters, bf16, head 128"
)
TOTAL_BUDGET=480
# shellcheck source=bench/device_check_lib.sh
source "$(dirname "$0")/device_check_lib.sh"

stage_setup() {
  install_wheels
  install_samepath
  {
    npu-smi info || true
    cat /usr/local/Ascend/ascend-toolkit/latest/version.cfg 2>/dev/null || true
    timeout "$LIMIT" $PY - <<'PY'
import importlib, torch, torch_npu, triton, samepath
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "torch_npu", torch_npu.__version__,
      "triton", triton.__version__)
print("device", torch.npu.get_device_name(0), "count", torch.npu.device_count())
for name in ("transformers", "vllm", "vllm_ascend"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__)
print("samepath", samepath.__file__, "fingerprint", samepath.fingerprint())
PY
    # vllm-ascend (if installed): samepath's gate and feature detection on the real modules, and
    # the installed source against tests/fixtures/vllm_ascend_api.json; a refusal is logged, not fatal.
    timeout 20 $PY -m bench.vllm_ascend_api --installed --out "$OUT/vllm_ascend.json" || true
  } 2>&1 | tee -a "$LOG"
}

stage_ascendc() {
  # Builds the Ascend C attention once into its keyed cache (the build that workers must not run), then,
  # loading without a build, on that backend: the attention bitwise checks (training == prefill == chunked
  # == decode rows) and the backward's (gradients run == run and with the batch reversed, the one-pass
  # Ascend C backward), then the bench of the training forward, the paged decode and the backward against
  # the Triton-Ascend kernels, torch_npu (npu_fusion_attention, npu_fused_infer_attention_score,
  # npu_fusion_attention_grad) and flash-attention-npu's decode (each timed call's outputs bitwise the same).
  local t0=$(date +%s)
  timeout "$LIMIT" $PY -m samepath.ascendc_fallback build 2>&1 | tee -a "$LOG" || return $?
  local left=$(( LIMIT - ($(date +%s) - t0) ))
  (( left > 5 )) || return 124
  local status=0
  SAMEPATH_ATTENTION_BACKEND=ascendc SAMEPATH_ASCENDC_ALLOW_BUILD=0 timeout "$left" \
    $PY bench/gpu_bitwise.py --device npu --checks attention,attention_backward \
    --out "$OUT/ascendc_bitwise.json" 2>&1 | tee -a "$LOG" || status=$?
  left=$(( LIMIT - ($(date +%s) - t0) ))
  (( left > 5 )) || return 124
  SAMEPATH_ASCENDC_ALLOW_BUILD=0 timeout "$left" $PY bench/ascendc_attention.py --device npu \
    --out "$OUT/ascendc_attention.json" ${ASCENDC_BENCH_ARGS:-} 2>&1 | tee -a "$LOG" || status=$?
  return $status
}

stage_formula() {
  # Needs the library the ascendc stage built (never builds it: its Ascend C steps fail alone without it).
  SAMEPATH_ASCENDC_ALLOW_BUILD=0 timeout "$LIMIT" $PY bench/npu_formula.py --device npu --out "$OUT/formula.json" \
    2>&1 | tee -a "$LOG"
}

stage_bitwise() {
  timeout "$LIMIT" $PY bench/gpu_bitwise.py --device npu --out "$OUT/bitwise.json" ${BITWISE_ARGS:-} 2>&1 | tee -a "$LOG"
}

stage_bench() {
  timeout "$LIMIT" $PY -m bench --device npu --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
}

stage_tune() {
  timeout "$LIMIT" $PY bench/tune.py --device npu --dtypes bfloat16 --head-sizes 128 ${TUNE_ARGS:-} \
    --out "$OUT/tuned-npu.json" 2>&1 | tee -a "$LOG"
}

skipped() { echo "       skipped (needs the NPU): $*"; }
dry_setup() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  echo "  ok   setup: would install ${#wheels[@]} carried wheel(s) and samepath --no-deps; never torch / torch_npu"
  dry_entry "setup: bench/vllm_ascend_api.py --installed" $PY -m bench.vllm_ascend_api --installed \
    --out "$OUT/vllm_ascend.json" --dry-run
  skipped "setup: npu-smi, torch_npu / Triton-Ascend / CANN versions, the gate on the installed vllm-ascend"
}
dry_ascendc() {
  dry_entry "ascendc: python -m samepath.ascendc_fallback" $PY -m samepath.ascendc_fallback --help
  dry_entry "ascendc: bench/gpu_bitwise.py attention,attention_backward" $PY bench/gpu_bitwise.py --device npu \
    --checks attention,attention_backward --out "$OUT/ascendc_bitwise.json" --dry-run
  dry_entry "ascendc: bench/ascendc_attention.py" $PY bench/ascendc_attention.py --device npu \
    --out "$OUT/ascendc_attention.json" ${ASCENDC_BENCH_ARGS:-} --dry-run
  skipped "ascendc: the CMake build with CANN, its bitwise checks and bench (replays: tests/test_ascendc_fallback.py)"
}
dry_formula() {
  # Runs every formula check on the CPU (Triton interpreter; the Ascend C kernel's replay) and lists the
  # device steps it could not take.
  local log=/tmp/samepath-formula-dry.$$
  if $PY bench/npu_formula.py --dry-run --out "$OUT/formula.json" >"$log" 2>&1; then
    echo "  ok   formula: bench/npu_formula.py --dry-run ran on the CPU: $(grep -c '^  ok ' "$log") checks passed"
  else
    echo "  FAIL formula: bench/npu_formula.py --dry-run"
    sed 's/^/       /' "$log"
    status=1
  fi
  grep '^  skipped' "$log" | sed 's/^  /       /'
  rm -f "$log"
}
dry_bitwise() {
  dry_entry "bitwise: bench/gpu_bitwise.py" $PY bench/gpu_bitwise.py --device npu --out "$OUT/bitwise.json" ${BITWISE_ARGS:-} --dry-run
  skipped "bitwise: every check on compiled Triton-Ascend kernels (the CPU suite proves them under the interpreter)"
}
dry_bench() {
  dry_entry "bench: python -m bench" $PY -m bench --device npu --quick --out "$OUT" ${BENCH_ARGS:-} --dry-run
  skipped "bench: every timing"
}
dry_tune() {
  dry_entry "tune: bench/tune.py" $PY bench/tune.py --device npu --dtypes bfloat16 --head-sizes 128 ${TUNE_ARGS:-} --out "$OUT/tuned-npu.json" --dry-run
  skipped "tune: every timing"
}

main
