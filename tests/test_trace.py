"""``vllm-ddtree trace``: the console script on the bundled pair, and the tree layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vllm_ddtree.trace_plot import _label, layout


def test_layout_places_leaves_in_rows_and_parents_between():
    parents = [0, 0, 1, 1, 2]  # root -> 1, 2; 1 -> 3, 4; 2 -> 5
    x, y = layout(parents)
    assert x == [0, 1, 1, 2, 2, 2]
    assert [y[3], y[4], y[5]] == [0, 1, 2]  # leaves, depth-first
    assert y[1] == 0.5 and y[2] == 2 and y[0] == (y[1] + y[2]) / 2


@pytest.mark.engine
def test_labels_spell_out_invisible_characters():
    assert _label("):\n") == "):\\n"
    assert _label("\t\x04x") == "\\t\\x04x"
    assert _label("abcdefghijkl") == "abcdefghi…"
    assert all(c.isprintable() for c in _label("".join(map(chr, range(32)))))


def test_trace_cli_on_the_bundled_pair(tiny_pair, tmp_path):
    target, _ = tiny_pair
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    cli = Path(sys.executable).parent / "vllm-ddtree"
    out = tmp_path / "trace"
    proc = subprocess.run(
        [str(cli), "trace", "--model", target, "--prompt", "def fibonacci(n):\n",
         "--max-tokens", "32", "--dtype", "float32", "--rounds", "1,2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trace = json.loads((out / "trace.json").read_text())
    # The trace agrees with vLLM's own counters for the same run.
    totals, engine = trace["totals"], trace["engine_counters"]
    assert totals["rounds"] == engine["drafts"] > 0
    assert totals["verified_nodes"] == engine["draft_tokens"]
    assert totals["accepted_tokens"] == engine["accepted_tokens"]
    assert sum(r["num_accepted"] + 1 for r in trace["rounds"]) + 1 >= len(
        trace["output_token_ids"])
    for rec in trace["rounds"]:
        nodes = rec["nodes"]
        assert sum(nd["verified"] for nd in nodes) == rec["num_nodes_verified"]
        acc = [nd for nd in nodes if nd["accepted"]]
        assert len(acc) == rec["num_accepted"]
        # the accepted nodes are a path from the root, one per depth
        assert [nd["depth"] for nd in acc] == list(range(1, len(acc) + 1))
        assert all(nd["parent"] == (acc[k - 1]["id"] if k else 0) for k, nd in enumerate(acc))
        assert all(0 < nd["q"] <= 1 for nd in nodes) and rec["root_text"] is not None
    for name in ("round_001.png", "round_002.png", "summary.png"):
        assert (out / name).stat().st_size > 10_000, name
    assert not (out / "round_003.png").exists()
