#!/usr/bin/env bash
# Serve the bundled tiny model pair with DDTree speculative decoding on
# 127.0.0.1:$PORT (default 8000). Extra arguments go to `vllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
SPEC_CONFIG="${DDTREE_SPEC_CONFIG:-{\"method\":\"ddtree\"\}}"
set -x
exec vllm serve models/tiny-qwen3 \
  --served-model-name tiny-qwen3 \
  --host 127.0.0.1 --port "${PORT:-8000}" \
  --dtype float32 --max-model-len 2048 \
  --speculative-config "$SPEC_CONFIG" "$@"
