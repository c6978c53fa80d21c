#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
# The seam audit first: a one-screen report of every vLLM name the plugin relies on.
.venv/bin/python scripts/seam_audit.py
exec .venv/bin/python -m pytest -q -rfEs --durations=15 "$@"
