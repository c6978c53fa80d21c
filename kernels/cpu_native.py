"""The native CPU kernels (``tree_attention_cpu.c``): build, load, call.

Four entry points: tree attention over vLLM's paged CPU cache
(:func:`tree_attention_native`), tree construction (:func:`build_tree_native`,
the same trees as :func:`vllm_ddtree.core.tree.build_tree`), KV compaction
(:func:`move_slots_native`) and a Gated DeltaNet layer's tree verification,
convolution and recurrence in one call (:func:`gdn_tree_native`). The file is plain C with no Python or torch headers, so it compiles in a
second or two with the system C compiler (the one vLLM CPU's torch.compile
needs anyway). It is built on first use into a per-user cache directory
(``$VLLM_DDTREE_CACHE``, default ``~/.cache/vllm_ddtree``), under a name that
hashes the source, the compiler command and the CPU, so that a changed source
or another machine never loads a stale build. The build writes to a
temporary file and renames it, so concurrent engines do not race.

:func:`load` returns None (and says why once, through vLLM's logger when
available) when no compiler is found or the build fails; the CPU backend then
falls back to the batched torch path, which is correct but slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllm_ddtree.kernels.fp8 import check_kv_quant
from vllm_ddtree.kernels.reference import check_sinks, check_sliding_window

__all__ = ["ENV_CACHE", "ENV_DISABLE", "NativeKernels", "build_tree_native", "gdn_tree_native",
           "load", "move_slots_native", "tree_attention_native"]

ENV_CACHE = "VLLM_DDTREE_CACHE"
ENV_DISABLE = "VLLM_DDTREE_NO_NATIVE"
SOURCE = Path(__file__).with_name("tree_attention_cpu.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu11"]
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FP8_KV_CODES = {"e4m3": 2, "e5m2": 3}  # uint8 caches, by kv_quant

logger = logging.getLogger("vllm.ddtree")

_LOADED: dict[str, object] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "vllm_ddtree")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


class NativeKernels:
    """The loaded shared library, its entry points typed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        attn = lib.ddtree_tree_attention
        f32 = ctypes.c_float
        attn.argtypes = [p, i64, i64, p, i32, i64, i64, i64, p, i64, p, p, p, i64, p, i64, i64,
                         f32, f32, f32, i64, p, p, p, i64, i64]
        attn.restype = ctypes.c_int
        build = lib.ddtree_build_tree
        build.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, p]
        build.restype = ctypes.c_int
        move = lib.ddtree_move_slots
        move.argtypes = [p, i64, i64, i64, i64, i64, i64, p, p, i64]
        move.restype = ctypes.c_int
        gdn = lib.ddtree_gdn_tree
        gdn.argtypes = [p, i32, i64,  # x
                        p, i32, i64, i64, i64, i64,  # conv buffer
                        p, i32, p, i32, i64, i32,  # conv weight, bias, width, silu
                        p, p, i32, p, i32, p, i32,  # a, b, A_log, dt_bias
                        p, i32, i64, i64,  # ssm state
                        p, p, p, i64, p, i64,  # parent, cu, idx, num_acc
                        i64, i64, i64, i64, f32, p, i32, p, p, p]
        gdn.restype = ctypes.c_int
        self.attention = attn
        self.build_tree = build
        self.move_slots = move
        self.gdn_tree = gdn
        self._lib = lib


