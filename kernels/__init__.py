"""Tree-attention kernels for DDTree verification (no vLLM imports).

``reference`` holds the torch reference (the test oracle), ``cache_layout``
the strided K/V views of vLLM's paged cache, ``tree_attention_cpu`` the
batched torch path used on CPU, ``cpu_native`` the native CPU kernels
(``tree_attention_cpu.c``: tree attention, tree construction, KV compaction
and Gated DeltaNet tree verification), ``gdn_tree`` / ``gdn_tree_reference``
the Triton Gated DeltaNet tree kernels and their torch references, and
``tree_attention`` the Triton attention kernel.
The Triton module is imported lazily (attribute ``tree_attention``) because
whether it runs in Triton's interpreter is fixed when it is imported.
"""

from vllm_ddtree.kernels.cache_layout import split_kv_cache_cpu_vec, split_kv_cache_nhd
from vllm_ddtree.kernels.reference import tree_attention_reference, unpack_tree_mask

__all__ = [
    "split_kv_cache_cpu_vec",
    "split_kv_cache_nhd",
    "tree_attention_reference",
    "unpack_tree_mask",
    "tree_attention",
]


def __getattr__(name):
    if name == "tree_attention":
        import importlib

        return importlib.import_module("vllm_ddtree.kernels.tree_attention")
    raise AttributeError(name)
