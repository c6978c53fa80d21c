"""Setup hooks that undo one DDTree seam, to show the guards catch it.

Installed in-process by ``benchmarks.run_llm``'s ``setup`` hook (with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), before the engine starts.
"""


def stock_cpu_attention() -> None:
    """Leave vLLM's stock CPU_ATTN on every layer (as on CUDA when another
    backend was selected): its forward ignores the tree mask."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.plugin import register

    register()  # later register() calls are no-ops, so the override stays off
    AttentionBackendEnum.CPU_ATTN.clear_override()


def stock_cpu_attention_unguarded() -> None:
    """As above, with the start-up guard disabled too."""
    import vllm_ddtree.runner as runner

    stock_cpu_attention()
    runner.check_tree_capable_layers = lambda *a, **k: None


def stock_cuda_attention() -> None:
    """CUDA: the ``DDTREE`` backend name resolves to vLLM's stock Triton
    attention, whose forward ignores the tree mask."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_ddtree.plugin import register

    register()
    register_backend(AttentionBackendEnum["DDTREE"],
                     "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend")


def stock_cuda_attention_unguarded() -> None:
    """As above, with the start-up guard disabled too."""
    import vllm_ddtree.runner as runner

    stock_cuda_attention()
    runner.check_tree_capable_layers = lambda *a, **k: None