def build(compiler: str | None = None) -> Path:
    """Compile the kernel (or find the cached build) and return its path."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *FLAGS]).encode() + _cpu_id().encode())
    out = _cache_dir() / f"tree_attention_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> NativeKernels | None:
    """The kernel, built on first use; None (reason logged once) when it
    cannot be built or ``VLLM_DDTREE_NO_NATIVE=1``."""
    if "lib" in _LOADED:
        return _LOADED["lib"]  # type: ignore[return-value]
    lib = None
    if os.environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        logger.info("DDTree: native CPU tree attention disabled by %s; using the torch path",
                    ENV_DISABLE)
    else:
        try:
            lib = NativeKernels(build())
        except Exception as e:  # any build or load failure: fall back, loudly
            logger.warning("DDTree: the native CPU kernels are unavailable (%s); tree "
                           "attention and tree construction use the slower torch paths", e)
    _LOADED["lib"] = lib
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def tree_attention_native(
    lib: NativeKernels,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_reqs: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
    kv_quant: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Write the rows of the requests ``tree_reqs`` (int64) of ``output``.

    ``query``/``output``: ``[num_tokens, Hq, D]`` float32 with a unit stride
    in D; ``kv_cache``: one layer's contiguous "vec" cache ``[num_blocks, Hk,
    block_size, 2 * D]`` (float32 or bfloat16, or uint8 fp8 codes with
    ``kv_quant`` "e4m3" or "e5m2" and the per-tensor ``k_scale``/``v_scale``,
    see ``kernels/fp8.py``); ``block_table`` ``[R, *]``,
    ``query_start_loc`` ``[R + 1]`` and ``seq_lens`` ``[R]`` int32;
    ``tree_mask`` ``[num_tokens, W]`` int32, contiguous. ``sliding_window``
    (None or -1: none), ``sinks`` (float ``[Hq]``, any float dtype) and
    ``depth`` (int32 ``[num_tokens]``, contiguous; required with a window)
    as in :func:`~vllm_ddtree.kernels.reference.tree_attention_reference`.
    """
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    for name, t, dtype in (("query", query, torch.float32), ("output", output, torch.float32),
                           ("block_table", block_table, torch.int32),
                           ("query_start_loc", query_start_loc, torch.int32),
                           ("seq_lens", seq_lens, torch.int32),
                           ("tree_reqs", tree_reqs, torch.int64),
                           ("tree_mask", tree_mask, torch.int32)):
        if t.dtype != dtype or t.device.type != "cpu":
            raise TypeError(f"tree_attention_native: {name} must be a CPU {dtype} tensor, "
                            f"got {t.dtype} on {t.device}")
    check_kv_quant(kv_quant, k_scale, v_scale, kv_cache.dtype)
    if (kv_quant is None and kv_cache.dtype not in KV_DTYPES) or not kv_cache.is_contiguous():
        raise TypeError(f"tree_attention_native: kv_cache must be a contiguous float32, "
                        f"bfloat16 or uint8 (fp8 codes) tensor, got {kv_cache.dtype}")
    if query.stride(2) != 1 or output.stride(2) != 1 or query.shape[2] != head_size:
        raise ValueError("tree_attention_native: query/output must be [tokens, heads, "
                         f"{head_size}] with a unit stride in the last dimension")
    for name, t in (("block_table", block_table), ("tree_mask", tree_mask)):
        if t.stride(1) != 1:
            raise ValueError(f"tree_attention_native: {name} must have unit column stride")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()
            and tree_reqs.is_contiguous()):
        raise ValueError("tree_attention_native: query_start_loc, seq_lens and tree_reqs "
                         "must be contiguous")
    window = check_sliding_window(sliding_window)
    check_sinks(sinks, query.shape[1], query.device)
    if window is not None:
        if (depth is None or depth.dtype != torch.int32 or depth.device.type != "cpu"
                or depth.dim() != 1 or not depth.is_contiguous()
                or depth.shape[0] < query.shape[0]):
            raise ValueError(
                "tree_attention_native: depth: a sliding window needs each tree row's node "
                f"depth as a contiguous CPU int32 [num_tokens={query.shape[0]}] tensor, got "
                f"{None if depth is None else (depth.dtype, tuple(depth.shape))}")
    sinks32 = None if sinks is None else sinks.to(torch.float32).contiguous()
    status = lib.attention(
        _ptr(query), query.stride(0), query.stride(1),
        _ptr(kv_cache),
        KV_DTYPES[kv_cache.dtype] if kv_quant is None else FP8_KV_CODES[kv_quant],
        num_kv_heads, block_size, head_size,
        _ptr(block_table), block_table.stride(0),
        _ptr(query_start_loc), _ptr(seq_lens), _ptr(tree_reqs), tree_reqs.numel(),
        _ptr(tree_mask), tree_mask.shape[1], query.shape[1], float(scale), float(k_scale),
        float(v_scale),
        window or 0, None if window is None else _ptr(depth),
        None if sinks32 is None else _ptr(sinks32),
        _ptr(output), output.stride(0), output.stride(1),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            {-1: "bad head counts, block size, cache dtype or window",
             -2: "a tree request's query is longer than its sequence or its mask",
             -3: "out of memory"}.get(status, f"status {status}")
            + " (tree_attention_native)")
    return output


