"""Tree construction speed on CPU: batched on-device top-B versus a best-first heap.

Ours: ``build_tree`` + ``ancestor_mask`` + ``walk`` (vllm_ddtree.tree), all
batched torch ops with no host synchronisation.

Reference: the per-request best-first heap used by DDTree's reference code:
per depth, the top-min(B, V) log-probs are computed with torch and copied to
the host; a Python heap then pops the most probable prefix and pushes its best
child and its next sibling, B times per request.

Prints a markdown table of medians (and the spread, min-max) in milliseconds.

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

from vllm_ddtree.tree import ancestor_mask, build_tree, walk


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


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def fmt(times):
    return f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size V")
    ap.add_argument("--depth", type=int, default=15, help="drafter depth K")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: small ops, and a shared machine makes threads spin)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(
        f"# CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"K={args.depth}, V={args.vocab}, median (min-max) of {args.repeats} runs, ms"
    )
    print()
    print("| batch | B | ours: build | ours: build+mask+walk | heap: build | heap / ours build |")
    print("|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(args.seed)
    for batch in args.batches:
        for budget in args.budgets:
            logits = torch.randn(batch, args.depth, args.vocab, generator=g) * 3
            post = torch.randint(0, args.vocab, (batch, budget + 1), generator=g)
            t_build = timed(lambda: ours_build(logits, budget), args.repeats)
            t_full = timed(lambda: ours_full(logits, budget, post), args.repeats)
            t_heap = timed(lambda: heap_tree(logits, budget), args.repeats)
            # the two constructions agree on the prefix probabilities they pick
            ref = heap_tree(logits[:1], budget)[0][3]
            got = build_tree(logits[:1], budget).logq[0].double()
            assert abs(sum(math.exp(x) for x in ref) - got.exp().sum().item()) < 1e-4
            ratio = statistics.median(t_heap) / statistics.median(t_build)
            print(f"| {batch} | {budget} | {fmt(t_build)} | {fmt(t_full)} | {fmt(t_heap)} | {ratio:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
