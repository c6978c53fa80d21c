"""DDTree's Gated DeltaNet tree path on vLLM's CUDA GDN layer, checked on a CPU.

``patches/gdn_tree_cuda.py`` routes the two speculative kernel calls of
``QwenGatedDeltaNetAttention._forward_core`` (the CUDA build's GDN core)
through the parent-aware Triton kernels during a tree step. The probe
(``tests/gdn_cuda_probe.py``, a fresh interpreter: it must put the real Triton
under vLLM before vLLM's kernel modules load) runs that core with vLLM's own
Triton kernels in Triton's interpreter and compares, for every node of three
branching trees, the tree step's output and state with the stock core run
along the node's root-to-node path. Here: every node matches exactly, the
commit leaves the state and conv window of the accepted path's chain, a plain
decode in the same step is untouched, and the comparison fails when the
parents are dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

PROBE = Path(__file__).with_name("gdn_cuda_probe.py")


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_node_equals_the_stock_core_along_its_path(results):
    for r in results:
        assert r["nodes"] == 20
        assert r["layers_recorded"] == ["model.layers.0.linear_attn"], r
        # the tree kernels replay vLLM's chain arithmetic op for op: exact
        assert r["err_out"] == 0.0 and r["err_state"] == 0.0, r
        assert r["err_commit"] == 0.0, r
        assert r["err_plain"] == 0.0, r


def test_dropped_parents_are_detected(results):
    for r in results:
        assert r["dropped_err_out"] > 1e-2 and r["dropped_err_state"] > 1e-2, r
