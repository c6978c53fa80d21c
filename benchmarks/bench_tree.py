"""Tree construction speed on CPU: batched on-device top-B versus a best-first heap.

Ours: ``build_tree`` + ``ancestor_mask`` + ``walk`` (vllm_ddtree.core.tree), all
batched torch ops with no host synchronisation.

Reference: the per-request best-first heap used by DDTree's reference code:
per depth, the top-min(B, V) log-probs are computed with torch and copied to
the host; a Python heap then pops the most probable prefix and pushes its best
child and its next sibling, B times per request.

Prints a markdown table of medians (and the spread, min-max) in milliseconds.
With ``--compile`` it adds the pipeline under ``torch.compile(fullgraph=True)``
(one compilation per shape, not timed).

    .venv/bin/python benchmarks/bench_tree.py --vocab 4096 --depth 15
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import platform
import statistics
import time

import torch

from vllm_ddtree.core.tree import ancestor_mask, build_tree, walk


def heap_tree(logits: torch.Tensor, budget: int):
    """Best-first heap per request; returns (tokens, parents, depth, logq) lists."""
    b, num_levels, vocab = logits.shape
    k = min(budget, vocab)
    top_lp, top_tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    top_lp, top_tok = top_lp.tolist(), top_tok.tolist()  # host copy
    trees = []
    for r in range(b):
        lp, tok = top_lp[r], top_tok[r]
        tokens, parents, depth, logq = [], [], [], []
        # entry: (-score, tiebreak, depth index, rank, parent flat index, parent score)
        heap = [(-lp[0][0], 0, 0, 0, 0, 0.0)]
        count = 1
        while heap and len(tokens) < budget:
            neg, _, d, j, parent, pscore = heapq.heappop(heap)
            tokens.append(tok[d][j])
            parents.append(parent)
            depth.append(d + 1)
            logq.append(-neg)
            flat = len(tokens)
            if j + 1 < k:
                heapq.heappush(heap, (-(pscore + lp[d][j + 1]), count, d, j + 1, parent, pscore))
                count += 1
            if d + 1 < num_levels:
                heapq.heappush(heap, (neg - lp[d + 1][0], count, d + 1, 0, flat, -neg))
                count += 1
        trees.append((tokens, parents, depth, logq))
    return trees


def ours_build(logits, budget):
    return build_tree(logits, budget)


def ours_full(logits, budget, post):
    tree = build_tree(logits, budget)
    mask = ancestor_mask(tree.parents, tree.depth, tree.valid)
    res = walk(tree.tokens, tree.parents, post, tree.valid.sum(-1))
    return tree, mask, res


def shared_topk(logits, budget):
    """The step both constructions start with: per-depth top-min(B, V) log-probs."""
    return torch.log_softmax(logits.float(), -1).topk(min(budget, logits.shape[-1]), dim=-1)


def timed(fns, repeats):
    """Median-ready timings (ms) of several functions, interleaved A B C A B C ..."""
    for fn in fns:
        fn()  # warm-up (and compilation, for compiled functions)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return times


def fmt(times):
    return f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size V")
    ap.add_argument("--depth", type=int, default=15, help="drafter depth K")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: small ops, and a shared machine makes threads spin)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="also time the compiled pipeline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(
        f"# CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"K={args.depth}, V={args.vocab}, median (min-max) of {args.repeats} runs, ms"
    )
    print()
    head = "| batch | B | shared: log-softmax + top-k | ours: build | ours: build+mask+walk |"
    rule = "|---:|---:|---:|---:|---:|"
    if args.compile:
        head += " ours compiled: build+mask+walk |"
        rule += "---:|"
    print(head + " heap: build | heap / ours build |")
    print(rule + "---:|---:|")
    g = torch.Generator().manual_seed(args.seed)
    for batch in args.batches:
        for budget in args.budgets:
            logits = torch.randn(batch, args.depth, args.vocab, generator=g) * 3
            post = torch.randint(0, args.vocab, (batch, budget + 1), generator=g)
            fns = [
                lambda: shared_topk(logits, budget),
                lambda: ours_build(logits, budget),
                lambda: ours_full(logits, budget, post),
                lambda: heap_tree(logits, budget),
            ]
            if args.compile:
                torch._dynamo.reset()
                compiled = torch.compile(ours_full, fullgraph=True, dynamic=False)
                fns.append(lambda: compiled(logits, budget, post))
            times = timed(fns, args.repeats)
            cells = [fmt(t) for t in times[:3]] + [fmt(t) for t in times[4:]] + [fmt(times[3])]
            # the two constructions agree on the prefix probabilities they pick
            ref = heap_tree(logits[:1], budget)[0][3]
            got = build_tree(logits[:1], budget).logq[0].double()
            assert abs(sum(math.exp(x) for x in ref) - got.exp().sum().item()) < 1e-4
            ratio = statistics.median(times[3]) / statistics.median(times[1])
            print(f"| {batch} | {budget} | {' | '.join(cells)} | {ratio:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
