"""What the plugin installs into vLLM when it loads (called once per process)."""

from __future__ import annotations


def install() -> list[str]:
    """Apply every patch that fits this platform and register the attention
    backends. Returns the names of what was installed, for the start-up log."""
    from vllm_ddtree.attention import register_backends
    from vllm_ddtree.patches import all_patches
    from vllm_ddtree.version import installed_vllm

    _, version = installed_vllm()
    names = []
    for patch in all_patches():
        if patch.when():
            patch.apply(version)
            names.append(patch.name)
    names.extend(register_backends())
    return names
