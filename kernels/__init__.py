"""Tree-attention kernels for DDTree verification (no vLLM imports).

``reference`` holds the torch reference, the ``TreeAttentionInfo`` contract and
the KV-cache view helpers; ``tree_attention`` holds the Triton kernel. The
Triton module is imported lazily (attribute ``tree_attention``) because
whether it runs in Triton's interpreter is fixed when it is imported.
"""

from vllm_ddtree.kernels.reference import (
    TreeAttentionInfo,
    split_kv_cache_cpu_vec,
    split_kv_cache_nhd,
    tree_attention_reference,
    unpack_tree_mask,
)

__all__ = [
    "TreeAttentionInfo",
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
