"""The default's rate tuner on simulated engines.

    python -m benchmarks.tuner_sim --seeds 96

drives ``RateTuner`` (the pure policy of ``vllm_ddtree/core/tuner.py``, no
engine) through simulated decoding: ``c`` requests at once, each on its own
prompt whose text is easy or hard for the drafter, new prompts as requests
finish. A step's time is its arm's (from the trial records of
``bench_default`` runs, ``--trials``), +-5 % jitter, one step in 30 stalled
2.5x by another process, plus 10 ms when a new prompt is prefilled; a
request's tokens per tree step are 1 plus a Poisson draw (capped at 15) whose
mean ``m * (1 - exp(-b / s))`` rises with the budget ``b`` and saturates at
the prompt's ``m``; every budget's count comes from the same uniform draw
(Poisson quantiles), so a step of budget ``b`` also reports, as the runner
does, what each smaller budget would have committed (the tuner's shadow
counts; ``--no-shadow`` leaves them out). Per regime it prints every fixed budget's rate over
plain (8 seeds each) and the default's rate over the best fixed arm or
plain, measured from ``--start`` to ``--horizon`` seconds of engine time
(what the tuner learned before ``--start`` is a benchmark's warm-up), as the
mean over ``--seeds`` seeds with its standard error and the 10th percentile.

Two checkouts compared on the same seeds are a paired test of a policy
change: the seeds draw the same texts and stalls whatever the tuner picks
until the first choice that differs.

A diagnosis of the policy, not a speed verdict: the verdict is
``bench_default`` (real engines, arms interleaved, several rounds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import dataclass

from vllm_ddtree.core.tuner import RateTuner


@dataclass(frozen=True)
class Regime:
    """``step_ms``: one step's milliseconds by budget (0: plain) at ``c``
    requests; ``easy``: a prompt's saturated accepted tokens ``m``, one of
    these, times a lognormal spread of 0.3; ``scale``: the ``s`` above."""

    c: int
    step_ms: dict[int, float]
    easy: tuple[float, ...]
    scale: float
    note: str


REGIMES = {
    # trial records of bench_default: medians of each arm's typical step
    "heavy_c4": Regime(4, {0: 33, 2: 45, 4: 55, 8: 88, 16: 122, 32: 154, 64: 250},
                       (1.2, 3.5), 3.0, "heavy pair, four requests (fixed 2-4 best)"),
    "heavy_c1": Regime(1, {0: 32, 2: 45, 4: 46, 8: 51, 16: 62, 32: 80, 64: 120},
                       (1.2, 3.5), 3.0, "heavy pair, one request (fixed 4-16 close)"),
    "hybrid_c1": Regime(1, {0: 3.0, 2: 10, 4: 10.4, 8: 11.4, 16: 13.1, 32: 16.4, 64: 22},
                        (4.0, 8.0), 9.0, "tiny hybrid, one request (fixed 16 best)"),
    "dense_c4": Regime(4, {0: 3.5, 2: 15, 4: 16, 8: 16.1, 16: 19.2, 32: 24, 64: 35},
                       (1.5, 5.5), 6.0, "tiny dense pair, four requests (plain best)"),
    "dense_c16": Regime(16, {0: 5.4, 2: 38, 4: 40, 8: 41, 16: 42, 32: 50, 64: 70},
                        (1.5, 5.5), 6.0, "tiny dense pair, sixteen requests (plain far ahead)"),
    # not from a run: where large trees win, the climb must go up the ladder
    "easy_c1": Regime(1, {0: 32, 2: 33, 4: 34, 8: 35, 16: 37, 32: 41, 64: 50},
                      (3.0, 9.0), 16.0, "weight-bound, easy text (large trees best)"),
}
BUDGETS = (2, 4, 8, 16, 32, 64)


def _accepted(u: float, mean: float) -> int:
    """The Poisson(``mean``) quantile of ``u``, capped at 15."""
    k, p = 0, math.exp(-mean)
    cdf = p
    while u > cdf and k < 15:
        k += 1
        p *= mean / k
        cdf += p
    return k


def simulate(regime: Regime, seed: int, fixed: int | None = None, horizon: float = 25.0,
             start: float = 8.0, shadow: bool = True) -> tuple[float, dict[str, int]]:
    """Tokens/s from ``start`` to ``horizon`` seconds of engine time, with
    the tuner choosing (``fixed`` None) or one arm throughout (0: plain);
    and the steps each arm ran."""
    rng = random.Random(seed)
    tuner = RateTuner(64, with_model=False) if fixed is None else None

    def prompt() -> list:  # [saturated acceptance, tokens left, prefilled yet]
        m = rng.choice(regime.easy) * math.exp(rng.gauss(0.0, 0.3))
        return [m, rng.randint(96, 200), False]

    reqs = [prompt() for _ in range(regime.c)]
    if tuner is not None:
        tuner.admit(regime.c)
    clock = tokens = seconds = 0.0
    steps: dict[str, int] = {}
    while clock < horizon:
        if tuner is not None:
            arm = tuner.arm(regime.c)
            b, name = (arm.budget if arm.drafts else 0), arm.name
        else:
            b, name = fixed, f"fixed{fixed}" if fixed else "plain"
        prefill = not all(r[2] for r in reqs)
        committed = 0
        below = [x for x in BUDGETS if x < b] if shadow else []
        cut = dict.fromkeys(below, 0)  # tokens had each request verified only x nodes
        for r in reqs:
            if not r[2]:
                r[2], got = True, 1
                for x in below:
                    cut[x] += 1
            else:
                u = rng.random()
                got = 1 + (_accepted(u, r[0] * (1 - math.exp(-b / regime.scale))) if b else 0)
                for x in below:  # the same draw: nested, as a tree's first x nodes are
                    cut[x] += 1 + _accepted(u, r[0] * (1 - math.exp(-x / regime.scale)))
            r[1] -= got
            committed += got
        sec = regime.step_ms[b] * 1e-3 * (1 + 0.05 * (2 * rng.random() - 1))
        if rng.random() < 1 / 30:
            sec *= 2.5
        if prefill:
            sec += 0.01
        if tuner is not None:
            tuner.observe(regime.c, committed, sec, counted=not prefill,
                          verified=regime.c * (1 + b), drafted=bool(b),
                          shadow=cut if b else None)
        steps[name] = steps.get(name, 0) + 1
        if clock >= start:
            tokens += committed
            seconds += sec
        clock += sec
        done = [i for i, r in enumerate(reqs) if r[1] <= 0]
        for i in done:
            reqs[i] = prompt()
        if done and tuner is not None:
            tuner.admit(len(done))
    return tokens / seconds, steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--seeds", type=int, default=96)
    ap.add_argument("--horizon", type=float, default=25.0)
    ap.add_argument("--start", type=float, default=8.0)
    ap.add_argument("--no-shadow", action="store_true",
                    help="report no shadow counts (the tuner compares arms by their own "
                         "trials only)")
    ap.add_argument("--out", help="write the per-seed ratios as JSON")
    args = ap.parse_args(argv)
    if args.seeds < 2 or not 0 <= args.start < args.horizon:
        ap.error("--seeds must be >= 2 and 0 <= --start < --horizon")
    out = {}
    for name in args.regimes:
        regime = REGIMES[name]
        arms = {b: statistics.mean(simulate(regime, 10_000 + s, fixed=b, horizon=args.horizon,
                                            start=args.start)[0] for s in range(8))
                for b in (0, *BUDGETS)}
        best = max(arms.values())
        ratios = [simulate(regime, s, horizon=args.horizon, start=args.start,
                           shadow=not args.no_shadow)[0] / best
                  for s in range(args.seeds)]
        mean = statistics.mean(ratios)
        se = statistics.stdev(ratios) / math.sqrt(len(ratios))
        p10 = sorted(ratios)[len(ratios) // 10]
        over_plain = " ".join(f"{b}:{arms[b] / arms[0]:.2f}" for b in BUDGETS)
        print(f"{name:10s} c={regime.c:<3d} fixed over plain {over_plain}")
        print(f"{'':10s} default / best {mean:.3f} +- {se:.3f} (p10 {p10:.3f})  {regime.note}")
        out[name] = {"c": regime.c, "over_plain": {str(b): arms[b] / arms[0] for b in BUDGETS},
                     "default_over_best": ratios}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "regimes": out}, f, indent=1)


if __name__ == "__main__":
    main()
