"""A per-user cache of models generated from the bundled ones (no training).

Each generated model lives in one entry folder under the cache root::

    <root>/<entry>/<name>            the target (config, tokenizer, safetensors)
    <root>/<entry>/<name>-dflash     a copy of its drafter, found beside it by name
    <root>/<entry>/manifest.json     the parameters and source digests it was made from

``<entry>`` is ``<name>-<key>``, where ``<key>`` hashes the generator's
parameters and the bytes of every source file, so a changed source or
parameter gives another entry instead of a stale one. An entry is built in a
temporary folder beside it and renamed into place, so a half-written model is
never visible and two processes generating the same entry do not clash.

The root is ``cache_root`` when given, else ``$VLLM_DDTREE_CACHE/models``, else
``~/.cache/vllm_ddtree/models`` (the native kernels use the same
``VLLM_DDTREE_CACHE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

ENV_CACHE = "VLLM_DDTREE_CACHE"
MANIFEST = "manifest.json"

# Everything in a bundled model folder that is not weights or config: copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt")


def cache_root(root: str | os.PathLike | None = None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(ENV_CACHE)
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_ddtree") / "models"


def digest_files(paths: list[Path]) -> str:
    """sha256 over the files' names and bytes (not their folder: a moved or
    renamed copy of a model has the same digest)."""
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def copy_support_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: every file of ``src``
    except its weights and ``config.json`` (the caller writes those)."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in model_files(src):
        if path.name == "config.json" or path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, dst / path.name)


def copy_drafter(drafter: Path, dst: Path, *, num_target_layers: int) -> None:
    """Copy a DFlash drafter folder, recording the new target's depth in its
    ``num_target_layers`` (metadata: vLLM's DFlash model reads
    ``dflash_config.target_layer_ids``, which are unchanged)."""
    shutil.copytree(drafter, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "num_target_layers" in cfg:
        cfg["num_target_layers"] = num_target_layers
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def entry_key(params: dict, sources: dict[str, Path]) -> tuple[str, dict]:
    """``(short key, full key)``: the parameters plus one digest per source folder."""
    full = {"params": params,
            "sources": {name: digest_files(model_files(folder))
                        for name, folder in sources.items()}}
    short = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:12]
    return short, full


def cached_model(name: str, params: dict, sources: dict[str, Path],
                 build: Callable[[Path], dict], root: str | os.PathLike | None = None) -> Path:
    """The path of ``<root>/<name>-<key>/<name>``, generating it on first use.

    ``build(entry_dir)`` writes ``entry_dir/<name>`` (and ``<name>-dflash`` if
    wanted) and returns extra facts for the manifest (e.g. the parameter count).
    """
    for label, folder in sources.items():
        if not (Path(folder) / "config.json").is_file():
            raise FileNotFoundError(f"{label}: {folder} has no config.json; pass the folder "
                                    "of a saved model")
    short, full = entry_key(params, {k: Path(v) for k, v in sources.items()})
    base = cache_root(root)
    entry = base / f"{name}-{short}"
    if (entry / MANIFEST).is_file() and (entry / name / "config.json").is_file():
        return entry / name
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{short}-", dir=base))
    tmp.chmod(0o755)  # mkdtemp makes it private; the entry is an ordinary folder
    try:
        facts = build(tmp) or {}
        (tmp / MANIFEST).write_text(json.dumps(dict(full, name=name, **facts), indent=2) + "\n")
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process finished the same entry first; it is identical.
            if not (entry / MANIFEST).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return entry / name
