"""Tree-attention kernel vs vLLM's ``unified_attention`` on one CUDA GPU.

For each (batch, context, budget B) every request has 1 + B query tokens after
``context`` cached tokens. Timed, at the same query count:

* ``ours_tree``: our kernel, every request a random tree (packed mask);
* ``ours_causal``: our kernel, plain causal rows (no mask);
* ``vllm_causal``: vLLM's Triton ``unified_attention`` (TRITON_ATTN), causal.

Before timing, outputs are checked: ``ours_causal`` against ``vllm_causal``
and ``ours_tree`` against the torch reference. Writes one JSON file.

    python benchmarks/bench_attention_gpu.py --out results.json \
        [--tests-log pytest.log --tests-rc 0]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from vllm_ddtree.kernels import tree_attention as ta
from vllm_ddtree.kernels.reference import split_kv_cache_nhd, tree_attention_reference

BUDGETS = (16, 64, 256)
CONTEXTS = (1024, 8192)
BATCHES = (1, 16)


def random_tree_masks(batch: int, n: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Packed little-endian ancestor masks of random trees (parent < child)."""
    rows = []
    for _ in range(batch):
        anc: list[int] = []
        for i in range(n):
            parent = int(torch.randint(0, i, (1,), generator=gen)) if i else -1
            anc.append((anc[parent] if parent >= 0 else 0) | (1 << i))
        for a in anc:
            row = []
            for w in range(words):
                word = (a >> (32 * w)) & 0xFFFFFFFF
                row.append(word - (1 << 32) if word >= (1 << 31) else word)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def make_case(batch, ctx, budget, hq, hkv, hd, block_size, dtype, dev="cuda", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_len = budget + 1
    seq_len = ctx + q_len
    blocks_per_req = math.ceil(seq_len / block_size)
    num_blocks = batch * blocks_per_req + 1
    raw = torch.randn(num_blocks, block_size, hkv, 2 * hd, dtype=dtype, device=dev)
    kv_cache = raw.permute(0, 2, 1, 3)  # logical [nb, H, bs, 2D], NHD physical
    key_cache, value_cache = split_kv_cache_nhd(kv_cache, hd)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_req]
    block_table = perm.view(batch, blocks_per_req).to(torch.int32).to(dev)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(dev)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    query = torch.randn(batch * q_len, hq, hd, dtype=dtype, device=dev)
    words = math.ceil(q_len / 32)
    mask = random_tree_masks(batch, q_len, words, gen).to(dev)
    return dict(
        query=query, key_cache=key_cache, value_cache=value_cache,
        block_table=block_table, qsl=qsl, seq_lens=seq_lens, mask=mask,
        q_len=q_len, seq_len=seq_len, batch=batch, scale=hd**-0.5, hkv=hkv, dev=dev,
    )  # fmt: skip


def runners(c, with_vllm=True):
    out = torch.empty_like(c["query"])
    is_tree = torch.ones(c["batch"], dtype=torch.bool, device=c["dev"])
    common = (c["query"], c["key_cache"], c["value_cache"], c["block_table"],
              c["qsl"], c["seq_lens"], c["scale"])  # fmt: skip

    def ours_tree():
        ta.tree_attention(*common, c["mask"], is_tree, output=out, max_query_len=c["q_len"])
        return out

    def ours_causal():
        ta.tree_attention(*common, output=out, max_query_len=c["q_len"])
        return out

    fns = {"ours_tree": ours_tree, "ours_causal": ours_causal}
    if not with_vllm:
        fns["vllm_error"] = "not run"
        return fns, out
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:  # vLLM missing or broken: time ours only
        fns["vllm_error"] = repr(e)
        return fns, out

    descale = torch.ones(c["batch"], c["hkv"], dtype=torch.float32, device="cuda")

    def vllm_causal():
        unified_attention(
            q=c["query"], k=c["key_cache"], v=c["value_cache"], out=out,
            cu_seqlens_q=c["qsl"], max_seqlen_q=c["q_len"], seqused_k=c["seq_lens"],
            max_seqlen_k=c["seq_len"], softmax_scale=c["scale"], causal=True,
            window_size=(-1, -1), block_table=c["block_table"], softcap=0,
            q_descale=None, k_descale=descale, v_descale=descale,
        )  # fmt: skip
        return out

    fns["vllm_causal"] = vllm_causal
    return fns, out


