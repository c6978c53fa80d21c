"""vLLM attention backends for DDTree tree verification.

Contract with the model runner
------------------------------
For a verification step the runner attaches a
:class:`~vllm_ddtree.core.tree_info.TreeAttentionInfo` to the target model's
per-layer attention metadata object (``attn_metadata.ddtree``, see
``vllm_ddtree/core/round.py``). A missing or ``None`` ``ddtree`` attribute means
"no tree in this step", and then every backend here behaves exactly like
stock vLLM. Every impl here derives from :class:`TreeAttentionImplMixin`,
which is what the runner's start-up guard looks for on each target layer.

Backends
--------
* CPU: vLLM always picks ``CPU_ATTN`` there, so :func:`register_backends`
  overrides that enum member with :class:`DDTreeCPUAttentionBackend`. Without
  tree info its forward is the stock one. With tree info, if some requests are
  not trees the stock C++ op runs on the whole batch first (so non-tree rows
  are bit-identical to stock), then the tree requests' rows are recomputed and
  overwritten: in torch, batched over the tree requests
  (``kernels/tree_attention_cpu.py``, checked against the reference), or by
  the Triton kernel in Triton's interpreter when
  ``VLLM_DDTREE_CPU_ATTN=triton`` (which needs ``TRITON_INTERPRET=1`` in the
  environment before the kernel is imported).
  The tree path reads the paged cache through strided views of the "vec"
  layout; when ``speculative_config.ddtree`` is set the metadata builder turns
  the AMX layout (bf16 on AMX CPUs) into "vec".
* CUDA: :func:`register_backends` adds a ``DDTREE`` backend, a subclass of
  ``TRITON_ATTN`` whose forward runs the Triton tree kernel on the whole batch
  when tree info is present and the stock kernel otherwise.

The tree paths also read an fp8 KV cache (``uint8`` codes and the layer's
per-tensor ``_k_scale_float``/``_v_scale_float``, fixed once the weights are
loaded), decoding and scaling as vLLM's own ops do (``kernels/fp8.py``): on
CPU ``--kv-cache-dtype fp8``, ``fp8_e4m3`` and ``fp8_e5m2``; on CUDA ``fp8``
and ``fp8_e4m3`` (vLLM's Triton backend reads every fp8 cache as e4m3), with
the queries kept in the model dtype (``supports_quant_query_input`` off, so
vLLM does not quantize them; the stock kernel takes them as they are).

Both tree paths serve sliding-window layers (the window counted in logical
positions, so a tree node at depth ``d`` measures it from ``ctx_len + d``,
see ``kernels/reference.py``) and per-head attention sinks, with vLLM's
semantics for both.

Both impls report each cache write (``do_kv_cache_update``) and each forward
that applied a tree mask to :data:`~vllm_ddtree.core.compaction.kv_capture`, and
expose their cache as strided K/V views (``tree_kv_views``), so the round can
compact accepted nodes' K/V by slot with the backend's own cache write and
prove every target layer took the tree path.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_ddtree.core.compaction import kv_capture
from vllm_ddtree.core.config import ddtree_runtime
from vllm_ddtree.kernels import cpu_native
from vllm_ddtree.kernels.cache_layout import split_kv_cache_cpu_vec, split_kv_cache_nhd
from vllm_ddtree.kernels.fp8 import KV_CACHE_DTYPE_KINDS, kv_quant_of
from vllm_ddtree.kernels.tree_attention_cpu import (
    TreeBatchPlan,
    plan_tree_batch,
    tree_attention_batched,
)
from vllm_ddtree.core.tree_info import TreeAttentionInfo, get_tree_info

try:  # importable on CPU hosts too; only run on CUDA
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadataBuilder,
    )
except ImportError:  # pragma: no cover - depends on the vLLM build
    TritonAttentionBackend = None  # type: ignore[assignment,misc]
    TritonAttentionImpl = None  # type: ignore[assignment,misc]
    TritonAttentionMetadataBuilder = None  # type: ignore[assignment,misc]

logger = init_logger("vllm.ddtree")

__all__ = [
    "ENV_CPU_ATTN",
    "CPU_BACKEND_PATH",
    "CUDA_BACKEND_NAME",
    "CUDA_BACKEND_PATH",
    "TreeAttentionImplMixin",
    "register_backends",
    "tree_cpu_isa",
    "DDTreeCPUAttentionBackend",
    "DDTreeCPUAttentionImpl",
    "DDTreeCPUAttentionMetadataBuilder",
]

ENV_CPU_ATTN = "VLLM_DDTREE_CPU_ATTN"
CPU_BACKEND_PATH = "vllm_ddtree.attention.DDTreeCPUAttentionBackend"
CUDA_BACKEND_NAME = "DDTREE"
CUDA_BACKEND_PATH = "vllm_ddtree.attention.DDTreeTritonAttentionBackend"
CPU_TREE_ISAS = ("vec", "vec16")
UNQUANTIZED_TREE_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# fp8 KV caches the CUDA tree path reads: vLLM's Triton backend views every
# fp8 cache as the platform's e4m3 type, so fp8_e5m2 codes are not its format.
CUDA_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


# ---------------------------------------------------------------------------
# Shared tree dispatch
# ---------------------------------------------------------------------------


class TreeAttentionImplMixin:
    """What makes an attention impl tree-capable: the runner's start-up guard
    requires it on every target layer, and its methods are shared by the CPU
    and CUDA impls."""

    #: the ``kv_cache_dtype`` values the impl's tree path reads
    TREE_KV_CACHE_DTYPES: ClassVar[tuple[str, ...]] = UNQUANTIZED_TREE_KV_CACHE_DTYPES

    def tree_unsupported_reason(self) -> str | None:
        """The layer feature the tree path cannot serve, or None. Checked once
        per target layer at start-up (the engine refuses to start)."""
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.logits_soft_cap:
            return "logits soft-capping"
        if self.kv_cache_dtype not in self.TREE_KV_CACHE_DTYPES:
            return f"kv_cache_dtype {self.kv_cache_dtype}"
        return None

    @property
    def tree_kv_quant(self) -> str | None:
        """The cache's fp8 kind ("e4m3", "e5m2"), or None when it is not
        quantized; KV compaction then moves its codes as bytes."""
        return kv_quant_of(self.kv_cache_dtype)

    def tree_kv_scales(self, layer) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``'s cache for the tree kernels:
        the layer's per-tensor fp8 scales, read at every step as vLLM's own
        op reads them; 1.0 for an unquantized cache."""
        if self.tree_kv_quant is None:
            return 1.0, 1.0
        return layer._k_scale_float, layer._v_scale_float

    def tree_sliding_window(self) -> int | None:
        """The layer's window as the number of positions a query sees (itself
        included), or None. The CPU impl keeps vLLM's int (-1: none); the
        Triton impl keeps a decoder layer's as ``(window - 1, 0)`` (``(-1,
        -1)``: none)."""
        window = self.sliding_window
        if window in (-1, (-1, -1), None):
            return None
        if isinstance(window, tuple):
            return window[0] + 1
        return window

    def _step_unsupported_reason(self, attn_metadata: Any, output_scale,
                                 output_block_scale) -> str | None:
        if output_scale is not None or output_block_scale is not None:
            return "fused output quantization"
        causal = attn_metadata.causal
        if not (isinstance(causal, bool) and causal):
            return "non-causal attention"
        return None

    def _check_tree_step(self, layer, attn_metadata, output_scale, output_block_scale):
        reason = (self.tree_unsupported_reason()
                  or self._step_unsupported_reason(attn_metadata, output_scale,
                                                   output_block_scale))
        if reason is not None:
            raise NotImplementedError(
                f"ddtree tree attention does not support {reason} "
                f"({type(self).__name__}, layer {layer.layer_name})")
        kv_capture.saw_tree(layer.layer_name)
        get_tree_info(attn_metadata).mark_seen(layer.layer_name)

    _tree_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tree_kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of this layer's cache as ``[num_blocks, block_size, Hk, D]``
        strided views (the tree path and KV compaction read the cache by
        slot); made once per cache tensor."""
        views = self._tree_views
        if views is None or views[0] is not kv_cache:
            views = self._tree_views = (kv_cache, *self._split_kv_cache(kv_cache))
        return views[1], views[2]

    def _split_kv_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[misc]
        if kv_capture.active:
            kv_capture.record(self, layer, kv_cache)


def _cpu_tree_mode() -> str:
    mode = os.environ.get(ENV_CPU_ATTN, "torch").strip().lower() or "torch"
    if mode not in ("torch", "triton"):
        raise ValueError(f"{ENV_CPU_ATTN} must be 'torch' or 'triton', got {mode!r}")
    return mode


def _interpreter_kernel_module():
    """The Triton kernel module, checked to be running in the interpreter."""
    flag = os.environ.get("TRITON_INTERPRET", "").strip().lower()
    if flag not in ("1", "true", "yes", "on"):
        raise RuntimeError(
            f"{ENV_CPU_ATTN}=triton runs the Triton tree-attention kernel in "
            "Triton's interpreter, which needs TRITON_INTERPRET=1 in the "
            "environment before anything imports triton. Set both variables "
            f"when launching, or unset {ENV_CPU_ATTN} to use the torch path."
        )
    from vllm_ddtree.kernels import tree_attention as ta

    if not ta.INTERPRETED:
        raise RuntimeError(
            f"{ENV_CPU_ATTN}=triton: TRITON_INTERPRET=1 was set after "
            "vllm_ddtree.kernels.tree_attention had been imported, so its "
            "kernel is not interpreted. Set TRITON_INTERPRET=1 before the "
            "process starts."
        )
    return ta


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------


def tree_cpu_isa(isa: str, ddtree_enabled: bool) -> str:
    """The CPU attention ISA to use; with ddtree on, one whose KV layout the
    tree path can read through strides ("vec"/"vec16"; AMX becomes "vec")."""
    if not ddtree_enabled or isa in CPU_TREE_ISAS:
        return isa
    if isa == "amx":
        return "vec"
    raise NotImplementedError(
        f"ddtree on CPU reads the KV cache in the vec/vec16 layout; the "
        f"attention ISA {isa!r} of this CPU is not supported"
    )


class DDTreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Stock builder; with ddtree on, forces a stride-readable KV layout."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        isa = tree_cpu_isa(self.isa, ddtree_runtime(vllm_config) is not None)
        if isa != self.isa:
            logger.info_once(
                "ddtree: CPU attention uses the %r KV layout instead of %r so "
                "tree rows can read the paged cache",
                isa,
                self.isa,
            )
            self.isa = isa
            self._set_isa_to_layers(layer_names)


def _step_plan(info: TreeAttentionInfo, attn_metadata, block_size: int,
               window: int | None) -> TreeBatchPlan:
    """The step's batched tree plan, built by the first layer and reused by
    the others with the same block table and window."""
    key = (attn_metadata.block_table.data_ptr(), block_size, window)
    plan = info.plans.get(key)
    if plan is None:
        plan = plan_tree_batch(attn_metadata.query_start_loc, attn_metadata.seq_lens,
                               attn_metadata.block_table, block_size, info.mask,
                               info.tree_reqs(), num_q=info.max_tree_query_len,
                               max_seq_len=attn_metadata.max_seq_len,
                               sliding_window=window, depth=info.depth)
        info.plans[key] = plan
    return plan


class DDTreeCPUAttentionImpl(TreeAttentionImplMixin, CPUAttentionBackendImpl):
    TREE_KV_CACHE_DTYPES: ClassVar[tuple[str, ...]] = (UNQUANTIZED_TREE_KV_CACHE_DTYPES
                                                       + tuple(KV_CACHE_DTYPE_KINDS))

    def _split_kv_cache(self, kv_cache):
        return split_kv_cache_cpu_vec(kv_cache)

    @staticmethod
    def move_kv_slots(caches, src_slots, dst_slots) -> bool:
        """KV compaction for every target layer in one native call (a byte
        copy, so fp8 codes move as they are); False when the native kernels
        are unavailable (the caller then moves layer by layer)."""
        lib = cpu_native.load()
        if lib is None or not all(c.is_contiguous() for c in caches):
            return False
        cpu_native.move_slots_native(lib, caches, src_slots, dst_slots)
        return True

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        info = get_tree_info(attn_metadata)
        tree_reqs = info.tree_reqs() if info is not None else ()
        if not tree_reqs:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )  # fmt: skip
        assert info is not None
        if layer.isa not in CPU_TREE_ISAS:
            raise RuntimeError(
                f"ddtree tree attention on CPU reads the KV cache in the "
                f"vec/vec16 layout but layer {layer.layer_name} uses isa "
                f"{layer.isa!r}; the metadata builder forces 'vec' only when "
                f"speculative_config.ddtree is set"
            )
        self._check_tree_step(layer, attn_metadata, output_scale, output_block_scale)
        num_reqs = attn_metadata.seq_lens.shape[0]
        if len(tree_reqs) < num_reqs:
            super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )  # fmt: skip

        n = attn_metadata.num_actual_tokens
        window = self.tree_sliding_window()
        depth = _step_depth(info, window)
        kv_quant = self.tree_kv_quant
        k_scale, v_scale = self.tree_kv_scales(layer)
        mode = _cpu_tree_mode()
        if mode == "triton":
            key_cache, value_cache = self.tree_kv_views(kv_cache)
            ta = _interpreter_kernel_module()
            ta.tree_attention(
                query[:n], key_cache, value_cache, attn_metadata.block_table,
                attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale,
                info.mask, info.is_tree, output=output[:n], tree_only=True,
                max_query_len=attn_metadata.max_query_len, sliding_window=window,
                sinks=self.sinks, depth=depth, kv_quant=kv_quant, k_scale=k_scale,
                v_scale=v_scale,
            )  # fmt: skip
            return output
        lib = (cpu_native.load() if _native_fits(kv_cache, self.head_size, kv_quant)
               else None)
        if lib is None:
            tree_attention_batched(query[:n], kv_cache,
                                   _step_plan(info, attn_metadata, kv_cache.shape[2], window),
                                   self.scale, output[:n], sinks=self.sinks,
                                   kv_quant=kv_quant, k_scale=k_scale, v_scale=v_scale)
            return output
        tree_reqs = info.plans.get("native_reqs")
        if tree_reqs is None:
            tree_reqs = info.plans["native_reqs"] = torch.tensor(info.tree_reqs(),
                                                                dtype=torch.int64)
        out = output[:n]
        out32 = out if out.dtype == torch.float32 else torch.empty(out.shape,
                                                                   dtype=torch.float32)
        cpu_native.tree_attention_native(
            lib, query[:n].float(), kv_cache, attn_metadata.block_table,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, tree_reqs, info.mask,
            self.scale, out32, sliding_window=window, sinks=self.sinks,
            depth=depth, kv_quant=kv_quant, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        if out32 is not out:
            rows = _tree_rows(info, attn_metadata)
            out.index_copy_(0, rows, out32.index_select(0, rows).to(out.dtype))
        return output


def _step_depth(info: TreeAttentionInfo, window: int | None) -> torch.Tensor | None:
    """The rows' node depths, which a windowed layer needs."""
    if window is not None and info.depth is None:
        raise RuntimeError(
            "ddtree: a sliding-window layer got tree info without node depths; build "
            "TreeAttentionInfo with depth= (TreeRound.plan does)")
    return info.depth


