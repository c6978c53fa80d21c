#!/usr/bin/env bash
# DDTree's whole engine on a CUDA GPU with vLLM installed (sized for < 15 min):
# greedy DDTree against plain decoding on the dense and the hybrid bundled
# pairs under CUDA graphs, the sampling PIT test, the guards, and
# `vllm bench serve` for plain, the chain and DDTree. Writes one JSON results
# file to $OUT (if set) or benchmarks/results/. See docs/gpu_check.md.
#
#   bash benchmarks/gpu_engine_check.sh              # everything
#   bash benchmarks/gpu_engine_check.sh --steps greedy_dense guards
#   bash benchmarks/gpu_engine_check.sh --dry-run    # any machine: the plan, configs checked
#
# Environment: DDTREE_GPU_PYTHON (default: .venv/bin/python, else python3), a
# Python with the CUDA vLLM wheel and vllm-ddtree installed
# (`DDTREE_DEVICE=cuda scripts/setup.sh` makes one).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${DDTREE_GPU_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3)"; fi
fi
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1
exec "$PY" -m benchmarks.gpu_engine_check "$@"
