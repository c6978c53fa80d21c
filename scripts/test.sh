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
# Two pytest workers (DDTREE_TEST_WORKERS; 0 runs in this process): the engine
# tests run their engines on one OpenMP thread, so two of them share a 2-core
# machine well. A test file stays on one worker, keeping its module-scoped
# engines shared; the engine files go out first (the order tests/conftest.py
# sets, not xdist's by-count reorder).
WORKERS="${DDTREE_TEST_WORKERS:-2}"
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q -rfEs --durations=15 "${XDIST[@]}" "$@"
