"""Shared builders for the tree-attention tests (plus checks of the builders).

Trees here are built from parent pointers with their own packing code, so the
tests do not depend on the mask logic under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_ddtree.kernels.cache_layout import split_kv_cache_cpu_vec, split_kv_cache_nhd

LAYOUTS = ("nhd", "cpu_vec")


def make_parents(n: int, gen: torch.Generator, shape: str = "random") -> list[int]:
    """Parent pointers of an n-node tree (node 0 is the root, parent < child)."""
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        elif shape == "random":
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
        else:
            raise ValueError(shape)
    return parents


def ancestor_sets(parents: list[int]) -> list[int]:
    """anc[i] = anc[parent[i]] | bit(i), as Python ints."""
    anc: list[int] = []
    for i, p in enumerate(parents):
        anc.append((anc[p] if p >= 0 else 0) | (1 << i))
    return anc


def pack_words(bits: list[int], num_words: int) -> torch.Tensor:
    """Little-endian int32 packing: bit j -> word j // 32, bit j % 32."""
    rows = []
    for a in bits:
        row = []
        for w in range(num_words):
            word = (a >> (32 * w)) & 0xFFFFFFFF
            row.append(word - (1 << 32) if word >= (1 << 31) else word)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32).view(len(bits), num_words)


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node (root 0), from the parent pointers."""
    depth: list[int] = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 0)
    return depth


def root_path(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@dataclass
class Req:
    ctx: int
    q_len: int
    parents: list[int] | None = None  # None: causal request

    @property
    def seq_len(self) -> int:
        return self.ctx + self.q_len


@dataclass
class Batch:
    reqs: list[Req]
    query: torch.Tensor
    kv_cache: torch.Tensor  # the raw per-layer tensor
    key_cache: torch.Tensor  # [nb, bs, Hkv, D] view
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    tree_mask: torch.Tensor
    is_tree: torch.Tensor
    depth: torch.Tensor  # [num_tokens] int32 node depth of tree rows (garbage elsewhere)
    keys: list[torch.Tensor]  # dense per request [seq_len, Hkv, D]
    values: list[torch.Tensor]
    scale: float

    def args(self):
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.tree_mask,
            self.is_tree,
        )

    @property
    def max_query_len(self) -> int:
        return max(r.q_len for r in self.reqs)


def kv_views(layout: str, num_blocks, block_size, num_kv_heads, head_size, dtype, device):
    """Allocate a NaN-filled cache in a physical layout; return (raw, K, V)."""
    shape_hnd = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    if layout == "nhd":  # CUDA default: token-major blocks, seen as logical HND
        raw = torch.full(
            (num_blocks, block_size, num_kv_heads, 2 * head_size),
            float("nan"),
            dtype=dtype,
            device=device,
        )
        kv = raw.permute(0, 2, 1, 3)
        k, v = split_kv_cache_nhd(kv)
        return kv, k, v
    raw = torch.full(shape_hnd, float("nan"), dtype=dtype, device=device)
    if layout == "hnd":
        k, v = split_kv_cache_nhd(raw)
    elif layout == "cpu_vec":
        k, v = split_kv_cache_cpu_vec(raw)
    else:
        raise ValueError(layout)
    return raw, k, v


def build_batch(
    reqs: list[Req],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    layout: str,
    device: str = "cpu",
    seed: int = 0,
    pad_tokens: int = 0,
    num_words: int | None = None,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(r.seq_len / block_size) for r in reqs]
    max_blocks = max(max(n_blocks), 1) + 1
    num_blocks = sum(n_blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(n_blocks):
        block_table[i, :nb] = perm[used : used + nb].int()
        # trailing entries point at other requests' blocks: never read
        block_table[i, nb:] = perm[(used + nb) % num_blocks]
        used += nb

    kv, key_cache, value_cache = kv_views(
        layout, num_blocks, block_size, num_kv_heads, head_size, dtype, device
    )
    keys, values = [], []
    for i, r in enumerate(reqs):
        k = torch.randn(r.seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(r.seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        pos = torch.arange(r.seq_len)
        blk = block_table[i][pos // block_size].long()
        key_cache[blk.to(device), (pos % block_size).to(device)] = k.to(device)
        value_cache[blk.to(device), (pos % block_size).to(device)] = v.to(device)
        keys.append(k)
        values.append(v)

    q_lens = [r.q_len for r in reqs]
    num_tokens = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(num_tokens + pad_tokens, num_q_heads, head_size, generator=gen)

    max_tree = max([r.q_len for r in reqs if r.parents is not None], default=1)
    if num_words is None:
        num_words = max(1, math.ceil(max_tree / 32))
    # rows of causal requests and padding hold garbage that must be ignored
    mask = torch.randint(
        -(2**31), 2**31 - 1, (num_tokens + pad_tokens, num_words), generator=gen,
        dtype=torch.int32,
    )  # fmt: skip
    for i, r in enumerate(reqs):
        if r.parents is not None:
            assert len(r.parents) == r.q_len
            mask[qsl[i] : qsl[i + 1]] = pack_words(ancestor_sets(r.parents), num_words)
    is_tree = torch.tensor([r.parents is not None for r in reqs], dtype=torch.bool)
    depth = torch.randint(0, 1000, (num_tokens + pad_tokens,), generator=gen,
                          dtype=torch.int32)
    for i, r in enumerate(reqs):
        if r.parents is not None:
            depth[qsl[i] : qsl[i + 1]] = torch.tensor(node_depths(r.parents))

    return Batch(
        reqs=reqs,
        query=query.to(dtype).to(device),
        kv_cache=kv,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor([r.seq_len for r in reqs], dtype=torch.int32).to(device),
        tree_mask=mask.to(device),
        is_tree=is_tree.to(device),
        depth=depth.to(device),
        keys=keys,
        values=values,
        scale=head_size**-0.5,
    )


FP8_TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize_batch(batch: Batch, layout: str, kind: str, k_scale: float,
                   v_scale: float) -> Batch:
    """``batch`` with its cache replaced by fp8 codes (``uint8``, same layout)
    of its K/V over per-tensor scales, rounded to nearest by torch's float8
    types; the dense ``keys``/``values`` become the dequantized fp64 values.
    Never-written slots (NaN in the float cache) get NaN codes."""
    num_blocks, block_size, num_kv_heads, head_size = batch.key_cache.shape
    dev = batch.key_cache.device
    if layout == "nhd":
        raw = torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size,
                          dtype=torch.uint8, device=dev).permute(0, 2, 1, 3)
        k_u8, v_u8 = split_kv_cache_nhd(raw, head_size)
    elif layout == "cpu_vec":
        raw = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size,
                          dtype=torch.uint8, device=dev)
        k_u8, v_u8 = split_kv_cache_cpu_vec(raw)
    else:
        raise ValueError(layout)
    f8 = FP8_TORCH_DTYPES[kind]
    k_u8.copy_((batch.key_cache.float() / k_scale).to(f8).view(torch.uint8))
    v_u8.copy_((batch.value_cache.float() / v_scale).to(f8).view(torch.uint8))
    batch.kv_cache, batch.key_cache, batch.value_cache = raw, k_u8, v_u8
    batch.keys = [(k.float() / k_scale).to(f8).double() * k_scale for k in batch.keys]
    batch.values = [(v.float() / v_scale).to(f8).double() * v_scale for v in batch.values]
    return batch


def path_attention(batch: Batch, req_idx: int, node: int) -> torch.Tensor:
    """fp64 attention of one tree node over context + its root-to-node path,
    from the dense K/V (no paging, no mask): ``[num_q_heads, head_size]``."""
    r = batch.reqs[req_idx]
    assert r.parents is not None
    keep = list(range(r.ctx)) + [r.ctx + j for j in root_path(r.parents, node)]
    k = batch.keys[req_idx][keep].double()  # [L, Hkv, D]
    v = batch.values[req_idx][keep].double()
    q = batch.query[int(batch.query_start_loc[req_idx]) + node].double().cpu()
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * batch.scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


# Checks of the builders themselves.


def test_pack_words_little_endian():
    packed = pack_words([1, 1 << 31, 1 << 32, (1 << 33) | 1], 2)
    assert packed.tolist() == [[1, 0], [-(2**31), 0], [0, 1], [1, 2]]


def test_ancestor_sets_and_paths():
    parents = [-1, 0, 0, 1, 3, 2]
    anc = ancestor_sets(parents)
    assert anc[4] == 0b11011
    assert anc[5] == 0b100101
    assert root_path(parents, 4) == [0, 1, 3, 4]
    gen = torch.Generator().manual_seed(0)
    for shape in ("random", "chain", "star"):
        ps = make_parents(40, gen, shape)
        assert all(0 <= p < i for i, p in enumerate(ps) if i > 0)
        for i in range(40):
            assert sum(1 << j for j in root_path(ps, i)) == ancestor_sets(ps)[i]


def test_compaction_moves_only_the_named_layers():
    """Targets whose layers sit in several KV-cache groups are compacted group
    by group: each call moves the layers of one group by that group's slots."""
    from types import SimpleNamespace

    from vllm_ddtree.core.compaction import KVCapture

    class Impl:
        tree_kv_quant = None

        def tree_kv_views(self, cache):
            return cache[0], cache[1]

        def do_kv_cache_update(self, layer, key, value, cache, slots):
            bs = cache.shape[2]
            cache[0][slots // bs, slots % bs] = key
            cache[1][slots // bs, slots % bs] = value

    impl = Impl()
    caches = {n: torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 1, 3) + i
              for i, n in enumerate(("a", "b"))}
    before = {n: c.clone() for n, c in caches.items()}
    cap = KVCapture()
    cap.start(["a", "b"])
    for n, c in caches.items():
        cap.record(impl, SimpleNamespace(layer_name=n), c)
    cap.stop()
    assert cap.compact(torch.tensor([6]), torch.tensor([1]), layers=["a"]) == 1
    assert torch.equal(caches["a"][0][0, 1], before["a"][0][1, 2])  # slot 6 -> slot 1
    assert torch.equal(caches["b"], before["b"])  # the other group is untouched
