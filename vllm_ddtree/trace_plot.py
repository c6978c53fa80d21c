"""Pictures of DDTree rounds (``vllm-ddtree trace``): one tree per round, and
a summary of acceptance per round. Reads the trace's JSON records only
(matplotlib, no vLLM).

A round's record (see :mod:`vllm_ddtree.trace`) has ``nodes``: the drafter's
tree in flat order, each with ``parent`` (0 = the root), ``depth``,
``token``, ``text``, ``q`` (the drafter's probability of the node's prefix),
``verified`` and ``accepted``; and ``root_text``, ``num_accepted``,
``expected`` and ``bonus_text``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["draw_round", "draw_summary", "layout"]

ACCEPTED, VERIFIED, UNVERIFIED = "#2e7d32", "#1f77b4", "#b0b0b0"


def layout(parents: Sequence[int]) -> tuple[list[float], list[float]]:
    """``(x, y)`` of the root and every node: x is the depth; leaves get
    consecutive rows in depth-first order (children by flat index) and an
    inner node sits at the middle of its children."""
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for j, p in enumerate(parents, start=1):
        kids[p].append(j)
    x = [0.0] * (n + 1)
    y = [0.0] * (n + 1)
    next_row = 0.0

    def place(j: int, depth: int) -> None:
        nonlocal next_row
        x[j] = float(depth)
        if not kids[j]:
            y[j] = next_row
            next_row += 1.0
            return
        for c in kids[j]:
            place(c, depth + 1)
        y[j] = (y[kids[j][0]] + y[kids[j][-1]]) / 2

    place(0, 0)
    return x, y


def _label(text: str, width: int = 10) -> str:
    """A token as a node label: non-printable characters (newlines, tabs,
    control bytes, which the font has no glyph for) as Python escapes."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode()
                    for c in text)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def draw_round(record: dict, path: str, title: str | None = None) -> None:
    """One round's tree as a PNG: the accepted path in green, the other
    verified nodes in blue, nodes the budget left out in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = record["nodes"]
    parents = [nd["parent"] for nd in nodes]
    x, y = layout(parents)
    rows = max(y) + 1 if y else 1
    depth = max(x) + 1 if x else 1
    fig, ax = plt.subplots(figsize=(2.0 + 1.55 * depth, 1.2 + 0.34 * rows))
    color = [ACCEPTED] + [ACCEPTED if nd["accepted"] else VERIFIED if nd["verified"]
                          else UNVERIFIED for nd in nodes]
    for j, p in enumerate(parents, start=1):
        ax.plot([x[p], x[j]], [y[p], y[j]], color=color[j], lw=2.2 if nodes[j - 1]["accepted"]
                else 0.8, ls="-" if nodes[j - 1]["verified"] else ":", zorder=1)
    labels = [_label(record.get("root_text") or "root")] + [
        f"{_label(nd['text'])}\n" + ("" if nd["q"] is None else f"{nd['q']:.2f}")
        for nd in nodes]
    for j, lab in enumerate(labels):
        ax.text(x[j], y[j], lab, ha="center", va="center", fontsize=6.5, family="monospace",
                zorder=2, bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=color[j],
                                    lw=1.6 if j == 0 or nodes[j - 1]["accepted"] else 0.8))
    ax.set_xlim(-0.6, depth - 0.4)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xticks(range(int(depth)))
    ax.set_xlabel("depth")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    verified = sum(nd["verified"] for nd in nodes)
    ax.set_title(title or (
        f"round {record['round']}: {verified} nodes verified, {record['num_accepted']} "
        f"accepted (drafter expected {record['expected']:.2f}), bonus "
        f"'{_label(record.get('bonus_text', ''))}'"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def draw_summary(records: list[dict], path: str) -> None:
    """Acceptance length per round, and the drafter's expected accepted
    nodes against the realised ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in records]
    acc = [r["num_accepted"] + 1 for r in records]
    exp = [r["expected"] for r in records]
    real = [r["num_accepted"] for r in records]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.bar(rounds, acc, color=ACCEPTED, width=0.8)
    if acc:
        mean = sum(acc) / len(acc)
        a.axhline(mean, color="k", lw=1, ls="--", label=f"mean {mean:.2f}")
        a.legend(loc="upper right", fontsize=8)
    a.set_xlabel("round")
    a.set_ylabel("tokens per round (accepted + bonus)")
    a.set_title("acceptance length per round", fontsize=10)
    b.scatter(exp, real, s=18, color=VERIFIED, alpha=0.7)
    top = max(exp + real + [1.0]) + 0.5
    b.plot([0, top], [0, top], color="k", lw=1, ls="--", label="realised = expected")
    b.set_xlim(0, top)
    b.set_ylim(-0.3, top)
    b.set_xlabel("drafter's expected accepted nodes (sum of q over verified nodes)")
    b.set_ylabel("accepted nodes")
    b.set_title("expected vs realised acceptance", fontsize=10)
    b.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
