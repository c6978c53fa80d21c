"""DDTree (block-diffusion draft trees) speculative decoding for vLLM."""

__version__ = "0.1.0"
