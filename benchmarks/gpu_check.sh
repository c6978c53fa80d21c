#!/usr/bin/env bash
# GPU check for the tree-attention kernel (any CUDA machine; sized for < 5 min).
#
#   bash benchmarks/gpu_check.sh
#
# 1. finds or makes a Python environment with CUDA torch + triton (+ vLLM),
# 2. runs the kernel tests natively (no Triton interpreter; fp32/fp16/bf16),
# 3. times our kernel (tree rows and causal rows) against vLLM's
#    unified_attention at the same query count,
# and writes one JSON results file to $OUT (if set) or benchmarks/results/.
#
# Environment:
#   DDTREE_GPU_PYTHON  use this interpreter as is (nothing installed)
#   DDTREE_GPU_VENV    venv to reuse or create (default ~/.cache/vllm-ddtree-gpu-venv)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
START=$(date +%s)
unset TRITON_INTERPRET

RESULTS_DIR="${OUT:-$REPO/benchmarks/results}"
mkdir -p "$RESULTS_DIR"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
RESULT="$RESULTS_DIR/gpu_check-$STAMP.json"
LOG="$(mktemp -t gpu_check_pytest.XXXXXX)"
log() { echo "[gpu_check] $*"; }

has_stack() {  # python has CUDA torch + triton
  "$1" - <<'PY' >/dev/null 2>&1
import torch, triton
assert torch.cuda.is_available()
PY
}
has_pkg() {  # python imports vllm_ddtree.kernels from this checkout
  (cd /tmp && "$1" -c "import vllm_ddtree.kernels, os, sys; \
sys.exit(0 if os.path.realpath(vllm_ddtree.kernels.__path__[0]) == os.path.realpath('$REPO/kernels') else 1)") \
    >/dev/null 2>&1
}

# Without network access pip cannot install; expose the package layout
# (vllm_ddtree.kernels -> kernels/, as pyproject maps it) through a
# PYTHONPATH shim instead.
shim_pythonpath() {
  local root
  root="$(mktemp -d -t ddtree_shim.XXXXXX)"
  mkdir -p "$root/vllm_ddtree"
  for f in "$REPO"/vllm_ddtree/*; do ln -s "$f" "$root/vllm_ddtree/"; done
  ln -s "$REPO/kernels" "$root/vllm_ddtree/kernels"
  ln -s "$REPO/patches" "$root/vllm_ddtree/patches"
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  log "using PYTHONPATH shim $root"
}

PY=""
if [ -n "${DDTREE_GPU_PYTHON:-}" ]; then
  PY="$DDTREE_GPU_PYTHON"
else
  VENV="${DDTREE_GPU_VENV:-$HOME/.cache/vllm-ddtree-gpu-venv}"
  if [ -x "$VENV/bin/python" ] && has_stack "$VENV/bin/python"; then
    log "reusing $VENV"
  else
    SYS_PY="$(command -v python3 || command -v python)"
    log "creating $VENV (system packages visible) from $SYS_PY"
    "$SYS_PY" -m venv --system-site-packages "$VENV"
    if has_stack "$VENV/bin/python"; then
      log "CUDA torch + triton already present; installing the package only"
      "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . \
        || log "pip install -e . failed"
      "$VENV/bin/python" -c "import pytest" 2>/dev/null \
        || "$VENV/bin/python" -m pip install -q pytest || log "pytest install failed"
    else
      log "installing vllm-ddtree[cuda,test] (downloads vLLM + CUDA torch)"
      timeout 240 "$VENV/bin/python" -m pip install -q -e ".[cuda,test]" \
        || log "pip install -e .[cuda,test] failed"
    fi
  fi
  PY="$VENV/bin/python"
fi
if ! has_stack "$PY"; then
  log "no usable CUDA torch + triton in $PY"
  echo "{\"ok\": false, \"error\": \"no CUDA torch + triton in $PY\"}" >"$RESULT"
  log "wrote $RESULT"
  exit 1
fi
has_pkg "$PY" || shim_pythonpath
"$PY" -c "import pytest" 2>/dev/null || log "pytest missing: tests will be reported as failed"

log "kernel tests (native) ..."
timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_tree_attention_utils.py \
  tests/test_tree_attention_kernel.py \
  tests/test_tree_attention_cuda_backend.py >"$LOG" 2>&1
TESTS_RC=$?
tail -n 5 "$LOG"

log "benchmark ..."
timeout 150 "$PY" benchmarks/bench_attention_gpu.py --out "$RESULT" \
  --tests-log "$LOG" --tests-rc "$TESTS_RC"
BENCH_RC=$?
if [ ! -f "$RESULT" ]; then
  "$PY" - "$RESULT" "$LOG" "$TESTS_RC" "$BENCH_RC" <<'PY'
import json, sys
out, log, trc, brc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tail = open(log, errors="replace").read()[-6000:]
json.dump({"ok": False, "kernel_tests": {"rc": trc, "log_tail": tail},
           "error": f"benchmark exited with {brc} before writing results"},
          open(out, "w"), indent=2)
PY
fi
log "done in $(( $(date +%s) - START ))s: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC"
log "results: $RESULT"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