def build_tree_native(lib: NativeKernels, logprobs: torch.Tensor, budget: int,
                      budgets: torch.Tensor | None = None):
    """:func:`vllm_ddtree.core.tree.build_tree` on CPU in one native call.

    ``logprobs`` is the drafter's log-softmax ``[b, K, V]`` (float32, CPU);
    returns ``(tokens, parents, depth, logq, valid)`` as ``build_tree`` does
    (the same trees; prefixes whose scores tie exactly may come in another
    order). ``budgets`` (optional ``[b]`` int64) as in ``build_tree``."""
    if logprobs.dtype != torch.float32 or logprobs.device.type != "cpu" or logprobs.dim() != 3:
        raise TypeError(f"build_tree_native: logprobs must be a CPU float32 [b, K, V] "
                        f"tensor, got {logprobs.dtype} {tuple(logprobs.shape)} on "
                        f"{logprobs.device}")
    lp = logprobs.contiguous()
    b, num_levels, vocab = lp.shape
    budget = int(budget)
    if budgets is not None:
        budgets = budgets.to(device="cpu", dtype=torch.int64).contiguous()
    tokens = torch.empty(b, budget, dtype=torch.int64)
    parents = torch.empty(b, budget, dtype=torch.int64)
    depth = torch.empty(b, budget, dtype=torch.int64)
    logq = torch.empty(b, budget, dtype=torch.float32)
    valid = torch.empty(b, budget, dtype=torch.bool)
    status = lib.build_tree(_ptr(lp), b, num_levels, vocab, budget,
                            None if budgets is None else _ptr(budgets), _ptr(tokens),
                            _ptr(parents), _ptr(depth), _ptr(logq), _ptr(valid))
    if status != 0:
        raise ValueError(f"build_tree_native: status {status} (bad sizes or out of memory)")
    return tokens, parents, depth, logq, valid


