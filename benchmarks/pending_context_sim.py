"""What plain mode's pending drafter context costs the runner, per step, in
continuous serving: the bookkeeping of ``core/pending_context.py`` alone.

    python -m benchmarks.pending_context_sim --concurrency 16 64 --steps 1500
    python -m benchmarks.pending_context_sim --module /tmp/pending_context_at_REV.py

simulates an engine held in plain mode at a fixed number of requests
(a request that finishes is replaced in the same step; prompts of 80-250
tokens, outputs of 64-192, the tiny pair's row of three 192-wide fp32
outputs, 128-token blocks from a pool of ``--blocks``, freed blocks reused
last-freed-last as vLLM's free queue does) and times what the runner does
with the pending rows at every step: the clock and the blocks that change
hands, adding the step's rows (kept by reference), compacting, and taking
the live rows once they reach the cap (the drafter's store itself is not
run: the rows it would store are counted). The step's forward is not
simulated; compare the milliseconds with a plain step's (``bench_step``).

``--module`` loads another implementation of the module from a file (for
example an earlier revision's, ``git show REV:vllm_ddtree/core/pending_context.py``);
one that settles finished requests by ``release`` (before the step clock)
is driven that way.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import numpy as np
import torch

WIDTH, OUTPUTS, BLOCK = 192, 3, 128
CAP = (192 << 20) // (OUTPUTS * WIDTH * 4)  # the runner's cap for these rows
STORE_ROWS = 8192


def simulate(mod, concurrency: int, steps: int, blocks: int, seed: int) -> tuple[float, int]:
    """Milliseconds per step of pending-context work, and rows stored."""
    rng = np.random.default_rng(seed)
    clocked = hasattr(mod.PendingContext, "renew")
    pc = mod.PendingContext(BLOCK) if clocked else mod.PendingContext()
    free = list(range(1, blocks))
    reqs: dict[int, dict] = {}
    next_id, busy, stored = 0, 0.0, 0
    for _ in range(steps):
        done = [r for r, q in reqs.items() if q["left"] == 0]
        freed = [b for r in done for b in reqs[r]["blocks"]]
        # the blocks past each finished request's full ones (its last K/V-less token)
        partial = [b for r in done for b in
                   reqs[r]["blocks"][reqs[r]["pos"] // BLOCK:]]
        for r in done:
            del reqs[r]
        fresh = []
        while len(reqs) < concurrency:
            prompt, out = int(rng.integers(80, 250)), int(rng.integers(64, 192))
            ids = [free.pop(0) for _ in range(-(-(prompt + out) // BLOCK))]
            fresh += ids
            reqs[next_id] = {"blocks": ids, "pos": 0, "prompt": prompt, "left": out}
            next_id += 1
        slots = []
        for q in reqs.values():
            n = q["prompt"] if q["pos"] == 0 else 1
            pos = np.arange(q["pos"], q["pos"] + n)
            slots.append(np.asarray(q["blocks"])[pos // BLOCK] * BLOCK + pos % BLOCK)
            q["pos"] += n
            q["left"] -= n == 1
        slots = np.concatenate(slots)
        hidden = tuple(torch.randn(len(slots), WIDTH) for _ in range(OUTPUTS))
        t0 = time.perf_counter()
        if clocked:
            pc.tick()
            if pc:
                pc.renew(np.asarray(fresh + partial, dtype=np.int64))
        elif pc and done:
            out = pc.release(torch.tensor(freed, dtype=torch.long), BLOCK, keep_full=True)
            stored += 0 if out is None else len(out[2])
        pc.add(hidden, slots.copy(), slots)
        if pc.held_rows >= CAP:
            if clocked:
                pc.compact()
                if pc.held_rows >= CAP // 2:
                    stored += sum(len(c[2]) for c in pc.take_chunks(STORE_ROWS))
            else:
                out = pc.take()
                stored += 0 if out is None else len(out[2])
        busy += time.perf_counter() - t0
        free.extend(freed)  # full blocks stay cached until handed out again
    return 1e3 * busy / steps, stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--module", help="a pending_context.py to load instead of the installed one")
    args = ap.parse_args()
    if min(args.concurrency + [args.steps, args.repeats]) < 1 or args.blocks < 2:
        raise SystemExit("--concurrency, --steps and --repeats must be at least 1, --blocks 2")
    if args.module:
        spec = importlib.util.spec_from_file_location("pending_context_under_test", args.module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        from vllm_ddtree.core import pending_context as mod
    torch.set_num_threads(1)
    for c in args.concurrency:
        need = c * -(-(250 + 192) // BLOCK)
        if need >= args.blocks:
            raise SystemExit(f"--blocks {args.blocks} cannot hold {c} requests (needs {need})")
        runs = [simulate(mod, c, args.steps, args.blocks, seed) for seed in range(args.repeats)]
        ms = [r[0] for r in runs]
        print(f"c={c}: {statistics.median(ms):.3f} ms/step (runs {', '.join(f'{m:.3f}' for m in ms)}),"
              f" rows stored {statistics.median(r[1] for r in runs):.0f} in {args.steps} steps",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
