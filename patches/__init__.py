"""Every vLLM seam that is a monkey-patch, one module each (see README.md here)."""

from vllm_ddtree.patches.base import Patch, PatchError

__all__ = ["Patch", "PatchError", "all_patches"]


def all_patches() -> list[Patch]:
    """The patches the plugin applies, in order."""
    return []