def bench_ms(fn, device="cuda") -> float:
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tests-log", default=None)
    ap.add_argument("--tests-rc", type=int, default=None)
    ap.add_argument("--heads", default="32,8", help="q_heads,kv_heads")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="tiny shapes on CPU in Triton's interpreter (checks this script only)",
    )
    args = ap.parse_args()
    batches, contexts, budgets = BATCHES, CONTEXTS, BUDGETS
    device = "cuda"
    if args.smoke_cpu:
        if not ta.INTERPRETED:
            raise SystemExit("--smoke-cpu needs TRITON_INTERPRET=1")
        batches, contexts, budgets, device = (1, 2), (40,), (16, 40), "cpu"
        args.heads, args.head_size, args.dtype = "4,2", 32, "float32"

    hq, hkv = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    result: dict = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {"q_heads": hq, "kv_heads": hkv, "head_size": args.head_size,
                  "block_size": args.block_size, "dtype": args.dtype},  # fmt: skip
        "rows": [],
    }
    try:
        import triton

        result["triton"] = triton.__version__
        import vllm

        result["vllm"] = vllm.__version__
    except Exception as e:
        result["vllm"] = f"unavailable: {e!r}"
    if args.tests_log:
        log = Path(args.tests_log).read_text(errors="replace") if Path(args.tests_log).exists() else ""
        result["kernel_tests"] = {"rc": args.tests_rc, "log_tail": log[-6000:]}

    ok = True
    if device == "cuda" and not torch.cuda.is_available():
        result["error"] = "no CUDA device"
        ok = False
    else:
        for batch in batches:
            for ctx in contexts:
                for budget in budgets:
                    t0 = time.time()
                    c = make_case(batch, ctx, budget, hq, hkv, args.head_size,
                                  args.block_size, dtype, device)  # fmt: skip
                    fns, _ = runners(c, with_vllm=device == "cuda")
                    row = {"batch": batch, "context": ctx, "B": budget,
                           "query_tokens": batch * c["q_len"]}  # fmt: skip
                    # correctness first
                    tree_out = fns["ours_tree"]().clone()
                    ref = tree_attention_reference(
                        c["query"], c["key_cache"], c["value_cache"], c["block_table"],
                        c["qsl"], c["seq_lens"], c["scale"], c["mask"],
                        torch.ones(batch, dtype=torch.bool, device=device),
                    )  # fmt: skip
                    row["err_tree_vs_reference"] = max_err(tree_out, ref)
                    causal_out = fns["ours_causal"]().clone()
                    # size of the mask's effect, for scale
                    row["tree_minus_causal"] = max_err(tree_out, causal_out)
                    if "vllm_causal" in fns:
                        vllm_out = fns["vllm_causal"]().clone()
                        row["err_causal_vs_vllm"] = max_err(causal_out, vllm_out)
                    else:
                        row["vllm_error"] = fns["vllm_error"]
                    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
                    errs = [v for k, v in row.items() if k.startswith("err_")]
                    row["correct"] = all(e <= tol for e in errs)
                    ok &= row["correct"]
                    for name in ("ours_tree", "ours_causal", "vllm_causal"):
                        if name in fns:
                            row[f"{name}_us"] = round(1000 * bench_ms(fns[name], device), 2)
                    if "vllm_causal_us" in row:
                        row["tree_over_vllm"] = round(row["ours_tree_us"] / row["vllm_causal_us"], 3)
                        row["causal_over_vllm"] = round(
                            row["ours_causal_us"] / row["vllm_causal_us"], 3
                        )
                    row["wall_s"] = round(time.time() - t0, 2)
                    print(json.dumps(row), flush=True)
                    result["rows"].append(row)
                    del c, fns
                    if device == "cuda":
                        torch.cuda.empty_cache()

    result["all_correct"] = ok
    if args.tests_rc is not None:
        ok &= args.tests_rc == 0
    result["ok"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
