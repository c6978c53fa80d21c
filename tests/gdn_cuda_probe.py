"""vLLM's CUDA Gated DeltaNet core with DDTree's tree kernels, run on a CPU.

Run as a script in a fresh interpreter (``tests/test_gdn_tree_cuda.py`` does):
it makes vLLM's own Triton kernels runnable in Triton's interpreter, then
calls ``QwenGatedDeltaNetAttention._forward_core`` -- the CUDA build's GDN
core -- on a small layer, twice:

* patched (``patches/gdn_tree_cuda.py``), on one batch of tree requests
  (plus one plain decode) inside a DDTree tree step;
* stock, on one chain per tree node: the node's root-to-node path, starting
  from a copy of its request's state; and on the same mixed batch without a
  tree step (the plain decode's row must come out as vLLM computes it).

It prints one JSON object: the largest difference between every node's tree
output and state and the last output and state of its chain, the same after
the commit of a random accepted path per request, and the same numbers when
the tree kernels are given a flat chain instead of the parents (the control
that must fail); one object per ``--dtype`` (float32 and float16 by default).

How vLLM's kernels run here: vLLM CPU replaces its Triton module with a
placeholder (no Triton CPU backend), so the real ``triton`` is put back into
``vllm.triton_utils`` before any kernel module is imported; vLLM CPU binds
``causal_conv1d_update`` to a C++ kernel, so the module is loaded a second
time as the CUDA build loads it; and the interpreter refuses the int64 masks
that vLLM's conv kernel forms from a scalar and a tensor condition (a GPU
build casts them), so masks are cast to bool at the interpreter's load and
store.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

import vllm.triton_utils as _tu  # noqa: E402

_tu.triton, _tu.tl, _tu.tldevice, _tu.HAS_TRITON = triton, tl, tldevice, True


def _bool_masks():
    load, store = (_interp.InterpreterBuilder.create_masked_load,
                   _interp.InterpreterBuilder.create_masked_store)

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return _interp.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    _interp.InterpreterBuilder.create_masked_load = masked_load
    _interp.InterpreterBuilder.create_masked_store = masked_store


_bool_masks()

from vllm.model_executor.layers.mamba.ops import causal_conv1d as _cpu_conv  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402


def _triton_conv_module():
    """``causal_conv1d`` as the CUDA build binds it (Triton, not vLLM CPU's C++)."""
    cls = type(current_platform)
    is_cpu = cls.is_cpu
    cls.is_cpu = lambda self: False
    try:
        spec = importlib.util.spec_from_file_location("ddtree_probe_causal_conv1d",
                                                      _cpu_conv.__file__)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        cls.is_cpu = is_cpu
    return mod


import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as qga  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

from vllm_ddtree import gdn  # noqa: E402
from vllm_ddtree.patches import gdn_tree_cuda as P  # noqa: E402

H, HV, K, V, W, S = 1, 2, 16, 16, 4, 8  # key heads, value heads, head dims, conv width, spec
DIM = 2 * H * K + HV * V
PREFIX = "model.layers.0.linear_attn"
# Local parents of three trees (flat order, parents first) with branches.
TREES = [[-1, 0, 0, 1, 1, 2, 4],
         [-1, 0, 1, 2, 0, 4, 1, 6, 3],
         [-1, 0, 0, 0]]
NUM_ACCEPTED = [1, 2, 1]  # where each request's prior window and state sit


def _layer(dtype, gen):
    layer = types.SimpleNamespace(
        prefix=PREFIX, activation="silu", key_dim=H * K, value_dim=HV * V, tp_size=1,
        head_k_dim=K, head_v_dim=V, enable_packed_recurrent_decode=False,
        conv1d=types.SimpleNamespace(weight=torch.randn(DIM, 1, W, generator=gen).to(dtype),
                                     bias=torch.randn(DIM, generator=gen).to(dtype)),
        A_log=torch.randn(HV, generator=gen) * 0.5, dt_bias=torch.randn(HV, generator=gen))
    layer.rearrange_mixed_qkv = types.MethodType(
        qga.QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    return layer


def _caches(num_slots, dtype, gen):
    conv = torch.randn(num_slots, W - 1 + S, DIM, generator=gen).to(dtype)  # "SD" layout
    ssm = torch.randn(num_slots, HV, V, K, generator=gen) * 0.3
    return conv, ssm


def _run(layer, md, qkv, b, a, tree_step=None):
    out = torch.zeros(qkv.shape[0], HV, V, dtype=qkv.dtype)
    qga.get_forward_context = lambda: types.SimpleNamespace(attn_metadata={PREFIX: md})
    if tree_step is None:
        qga.QwenGatedDeltaNetAttention._forward_core(layer, qkv, b, a, out)
    else:
        with gdn.tree_step(tree_step):
            qga.QwenGatedDeltaNetAttention._forward_core(layer, qkv, b, a, out)
    return out


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def install() -> None:
    """The CUDA build's bindings, then the three replacements over them."""
    conv_mod = _triton_conv_module()
    qga.QwenGatedDeltaNetAttention._forward_core = P._build_forward_core(
        qga.QwenGatedDeltaNetAttention._forward_core)
    qga.causal_conv1d_update = P._build_conv(conv_mod.causal_conv1d_update)
    qga.fused_sigmoid_gating_delta_rule_update = P._build_recurrent(
        qga.fused_sigmoid_gating_delta_rule_update)
    assert P.applied()


def check(dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    layer = _layer(dtype, gen)
    sizes = [len(t) for t in TREES]
    n_spec, t_spec = len(TREES), sum(sizes)
    total = t_spec + 1  # + one plain decode, last
    qkv = torch.randn(total, DIM, generator=gen).to(dtype)
    a = torch.randn(total, HV, generator=gen).to(dtype)
    b = torch.randn(total, HV, generator=gen).to(dtype)
    num_slots = 1 + (n_spec + 1) * (S + 1) + t_spec * (S + 1)
    conv0, ssm0 = _caches(num_slots, dtype, gen)
    rows = torch.arange(1, 1 + n_spec * (S + 1)).view(n_spec, S + 1).int()  # slot 0: null
    plain_slot = 1 + n_spec * (S + 1)
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)

    def tree_md():
        return GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=1, num_decode_tokens=1,
            num_spec_decodes=n_spec, num_spec_decode_tokens=t_spec, num_actual_tokens=total,
            spec_query_start_loc=_i32(cu), non_spec_query_start_loc=_i32([0, 1]),
            spec_state_indices_tensor=rows, non_spec_state_indices_tensor=_i32([plain_slot]),
            spec_sequence_masks=torch.tensor([True] * n_spec + [False]),
            spec_token_indx=torch.arange(t_spec), non_spec_token_indx=torch.tensor([t_spec]),
            num_accepted_tokens=_i32(NUM_ACCEPTED))

    parent_rows = torch.tensor([p for t in TREES for p in t] + [-1])

    def tree_run(parent):
        layer.kv_cache = (conv0.clone(), ssm0.clone())
        step = gdn.GDNTreeStep(parent)
        out = _run(layer, tree_md(), qkv, b, a, step)
        return out, layer.kv_cache, step

    # ---- stock chains: one per node, along its root-to-node path
    chains, chain_tok, chain_cu = [], [], [0]
    for r, tree in enumerate(TREES):
        for j in range(len(tree)):
            path, n = [], j
            while n >= 0:
                path.append(n)
                n = tree[n]
            path.reverse()
            chains.append((r, j, len(path)))
            chain_tok += [cu[r] + p for p in path]
            chain_cu.append(chain_cu[-1] + len(path))
    n_chain = len(chains)
    chain_rows = (plain_slot + 1 + torch.arange(n_chain * (S + 1))).view(n_chain, S + 1).int()
    conv_c, ssm_c = conv0.clone(), ssm0.clone()
    for c, (r, _, _) in enumerate(chains):  # each chain starts from its request's state
        conv_c[chain_rows[c].long()] = conv0[rows[r].long()]
        ssm_c[chain_rows[c].long()] = ssm0[rows[r].long()]
    layer.kv_cache = (conv_c, ssm_c)
    idx = torch.tensor(chain_tok)
    chain_md = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n_chain, num_spec_decode_tokens=len(chain_tok),
        num_actual_tokens=len(chain_tok), spec_query_start_loc=_i32(chain_cu),
        spec_state_indices_tensor=chain_rows,
        spec_sequence_masks=torch.ones(n_chain, dtype=torch.bool),
        num_accepted_tokens=_i32([NUM_ACCEPTED[r] for r, _, _ in chains]))
    chain_out = _run(layer, chain_md, qkv[idx], b[idx], a[idx])
    # the plain decode: the same mixed step, stock (no tree step), from the same
    # state (vLLM's own result for that row, which the tree step must not change)
    layer.kv_cache = (conv0.clone(), ssm0.clone())
    plain_out = _run(layer, tree_md(), qkv, b, a)[t_spec:]
    plain_ssm = layer.kv_cache[1][plain_slot].clone()

    def node_errors(out, ssm):
        err_o = err_s = 0.0
        for c, (r, j, length) in enumerate(chains):
            ref_o = chain_out[chain_cu[c + 1] - 1].float()
            ref_s = ssm_c[chain_rows[c, length - 1]]
            err_o = max(err_o, (out[cu[r] + j].float() - ref_o).abs().max().item())
            err_s = max(err_s, (ssm[rows[r, j]] - ref_s).abs().max().item())
        return err_o, err_s

    tree_out, (conv_t, ssm_t), step = tree_run(parent_rows)
    err_out, err_state = node_errors(tree_out, ssm_t)
    err_plain = max((tree_out[t_spec:].float() - plain_out.float()).abs().max().item(),
                    (ssm_t[plain_slot] - plain_ssm).abs().max().item())

    # ---- commit a random accepted path per request; compare with its chain
    paths = torch.full((n_spec + 1, S + 1), -1, dtype=torch.long)
    accepted = torch.zeros(n_spec + 1, dtype=torch.long)
    leaf = {}
    for r, tree in enumerate(TREES):
        j = int(torch.randint(1, len(tree), (1,), generator=gen))
        path, n = [], j
        while n >= 0:
            path.append(n)
            n = tree[n]
        path.reverse()
        paths[r, : len(path)] = torch.tensor(path)
        accepted[r] = len(path) - 1
        leaf[r] = j
    step.commit(paths, accepted)
    err_commit = 0.0
    for c, (r, j, length) in enumerate(chains):
        if r not in leaf or j != leaf[r]:
            continue
        slot, cslot = rows[r, 0].long(), chain_rows[c, 0].long()
        err_commit = max(err_commit, (ssm_t[slot] - ssm_c[chain_rows[c, length - 1]]).abs()
                         .max().item())
        # stock write-back: [prior tail (W - 2), x_0 .. x_n-1] from column 0, and
        # the next step reads its window at offset num_accepted - 1 = length - 1
        start = length - 1
        want = conv_c[cslot, start: start + W - 1].float()
        err_commit = max(err_commit, (conv_t[slot, : W - 1].float() - want).abs().max().item())

    # ---- the control: the same step with the parents dropped (a flat chain)
    flat = torch.tensor([j - 1 for t in TREES for j in range(len(t))] + [-1])
    dropped_out, (_, ssm_d), _ = tree_run(flat)
    drop_out, drop_state = node_errors(dropped_out, ssm_d)

    return {"dtype": str(dtype), "nodes": n_chain, "layers_recorded": sorted(step.layers),
            "err_out": err_out, "err_state": err_state, "err_plain": err_plain,
            "err_commit": err_commit, "dropped_err_out": drop_out,
            "dropped_err_state": drop_state}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", action="append", choices=["float32", "float16"])
    dtypes = ap.parse_args().dtype or ["float32", "float16"]
    install()
    print(json.dumps([check(getattr(torch, d)) for d in dtypes]))


if __name__ == "__main__":
    main()
