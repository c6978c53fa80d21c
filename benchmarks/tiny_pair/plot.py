"""Plot the tiny pair's training curves (models/training_log.json -> PNG).

    python -m benchmarks.tiny_pair.plot --log models/training_log.json --out docs/training_curves.png
"""

from __future__ import annotations

import argparse
import json
import math


def smooth(ys, k=25):
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", default="models/training_log.json")
    ap.add_argument("--out", default="docs/training_curves.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.load(open(args.log))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    s, y = zip(*log["target_train"])
    ax.plot(s, smooth(list(y)), label="train (smoothed)")
    s, y = zip(*log["target_val"])
    ax.plot(s, y, "o-", ms=3, label="validation")
    low = min(min(y), min(smooth([v for _, v in log["target_train"]])))
    ax.set(title="target: next-token loss (nats)", xlabel="step",
           ylim=(math.floor(2 * low) / 2 - 0.25, 6))
    ax.legend()
    ax = axes[1]
    s, y = zip(*log["drafter_train"])
    ax.plot(s, smooth(list(y)), label="train (smoothed)")
    s, y = zip(*log["drafter_val"])
    ax.plot(s, y, "o-", ms=3, label="validation")
    ax.set(title="drafter: position-weighted block loss", xlabel="step")
    ax.legend()
    ax = axes[2]
    s = [r[0] for r in log["drafter_val_acc"]]
    ax.plot(s, [r[2] for r in log["drafter_val_acc"]], "o-", ms=3, color="C2")
    ax.set(title="drafter: expected chain tau on validation\n(1 + sum_k prod_{i<=k} acc_i)",
           xlabel="step")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