def move_slots_native(lib: NativeKernels, caches: list[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """Copy the K/V at cache slots ``src_slots`` to ``dst_slots`` in every
    cache of ``caches`` (each one layer's contiguous "vec" cache ``[num_blocks,
    Hk, block_size, 2 * D]``, all of one shape and dtype: 1-, 2- or 4-byte
    elements, so an fp8 cache's codes move as bytes). All sources of a layer
    are read before any destination is written."""
    if not caches:
        return
    first = caches[0]
    for c in caches:
        if (c.shape != first.shape or c.dtype != first.dtype or not c.is_contiguous()
                or c.device.type != "cpu" or c.element_size() not in (1, 2, 4)):
            raise TypeError("move_slots_native: caches must be contiguous CPU tensors of one "
                            "shape and a 1-, 2- or 4-byte dtype")
    num_blocks, num_kv_heads, block_size, two_d = first.shape
    src = src_slots.to(torch.int64).contiguous()
    dst = dst_slots.to(torch.int64).contiguous()
    if src.shape != dst.shape:
        raise ValueError("move_slots_native: src_slots and dst_slots differ in shape")
    ptrs = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
    status = lib.move_slots(ptrs, len(caches), first.element_size(), num_blocks, num_kv_heads,
                            block_size, two_d // 2, _ptr(src), _ptr(dst), src.numel())
    if status != 0:
        raise ValueError({-2: "a slot is outside the cache"}.get(
            status, f"status {status}") + " (move_slots_native)")


_GDN_ERRORS = {
    -1: "inconsistent sizes (dim must be 2 * H * K + HV * V, HV a multiple of H, K of 4, V of 16; "
        "conv width 2..64)",
    -2: "cu_seqlens is not ascending from 0",
    -3: "a sequence has more tokens than its state-index row or conv buffer holds",
    -4: "num_accepted is outside 1 .. the state-index row (or past the conv buffer)",
    -5: "a state index is outside the state cache",
    -6: "a parent does not come before its child (or a sequence's first token is not "
        "its root)",
    -7: "out of memory",
}
_GDN_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_CONV_WIDTH = 64


def _gdn_code(name: str, t: torch.Tensor) -> int:
    if t.dtype not in _GDN_DTYPES or t.device.type != "cpu":
        raise TypeError(f"gdn_tree_native: {name} must be a float32 or bfloat16 CPU tensor, "
                        f"got {t.dtype} on {t.device}")
    return _GDN_DTYPES[t.dtype]


def gdn_tree_native(lib: NativeKernels, mixed_qkv: torch.Tensor, conv_buf: torch.Tensor,
                    conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, silu: bool,
                    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    ssm_state: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor,
                    state_indices: torch.Tensor, num_accepted: torch.Tensor,
                    num_k_heads: int, head_k: int, head_v: int) -> torch.Tensor:
    """One Gated DeltaNet layer's speculative tokens as trees, convolution and
    recurrence in one native call; returns ``o[T, HV, V]`` (dtype of
    ``mixed_qkv``) and updates ``conv_buf`` and ``ssm_state`` in place.

    ``mixed_qkv`` ``[T, 2 H K + HV V]`` (q, k, v packed as vLLM's
    ``rearrange_mixed_qkv`` splits them), ``conv_buf`` ``[slots, dim,
    state_len]`` (any strides), ``conv_weight`` ``[dim, W]``, ``a``/``b``
    ``[T, HV]``, ``ssm_state`` ``[slots, HV, K, V]`` (vLLM CPU's view; each slot
    contiguous, any slot stride),
    ``parent`` ``[T]`` local parents (-1: root), ``cu_seqlens`` ``[N + 1]``,
    ``state_indices`` ``[N, S + 1]``, ``num_accepted`` ``[N]``. The semantics
    are :func:`kernels.gdn_tree_reference.tree_conv_update_ref` and
    ``tree_recurrent_update_ref`` (C source header)."""
    x = mixed_qkv.contiguous()
    total, dim = x.shape
    width = conv_weight.shape[-1]
    if not 2 <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"gdn_tree_native: conv width {width} outside 2..{MAX_CONV_WIDTH}")
    if ssm_state.dim() != 4 or not ssm_state[0].is_contiguous():
        raise TypeError("gdn_tree_native: ssm_state must be [slots, HV, K, V] with each slot "
                        "contiguous")
    num_slots, num_v_heads, k, v = ssm_state.shape
    if (k, v) != (head_k, head_v):
        raise ValueError(f"gdn_tree_native: ssm_state heads are {k}x{v}, expected "
                         f"{head_k}x{head_v}")
    w = conv_weight.reshape(dim, width).contiguous()
    bias = None if conv_bias is None else conv_bias.contiguous()
    a_c, b_c = a.contiguous(), b.contiguous()
    if a_c.dtype != b_c.dtype:
        b_c = b_c.to(a_c.dtype)
    a_log, dtb = A_log.contiguous(), dt_bias.contiguous()
    par = parent.to(torch.int32).contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    idx = state_indices.to(torch.int32).contiguous()
    nacc = num_accepted.to(torch.int32).contiguous()
    nseq = idx.shape[0]
    if (cu.numel() != nseq + 1 or nacc.numel() < nseq or par.numel() < total
            or int(cu[-1]) != total):
        raise ValueError("gdn_tree_native: cu_seqlens, num_accepted and parent do not match "
                         f"the state-index rows and tokens ({nseq} rows, {total} tokens, "
                         f"cu_seqlens ending at {int(cu[-1])})")
    out = torch.empty(total, num_v_heads, head_v, dtype=x.dtype)
    scratch = torch.empty(total, dim, dtype=torch.float32)
    gates = torch.empty(total, num_v_heads, 2, dtype=torch.float32)
    tok_seq = torch.empty(total, dtype=torch.int32)
    cb_slot, cb_dim, cb_col = conv_buf.stride()
    status = lib.gdn_tree(
        _ptr(x), _gdn_code("mixed_qkv", x), dim,
        _ptr(conv_buf), _gdn_code("conv_buf", conv_buf), cb_slot, cb_dim, cb_col,
        conv_buf.shape[-1],
        _ptr(w), _gdn_code("conv_weight", w), None if bias is None else _ptr(bias),
        0 if bias is None else _gdn_code("conv_bias", bias), width, int(bool(silu)),
        _ptr(a_c), _ptr(b_c), _gdn_code("a", a_c), _ptr(a_log), _gdn_code("A_log", a_log),
        _ptr(dtb), _gdn_code("dt_bias", dtb),
        _ptr(ssm_state), _gdn_code("ssm_state", ssm_state), num_slots, ssm_state.stride(0),
        _ptr(par), _ptr(cu), _ptr(idx), idx.shape[1], _ptr(nacc), nseq,
        num_k_heads, num_v_heads, head_k, head_v, float(head_k ** -0.5),
        _ptr(out), _gdn_code("out", out), _ptr(scratch), _ptr(gates), _ptr(tok_seq))
    if status != 0:
        raise ValueError(f"gdn_tree_native: {_GDN_ERRORS.get(status, f'status {status}')}")
    return out
