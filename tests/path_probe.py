"""Setup hook (``benchmarks.run_llm``): record what each tree walk accepted.

Runs in the engine's process, so the job must set
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. Every verification step appends one JSON
line to ``$DDTREE_TEST_PATH_LOG``: the number of tree requests, how many of
them accepted a path that leaves the first branch (some accepted node is not
its parent's first child, i.e. not the drafter's most probable continuation),
the accepted nodes, and the grammar check's running counts of tree nodes seen
and dropped (``vllm_ddtree.structured.GrammarTimer``).
"""

from __future__ import annotations

import json
import os

ENV_LOG = "DDTREE_TEST_PATH_LOG"


def off_first_branch(parents: list[int], path: list[int], accepted: int) -> bool:
    """``parents[j - 1]`` is node ``j``'s parent; ``path[0..accepted]`` the
    accepted nodes (root first)."""
    first_child: dict[int, int] = {}
    for j, p in enumerate(parents, start=1):
        first_child.setdefault(p, j)
    return any(path[k + 1] != first_child.get(path[k]) for k in range(accepted))


def record_paths() -> None:
    from vllm_ddtree.core import round as round_mod
    from vllm_ddtree.structured import GrammarTimer

    log = os.environ[ENV_LOG]
    real = round_mod.TreeRound.verify

    def verify(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.any_tree:
            parents, path = self.parents.tolist(), self.path.tolist()
            acc = self.num_accepted.tolist()
            off = sum(off_first_branch(parents[r], path[r], acc[r]) for r in self.tree_rows)
            with open(log, "a") as f:
                f.write(json.dumps({"tree_requests": len(self.tree_rows), "off_branch": off,
                                    "accepted": sum(acc[r] for r in self.tree_rows),
                                    "grammar_seen": GrammarTimer.nodes_seen,
                                    "grammar_pruned": GrammarTimer.nodes_pruned}) + "\n")
        return out

    round_mod.TreeRound.verify = verify


def totals(path) -> dict:
    """Sum of the log's lines."""
    out = {"steps": 0, "tree_requests": 0, "off_branch": 0, "accepted": 0,
           "grammar_seen": 0, "grammar_pruned": 0}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            out["steps"] += 1
            for k in ("tree_requests", "off_branch", "accepted"):
                out[k] += d[k]
            for k in ("grammar_seen", "grammar_pruned"):  # running counts
                out[k] = max(out[k], d.get(k, 0))
    return out


def chain_trees() -> None:
    """Make the drafter's tree a chain of its per-position argmax tokens: the
    drafts stock DFlash proposes, verified through DDTree's tree path."""
    from types import SimpleNamespace

    import torch

    from vllm_ddtree import proposer
    from vllm_ddtree.core.tree import DraftTree

    def chain(logits, budget, budgets=None):
        lp = torch.log_softmax(logits.float(), dim=-1)
        b, depth, _ = lp.shape
        n = min(budget, depth)
        top_lp, top_tok = lp.max(-1)
        cols = torch.arange(budget, device=lp.device)
        valid = (cols < n).expand(b, budget)
        tokens = torch.zeros(b, budget, dtype=torch.long, device=lp.device)
        tokens[:, :n] = top_tok[:, :n]
        logq = torch.full((b, budget), float("-inf"), device=lp.device)
        logq[:, :n] = top_lp[:, :n].cumsum(-1)
        parents = torch.where(valid, cols, 0)
        node_depth = torch.where(valid, cols + 1, 1)
        return DraftTree(tokens, parents, node_depth, logq, valid)

    proposer.cpu_native = SimpleNamespace(load=lambda: None)  # the proposer's tree builder only
    proposer.build_tree = chain
