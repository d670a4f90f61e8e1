#!/usr/bin/env bash
# One shot on a CUDA machine (written for a lent H200): install, tests, bitwise checks on the
# device, the bench and the tuning sweep; everything lands in $OUT (default bench/results/gpu-<time>).
#
#   OUT=/some/dir bash bench/gpu_check.sh
#   STAGES="bitwise bench" bash bench/gpu_check.sh     # a subset (install env tests bitwise bench tune)
#
# At most 8 files are written to $OUT (the lent machine brings back no more): gpu_check.log,
# pytest.log, bitwise.json, the bench's .csv/.txt/.png and tuned-<device>.json. Each stage has a
# timeout so that one hang does not eat the session's device time; the whole run is sized for
# about 8 minutes. Exit status: non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
STAGES=${STAGES:-install env tests bitwise bench tune}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
status=0
want() { [[ " $STAGES " == *" $1 "* ]]; }
stage() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; }
fail() { echo "!!! stage $1 failed (exit $2)" | tee -a "$LOG"; status=1; }

if want install; then
  stage install
  if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; then
    # A fresh machine with a package index: the Linux x86-64 torch wheel on the default index is
    # the CUDA build, so the pinned release installs with its CUDA runtime.
    $PY -m pip install "torch==2.13.0" -e ".[dev]" matplotlib >>"$LOG" 2>&1 || fail install $?
  fi
  # samepath itself, leaving the machine's torch / triton / transformers alone (works offline).
  if ! $PY -m pip install --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
    echo "pip install -e . failed: using PYTHONPATH" | tee -a "$LOG"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
fi

if want env; then
  stage env
  { nvidia-smi || true
    $PY - <<'PY'
import torch, triton, samepath
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import transformers; print("transformers", transformers.__version__)
except ImportError:
    print("transformers not installed")
print("fingerprint", samepath.fingerprint())
PY
  } >>"$LOG" 2>&1 || fail env $?
fi

if want tests; then
  # The suite runs the kernels on CPU tensors (interpreter); with a GPU present the compiled-mode
  # tests (Hopper compile, CUDA config launches) and the bench/tune tests are the relevant part.
  # FULL_TESTS=1 runs everything.
  stage tests
  if [[ "${FULL_TESTS:-0}" == 1 ]]; then
    timeout 480 $PY -m pytest -q -n "${PYTEST_WORKERS:-8}" -p xdist >"$OUT/pytest.log" 2>&1 \
      || timeout 480 $PY -m pytest -q >"$OUT/pytest.log" 2>&1 || fail tests $?
  else
    timeout 240 $PY -m pytest -q -k "cuda or hopper or compile or bench or tune" >"$OUT/pytest.log" 2>&1 || fail tests $?
  fi
  tail -3 "$OUT/pytest.log" | tee -a "$LOG"
fi

if want bitwise; then
  stage bitwise
  timeout 240 $PY bench/gpu_bitwise.py --device cuda --out "$OUT/bitwise.json" 2>&1 | tee -a "$LOG" || fail bitwise $?
fi

if want bench; then
  stage bench
  timeout 300 $PY -m bench --device cuda ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee -a "$LOG" || fail bench $?
fi

if want tune; then
  stage tune
  timeout 240 $PY bench/tune.py --device cuda --dtypes bfloat16 --head-sizes 128 ${TUNE_ARGS:-} \
    --out "$OUT/tuned-$($PY -c 'import re, torch; print(re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-"))').json" \
    2>&1 | tee -a "$LOG" || fail tune $?
fi

stage "done (status $status)"
ls -la "$OUT" | tee -a "$LOG"
exit $status
