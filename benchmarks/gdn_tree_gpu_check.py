"""GPU check of the tree Gated DeltaNet kernels (``kernels/gdn_tree.py``).

On one CUDA GPU, at a Qwen3.6-27B-like GDN layer (H=16 key heads, HV=48 value
heads, K=V=128, conv width 4, conv dim 2*16*128 + 48*128 = 10240), 8 requests
each verifying a 65-node tree (random parents in flat order, S = 64):

1. checks ``tree_conv_update`` / ``tree_recurrent_update`` natively against
   the torch references (outputs, every state slot, the whole conv buffer),
   for fp32, bf16 and bf16-inputs/fp32-state configurations;
2. checks that ``parent[j] = j - 1`` is bit for bit the parent-free chain, and
   (fp32) that tree nodes are bit for bit the kernel's chains along their
   root paths;
3. if vLLM is importable (optional), compares the chain with vLLM's stock
   ``causal_conv1d_update`` / ``fused_sigmoid_gating_delta_rule_update``;
4. times tree vs chain (and a small tile sweep, and the engine's commit after
   the walk, ``vllm_ddtree.core.gdn_tree.commit_columns`` / ``commit_layer``).

Conv buffers and SSM states share one slot space, as in vLLM: a request's
conv slot is column 0 of its state-index row.

Prints a summary and writes JSON to ``$OUT/gdn_tree_gpu_check.json`` when
``OUT`` is set (or to ``--out``). Exit status 1 if a check fails. Runs in well
under two minutes; needs CUDA torch + triton, not vLLM.

    python benchmarks/gdn_tree_gpu_check.py [--no-vllm] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.pop("TRITON_INTERPRET", None)

try:
    from vllm_ddtree.core import gdn_tree as gdn_commit
    from vllm_ddtree.kernels import gdn_tree as gt
    from vllm_ddtree.kernels import gdn_tree_reference as ref
except ImportError:  # not installed: map the package onto this checkout
    for name, path in (("vllm_ddtree", REPO / "vllm_ddtree"),
                       ("vllm_ddtree.kernels", REPO / "kernels")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
    from vllm_ddtree.core import gdn_tree as gdn_commit  # torch only, no vLLM
    from vllm_ddtree.kernels import gdn_tree as gt
    from vllm_ddtree.kernels import gdn_tree_reference as ref

H, HV, K, V, W = 16, 48, 128, 128, 4
DIM = 2 * H * K + HV * V
N_REQ, NODES = 8, 65
S = NODES - 1
CONFIGS = {  # name: (input dtype, conv buffer dtype, ssm state dtype)
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "bf16_in_fp32_state": (torch.bfloat16, torch.bfloat16, torch.float32),
}
SWEEP_CONFIG = "bf16_in_fp32_state"
TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}

RESULTS: dict = {"checks": {}, "timings_us": {}, "stock_vllm": {}}
FAILED: list[str] = []


def check(name: str, ok: bool, **info) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), **info}
    print(f"[{'ok' if ok else 'FAIL'}] {name} {info if info else ''}")
    if not ok:
        FAILED.append(name)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = TOL[dtype]
    return bool(torch.isfinite(a.float()).all()) and torch.allclose(
        a.float(), b.float(), atol=tol, rtol=tol)


def make_inputs(cfg: str, seed: int = 0) -> dict:
    in_dt, conv_dt, ssm_dt = CONFIGS[cfg]
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    parents = []
    for _ in range(N_REQ):
        parents += [-1] + [int(torch.randint(0, j, (1,), generator=gen))
                           for j in range(1, NODES)]
    T = N_REQ * NODES
    cu = torch.arange(0, T + 1, NODES, dtype=torch.int32)
    n_acc = torch.randint(1, S + 2, (N_REQ,), generator=gen, dtype=torch.int32)
    ssm_slots = N_REQ * NODES + 1
    conv_slots = ssm_slots  # one slot space (vLLM): conv slot = rows[:, 0]
    rows = (torch.randperm(ssm_slots - 1, generator=gen) + 1).view(N_REQ, NODES).int()

    def rnd(*shape, scale=1.0, dt=in_dt):
        return (torch.randn(*shape, generator=gen) * scale).to(dt).to(dev)

    # vLLM's default conv layout: [slots, state_len, dim] storage, viewed
    # as [slots, dim, state_len].
    # (Drawn on the device: with one slot space the buffer has ssm_slots slots.)
    dev_gen = torch.Generator(dev).manual_seed(seed)
    conv_state = torch.randn(conv_slots, W - 1 + S, DIM, generator=dev_gen,
                             device=dev).to(conv_dt).transpose(1, 2)
    return dict(
        parent=torch.tensor(parents, dtype=torch.int32, device=dev),
        cu=cu.to(dev), n_acc=n_acc.to(dev),
        conv_slot=rows[:, 0].clone().to(dev),
        rows=rows.to(dev), x=rnd(T, DIM), weight=rnd(DIM, W, scale=0.5),
        bias=rnd(DIM, scale=0.5), conv_state=conv_state,
        q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, HV, V), a=rnd(T, HV), b=rnd(T, HV),
        A_log=torch.empty(HV).uniform_(-1.0, 0.5, generator=gen).to(dev),
        dt_bias=rnd(HV, scale=0.5), ssm_state=rnd(ssm_slots, HV, V, K, scale=0.5,
                                                  dt=ssm_dt),
    )


def conv_args(d, conv_state, parent):
    return (d["x"], conv_state, d["weight"], d["bias"], "silu", d["conv_slot"],
            d["n_acc"], parent, d["cu"])


def rec_args(d, ssm_state, parent, **over):
    g = {**d, **over}
    return (g["q"], g["k"], g["v"], g["a"], g["b"], g["A_log"], g["dt_bias"],
            ssm_state, g["rows"], g["n_acc"], parent, g["cu"])


def check_against_reference(cfg: str, d: dict) -> None:
    in_dt, _, ssm_dt = CONFIGS[cfg]
    cs_k, cs_r = d["conv_state"].clone(), d["conv_state"].clone()
    out_k = gt.tree_conv_update(*conv_args(d, cs_k, d["parent"]))
    out_r = ref.tree_conv_update_ref(*conv_args(d, cs_r, d["parent"]))
    check(f"{cfg}/conv_out_vs_ref", close(out_k, out_r, in_dt), max_err=max_err(out_k, out_r))
    check(f"{cfg}/conv_buffer_vs_ref_exact", torch.equal(cs_k, cs_r))

    hs_k, hs_r = d["ssm_state"].clone(), d["ssm_state"].clone()
    o_k = gt.tree_recurrent_update(*rec_args(d, hs_k, d["parent"]))
    o_r = ref.tree_recurrent_update_ref(*rec_args(d, hs_r, d["parent"]))
    check(f"{cfg}/rec_out_vs_ref", close(o_k, o_r, in_dt), max_err=max_err(o_k, o_r))
    check(f"{cfg}/rec_states_vs_ref", close(hs_k, hs_r, ssm_dt), max_err=max_err(hs_k, hs_r))


def check_chain_bitexact(cfg: str, d: dict) -> None:
    chain = ref.chain_parent(d["cu"].cpu()).cuda()
    res = []
    for parent in (chain, None):
        cs, hs = d["conv_state"].clone(), d["ssm_state"].clone()
        out = gt.tree_conv_update(*conv_args(d, cs, parent))
        o = gt.tree_recurrent_update(*rec_args(d, hs, parent))
        res.append((out, cs, o, hs))
    same = all(torch.equal(a, b) for a, b in zip(*res, strict=True))
    check(f"{cfg}/chain_parents_equal_parent_free_chain", same)


def check_nodes_equal_path_chains(d: dict, requests=(0, 1)) -> None:
    """fp32: every node of the given requests vs the kernel's chain along its
    root path (unused state columns map to the null slot 0)."""
    parent = d["parent"].tolist()
    nodes, tokens, lens = [], [], []
    for i in requests:
        par = parent[i * NODES:(i + 1) * NODES]
        for j in range(NODES):
            path = ref.path_of(par, j)
            nodes.append((i, j))
            tokens += [i * NODES + p for p in path]
            lens.append(len(path))
    n = len(nodes)
    n_acc_src = d["n_acc"].tolist()
    rows = torch.zeros(n, NODES, dtype=torch.int32)
    next_slot = 1
    init = []
    for c, (i, _) in enumerate(nodes):
        cols = set(range(lens[c])) | {n_acc_src[i] - 1}
        for col in sorted(cols):
            rows[c, col] = next_slot
            next_slot += 1
        init.append((int(rows[c, n_acc_src[i] - 1]),
                     int(d["rows"][i, n_acc_src[i] - 1])))
    ssm = torch.zeros(next_slot, HV, V, K, dtype=d["ssm_state"].dtype, device="cuda")
    for dst, src in init:
        ssm[dst] = d["ssm_state"][src]
    conv = torch.empty(n + 1, W - 1 + S, DIM, dtype=d["conv_state"].dtype,
                       device="cuda").transpose(1, 2)
    for c, (i, _) in enumerate(nodes):
        conv[c + 1] = d["conv_state"][int(d["conv_slot"][i])]
    tok = torch.tensor(tokens, device="cuda")
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    ch = dict(d, x=d["x"][tok], q=d["q"][tok], k=d["k"][tok], v=d["v"][tok],
              a=d["a"][tok], b=d["b"][tok], cu=cu, rows=rows.cuda(),
              conv_slot=torch.arange(1, n + 1, dtype=torch.int32, device="cuda"),
              n_acc=torch.tensor([n_acc_src[i] for i, _ in nodes], dtype=torch.int32,
                                 device="cuda"))

    cs, hs = d["conv_state"].clone(), d["ssm_state"].clone()
    out = gt.tree_conv_update(*conv_args(d, cs, d["parent"]))
    o = gt.tree_recurrent_update(*rec_args(d, hs, d["parent"]))
    chain = ref.chain_parent(cu.cpu()).cuda()  # same kernel variant as the tree
    c_out = gt.tree_conv_update(*conv_args(ch, conv, chain))
    c_o = gt.tree_recurrent_update(*rec_args(ch, ssm, chain))
    ends = (torch.tensor(lens).cumsum(0) - 1).tolist()
    ok_out = ok_o = ok_h = True
    for c, (i, j) in enumerate(nodes):
        t = i * NODES + j
        ok_out &= torch.equal(out[t], c_out[ends[c]])
        ok_o &= torch.equal(o[t], c_o[ends[c]])
        ok_h &= torch.equal(hs[int(d["rows"][i, j])], ssm[int(rows[c, lens[c] - 1])])
    check("fp32/tree_nodes_equal_path_chains", ok_out and ok_o and ok_h,
          conv=bool(ok_out), rec_out=bool(ok_o), states=bool(ok_h), nodes=n)


def compare_stock(cfg: str, d: dict) -> None:
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_update,
        )
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update,
        )
    except Exception as e:  # noqa: BLE001 - optional
        RESULTS["stock_vllm"][cfg] = {"skipped": f"{type(e).__name__}: {e}"}
        print(f"[skip] stock vLLM comparison: {type(e).__name__}: {e}")
        return
    cs_k, cs_s = d["conv_state"].clone(), d["conv_state"].clone()
    out_k = gt.tree_conv_update(*conv_args(d, cs_k, None))
    out_s = causal_conv1d_update(
        d["x"].clone(), cs_s, d["weight"], d["bias"], "silu",
        conv_state_indices=d["conv_slot"], num_accepted_tokens=d["n_acc"],
        query_start_loc=d["cu"], max_query_len=NODES)
    hs_k, hs_s = d["ssm_state"].clone(), d["ssm_state"].clone()
    o_k = gt.tree_recurrent_update(*rec_args(d, hs_k, None))
    o_s, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=d["A_log"], a=d["a"], b=d["b"], dt_bias=d["dt_bias"], q=d["q"][None],
        k=d["k"][None], v=d["v"][None], initial_state=hs_s, inplace_final_state=True,
        cu_seqlens=d["cu"], ssm_state_indices=d["rows"], num_accepted_tokens=d["n_acc"],
        use_qk_l2norm_in_kernel=True)
    o_s = o_s.squeeze(0)
    info = {
        "conv_out_equal": torch.equal(out_k, out_s), "conv_out_max_err": max_err(out_k, out_s),
        "conv_buffer_equal": torch.equal(cs_k, cs_s),
        "rec_out_equal": torch.equal(o_k, o_s), "rec_out_max_err": max_err(o_k, o_s),
        "states_equal": torch.equal(hs_k, hs_s), "states_max_err": max_err(hs_k, hs_s),
    }
    in_dt, _, ssm_dt = CONFIGS[cfg]
    ok = (close(out_k, out_s, in_dt) and torch.equal(cs_k, cs_s)
          and close(o_k, o_s, in_dt) and close(hs_k, hs_s, ssm_dt))
    RESULTS["stock_vllm"][cfg] = info
    check(f"{cfg}/chain_vs_stock_vllm", ok, **info)
    # Stock timing at the same shapes (chain only).
    x_s = d["x"].clone()
    RESULTS["timings_us"][f"{cfg}/stock_conv"] = time_us(lambda: causal_conv1d_update(
        x_s, cs_s, d["weight"], d["bias"], "silu", conv_state_indices=d["conv_slot"],
        num_accepted_tokens=d["n_acc"], query_start_loc=d["cu"], max_query_len=NODES,
        out=torch.empty_like(x_s)))
    RESULTS["timings_us"][f"{cfg}/stock_recurrent"] = time_us(
        lambda: fused_sigmoid_gating_delta_rule_update(
            A_log=d["A_log"], a=d["a"], b=d["b"], dt_bias=d["dt_bias"], q=d["q"][None],
            k=d["k"][None], v=d["v"][None], initial_state=hs_s, inplace_final_state=True,
            cu_seqlens=d["cu"], ssm_state_indices=d["rows"],
            num_accepted_tokens=d["n_acc"], use_qk_l2norm_in_kernel=True))


ITERS = 50


def time_us(fn, iters=None) -> float:
    iters = iters or ITERS
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters * 1000.0, 2)


def timings(cfg: str, d: dict) -> None:
    tm = RESULTS["timings_us"]
    cs, hs = d["conv_state"].clone(), d["ssm_state"].clone()
    chain = ref.chain_parent(d["cu"].cpu()).cuda()
    for label, parent in (("tree", d["parent"]), ("chain", chain), ("chain_noparent", None)):
        tm[f"{cfg}/conv_{label}"] = time_us(
            lambda p=parent: gt.tree_conv_update(*conv_args(d, cs, p)))
        tm[f"{cfg}/recurrent_{label}"] = time_us(
            lambda p=parent: gt.tree_recurrent_update(*rec_args(d, hs, p)))
        tm[f"{cfg}/both_{label}"] = round(tm[f"{cfg}/conv_{label}"]
                                          + tm[f"{cfg}/recurrent_{label}"], 2)
    if cfg == SWEEP_CONFIG:  # tile sweep (defaults: block_v 32, block_n 256)
        for bv in (16, 64):
            tm[f"{cfg}/recurrent_tree_bv{bv}"] = time_us(
                lambda b=bv: gt.tree_recurrent_update(*rec_args(d, hs, d["parent"]),
                                                      block_v=b))
        for bn in (128, 512):
            tm[f"{cfg}/conv_tree_bn{bn}"] = time_us(
                lambda b=bn: gt.tree_conv_update(*conv_args(d, cs, d["parent"]),
                                                 block_n=b))
    # The engine's commit (one layer): accepted path [N, 1 + S], -1 padded,
    # and the accepted nodes past the root; columns computed once per step.
    path = torch.full((N_REQ, NODES), -1, dtype=torch.long)
    parent = d["parent"].tolist()
    n_acc = d["n_acc"].tolist()
    acc = []
    for i in range(N_REQ):  # accepted path: root path of some node
        p = ref.path_of(parent[i * NODES:(i + 1) * NODES], n_acc[i] - 1)
        path[i, : len(p)] = torch.tensor(p)
        acc.append(len(p) - 1)
    path, acc = path.cuda(), torch.tensor(acc, device="cuda")
    tm[f"{cfg}/commit_columns"] = time_us(lambda: gdn_commit.commit_columns(path, acc, W))
    state_col, conv_cols = gdn_commit.commit_columns(path, acc, W)
    tm[f"{cfg}/commit_layer"] = time_us(
        lambda: gdn_commit.commit_layer(cs, hs, d["rows"], state_col, conv_cols))


def main() -> int:
    global ITERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    ITERS = args.iters
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    t0 = time.time()
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["shape"] = dict(H=H, HV=HV, K=K, V=V, W=W, dim=DIM, requests=N_REQ,
                            nodes=NODES)
    import triton
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    for cfg in CONFIGS:
        d = make_inputs(cfg)
        try:
            check_against_reference(cfg, d)
            check_chain_bitexact(cfg, d)
            if cfg == "fp32":
                check_nodes_equal_path_chains(d)
            if not args.no_vllm:
                compare_stock(cfg, d)
            timings(cfg, d)
        except Exception as e:  # noqa: BLE001 - report and continue
            check(f"{cfg}/exception", False, error=f"{type(e).__name__}: {e}")
        del d
        torch.cuda.empty_cache()
    RESULTS["ok"] = not FAILED
    RESULTS["failed"] = FAILED
    RESULTS["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(RESULTS["timings_us"], indent=1))
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "gdn_tree_gpu_check.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(RESULTS, indent=2))
        print(f"wrote {out}")
    print(f"{'OK' if not FAILED else 'FAILED: ' + ', '.join(FAILED)} in {RESULTS['wall_s']}s")
    return 0 if not FAILED else 1


if __name__ == "__main__":
    sys.exit(main())
