"""The one mechanism every vLLM monkey-patch of this project goes through.

A :class:`Patch` names the vLLM attribute it replaces (``module:qualname``),
says why it is needed and what the upstream status is, and lists the vLLM
versions it was written against. :meth:`Patch.apply` refuses to touch vLLM
when the version is not one of those or when the target does not exist, so a
vLLM upgrade fails loudly at start-up instead of misbehaving later.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_ddtree.version import ALLOW_ENV, version_override_allowed


# The vLLM lines a patch is written for. Patches that apply on every platform,
# or on CUDA, cover 0.32 and 0.33: the seam audit (docs/seam_audit.md) found
# their targets there, and every change in 0.33 is handled. 0.34 removed the V1
# model runner the plugin builds on. CPU-only patches cover the one vLLM CPU
# wheel, 0.32.
ALL_PLATFORMS = ">=0.32,<0.34"
CPU_ONLY = "==0.32.*"


class PatchError(RuntimeError):
    pass


def on_cpu() -> bool:
    """``Patch.when`` for patches of vLLM's CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def on_cuda() -> bool:
    """``Patch.when`` for patches of vLLM's CUDA build."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


@dataclass
class Patch:
    name: str
    target: str  # "package.module:Class.attr" or "package.module:function"
    why: str
    upstream: str
    vllm_versions: str  # PEP 440 specifier, e.g. "==0.32.*"
    # build(original) -> replacement. The replacement is installed verbatim.
    build: Callable[[Any], Any]
    # Only applied where this returns True (e.g. a platform check).
    when: Callable[[], bool] = lambda: True
    _original: Any = field(default=None, init=False, repr=False)
    applied: bool = field(default=False, init=False)

    def _resolve(self) -> tuple[Any, str]:
        mod_name, _, qual = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(mod_name)
        except ImportError as e:
            raise PatchError(f"patch {self.name}: cannot import {mod_name} ({e})") from e
        *path, attr = qual.split(".")
        for p in path:
            if not hasattr(owner, p):
                raise PatchError(f"patch {self.name}: {mod_name} has no {'.'.join(path)}")
            owner = getattr(owner, p)
        if not hasattr(owner, attr):
            raise PatchError(f"patch {self.name}: target {self.target} does not exist "
                             "in this vLLM; the patch must be ported")
        return owner, attr

    def check_version(self, version: str | Version) -> None:
        """Refuse another vLLM version, unless the user set
        ``VLLM_DDTREE_ALLOW_ANY_VLLM=1`` (the plugin then logs one warning for
        all patches, see ``vllm_ddtree/version.py``)."""
        if SpecifierSet(self.vllm_versions).contains(Version(str(version)), prereleases=True):
            return
        if version_override_allowed():
            return
        raise PatchError(
            f"patch {self.name} targets {self.target} as of vLLM {self.vllm_versions}; "
            f"refusing to apply it to vLLM {version}. Install a supported vLLM, or set "
            f"{ALLOW_ENV}=1 to load anyway at your own risk.")

    def apply(self, vllm_version: str | Version) -> None:
        if self.applied:
            return
        self.check_version(vllm_version)
        owner, attr = self._resolve()
        self._original = owner.__dict__.get(attr, getattr(owner, attr))
        replacement = self.build(getattr(owner, attr))
        setattr(owner, attr, replacement)
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        owner, attr = self._resolve()
        setattr(owner, attr, self._original)
        self.applied = False
