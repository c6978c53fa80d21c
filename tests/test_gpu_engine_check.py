"""``benchmarks/gpu_engine_check.sh --dry-run``: the GPU engine check's plan.

On a machine without a GPU the script starts no engine; it must still build
every step's jobs, find the models, prompts, setup hooks and analysis
helpers, pass every DDTree configuration through the plugin's checks, and
write its results file with every step planned. Without ``--dry-run`` and
without a GPU it must fail, naming why.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_engine_check.sh"


def _run(tmp_path, *args):
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    files = sorted(tmp_path.glob("gpu_engine_check-*.json"))
    return proc, (json.loads(files[-1].read_text()) if files else None)


def test_dry_run_plans_every_step(tmp_path):
    proc, report = _run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["dry_run"] and report["ok"]
    steps = report["steps"]
    assert list(steps) == ["greedy_dense", "greedy_hybrid", "greedy_fp8", "sampling_pit",
                           "guards", "serve"]
    assert all(s["status"] == "planned" for s in steps.values())
    assert steps["greedy_dense"]["configs_checked"] == ["chain", "ddtree_fixed16",
                                                        "ddtree_default"]
    assert steps["greedy_hybrid"]["configs_checked"] == ["ddtree_fixed16", "ddtree_default"]
    assert steps["guards"]["jobs"] == ["backend_refused", "stock_attention_refused",
                                       "stock_attention_unguarded"]


def test_without_a_gpu_it_fails_and_says_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc, report = _run(tmp_path, "--steps", "guards")
    assert proc.returncode == 1
    assert report["error"] == "no CUDA GPU visible to torch" and not report["steps"]
