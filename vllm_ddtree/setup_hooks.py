"""What the plugin installs into vLLM when it loads (called once per process)."""

from __future__ import annotations


def install() -> list[str]:
    """Install every seam; returns their names for the start-up log line."""
    return []
