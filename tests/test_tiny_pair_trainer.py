"""The tiny-pair trainer runs end to end (at toy scale) and exports exactly the
checkpoint layout of the bundled models."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors import safe_open

from tests.conftest import DRAFTER, ROOT, TARGET


def _keys(path):
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_trainer_smoke(tmp_path):
    out, work = tmp_path / "models", tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.tiny_pair.train", "--out", str(out), "--work",
           str(work), "--threads", "1", "--target-steps", "2", "--target-seq", "32",
           "--target-batch", "2", "--distill-seqs", "128", "--distill-new", "24",
           "--drafter-steps", "2", "--drafter-batch", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("tiny-qwen3", "tiny-qwen3-dflash"):
        bundled = TARGET if name == "tiny-qwen3" else DRAFTER
        assert _keys(out / name / "model.safetensors") == _keys(bundled / "model.safetensors")
        new_cfg = json.loads((out / name / "config.json").read_text())
        old_cfg = json.loads((bundled / "config.json").read_text())
        assert new_cfg["architectures"] == old_cfg["architectures"]
    dcfg = json.loads((out / "tiny-qwen3-dflash" / "config.json").read_text())
    assert dcfg["block_size"] == 16 and dcfg["dflash_config"]["mask_token_id"] == 1
    assert (out / "tiny-qwen3-dflash" / "mask_embedding.pt").exists()
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["target_train"]) == 2 and len(log["drafter_train"]) == 2