def _native_fits(kv_cache: torch.Tensor, head_size: int, kv_quant: str | None) -> bool:
    """Whether the native kernel takes this layer (else the torch path)."""
    return ((kv_quant is not None or kv_cache.dtype in cpu_native.KV_DTYPES)
            and kv_cache.is_contiguous() and head_size % 8 == 0
            and kv_cache.shape[2] % 8 == 0)


def _tree_rows(info: TreeAttentionInfo, attn_metadata) -> torch.Tensor:
    """The token rows of the tree requests (once per step)."""
    rows = info.plans.get("native_rows")
    if rows is None:
        qsl = attn_metadata.query_start_loc.tolist()
        rows = info.plans["native_rows"] = torch.cat(
            [torch.arange(qsl[r], qsl[r + 1]) for r in info.tree_reqs()])
    return rows


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with tree rows; registered over the stock class."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------

if TritonAttentionBackend is not None:

    class DDTreeTritonAttentionImpl(TreeAttentionImplMixin, TritonAttentionImpl):
        _kernel_module: ClassVar[Any] = None

        TREE_KV_CACHE_DTYPES: ClassVar[tuple[str, ...]] = (UNQUANTIZED_TREE_KV_CACHE_DTYPES
                                                           + CUDA_FP8_KV_CACHE_DTYPES)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if self.tree_kv_quant is not None:
                # vLLM would hand this backend fp8-quantized queries; the tree
                # kernel reads them in the model dtype (the stock kernel takes
                # either, dequantizing K/V with the same per-tensor scales).
                self.supports_quant_query_input = False

        def tree_unsupported_reason(self) -> str | None:
            if self.chunk_lookback > -1:
                return "chunked attention with lookback"
            if (self.kv_cache_dtype in KV_CACHE_DTYPE_KINDS
                    and self.kv_cache_dtype not in CUDA_FP8_KV_CACHE_DTYPES):
                return (f"kv_cache_dtype {self.kv_cache_dtype} on CUDA (vLLM's Triton "
                        f"backend reads every fp8 cache as the platform's e4m3 type; "
                        f"use fp8 or fp8_e4m3)")
            return super().tree_unsupported_reason()

        def _step_unsupported_reason(self, attn_metadata, output_scale, output_block_scale):
            if attn_metadata.mm_prefix_range_tensor is not None:
                return "multimodal prefix ranges"
            return super()._step_unsupported_reason(attn_metadata, output_scale,
                                                    output_block_scale)

        def _split_kv_cache(self, kv_cache):
            return split_kv_cache_nhd(kv_cache, self.head_size)

        @classmethod
        def _kernel(cls):
            if cls._kernel_module is None:
                from vllm_ddtree.kernels import tree_attention

                cls._kernel_module = tree_attention
            return cls._kernel_module

        def forward(
            self,
            layer,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata,
            output: torch.Tensor,
            output_scale: torch.Tensor | None = None,
            output_block_scale: torch.Tensor | None = None,
        ) -> torch.Tensor:
            info = get_tree_info(attn_metadata)
            if info is None:
                return super().forward(
                    layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale, output_block_scale,
                )  # fmt: skip
            self._check_tree_step(layer, attn_metadata, output_scale, output_block_scale)
            key_cache, value_cache = self.tree_kv_views(kv_cache)
            n = attn_metadata.num_actual_tokens
            window = self.tree_sliding_window()
            k_scale, v_scale = self.tree_kv_scales(layer)
            self._kernel().tree_attention(
                query[:n], key_cache, value_cache, attn_metadata.block_table,
                attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale,
                info.mask, info.is_tree, output=output[:n],
                max_query_len=attn_metadata.max_query_len, sliding_window=window,
                sinks=self.sinks, depth=_step_depth(info, window),
                kv_quant=self.tree_kv_quant, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
            return output

    class DDTreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
        """Stock builder, with full CUDA graphs for uniform batches: every
        request verifies 1 + B tokens (``UNIFORM_BATCH``; the runner pads trees
        the adaptive budget cut). The runner attaches the step's tree info
        after ``build``; its tensors are persistent buffers
        (``core.tree_info.TreeStepBuffers``) that a graph captured with them
        reads on replay, and every layer's kernel launch is followed by its
        device-side guard mark."""

        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    class DDTreeTritonAttentionBackend(TritonAttentionBackend):
        """``TRITON_ATTN`` plus the tree kernel, registered as ``DDTREE``."""

        supported_kv_cache_dtypes: ClassVar[list] = [*UNQUANTIZED_TREE_KV_CACHE_DTYPES,
                                                     *CUDA_FP8_KV_CACHE_DTYPES]

        @staticmethod
        def get_name() -> str:
            return CUDA_BACKEND_NAME

        @staticmethod
        def get_impl_cls() -> type[DDTreeTritonAttentionImpl]:
            return DDTreeTritonAttentionImpl

        @staticmethod
        def get_builder_cls() -> type[DDTreeTritonAttentionMetadataBuilder]:
            return DDTreeTritonAttentionMetadataBuilder

    __all__ += [
        "DDTreeTritonAttentionBackend",
        "DDTreeTritonAttentionImpl",
        "DDTreeTritonAttentionMetadataBuilder",
    ]


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def register_backends() -> list[str]:
    """Register the ddtree attention backends for the current platform.

    CPU: override ``CPU_ATTN`` with :class:`DDTreeCPUAttentionBackend`.
    CUDA: register ``DDTREE`` (:class:`DDTreeTritonAttentionBackend`).
    Idempotent. Must run before vLLM first selects a backend (the selector
    caches its answer). Returns the names of the backends registered.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_PATH)
        return ["CPU_ATTN"]
    if current_platform.is_cuda():
        if TritonAttentionBackend is None:
            raise RuntimeError("ddtree: vLLM's Triton attention backend is unavailable")
        if CUDA_BACKEND_NAME in AttentionBackendEnum._member_map_:
            register_backend(AttentionBackendEnum[CUDA_BACKEND_NAME], CUDA_BACKEND_PATH)
        else:
            register_backend(CUDA_BACKEND_NAME, CUDA_BACKEND_PATH)
        return [CUDA_BACKEND_NAME]
    logger.warning(
        "ddtree: no tree attention backend for platform %s", current_platform.device_name
    )
    return []
