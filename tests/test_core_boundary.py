"""``vllm_ddtree.core`` is the pure part of the plugin: nothing under it may
import vLLM, directly, lazily inside a function, or through a glue module.

Two checks, because each misses what the other sees: a static scan of every
import statement (including the ones inside functions, which only run on some
paths), and a real import of every core module in a fresh interpreter where
``vllm`` cannot be imported at all.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import vllm_ddtree.core as core

CORE_DIR = Path(core.__file__).parent
# What the core may import from this project: itself, the package root (a
# version string) and nothing else. Glue modules import vLLM.
ALLOWED_OWN = ("vllm_ddtree.core", "vllm_ddtree")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve inside the core package
                out.append((node.lineno, "vllm_ddtree.core." + (node.module or "")))
            else:
                mod = node.module or ""
                out.append((node.lineno, mod))
                if mod == "vllm_ddtree":  # from vllm_ddtree import <module>
                    out += [(node.lineno, f"vllm_ddtree.{a.name}") for a in node.names]
    return out


def core_modules() -> list[str]:
    return sorted(f"vllm_ddtree.core.{m.name}" for m in pkgutil.iter_modules([str(CORE_DIR)]))


def boundary_violations(root: Path = CORE_DIR) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top == "vllm":
                bad.append(f"{path.name}:{line} imports {mod}")
            elif top == "vllm_ddtree" and mod != "vllm_ddtree" and not (
                    mod == "vllm_ddtree.core" or mod.startswith("vllm_ddtree.core.")
                    or mod == "vllm_ddtree.__version__"):
                bad.append(f"{path.name}:{line} imports the glue module {mod}")
    return bad


def test_core_holds_the_pure_modules():
    names = {m.rsplit(".", 1)[1] for m in core_modules()}
    assert {"tree", "tree_info", "node_history", "gdn_tree", "compaction", "budget",
            "round", "stats", "config"} <= names


def test_no_core_module_imports_vllm_statically():
    assert boundary_violations() == []


def test_the_static_scan_sees_lazy_and_glue_imports(tmp_path):
    # The scan must catch an import hidden in a function, and one that goes
    # through a glue module, or the test above proves nothing.
    (tmp_path / "lazy.py").write_text("def f():\n    from vllm.config import VllmConfig\n")
    (tmp_path / "glue.py").write_text("from vllm_ddtree import runner\n")
    (tmp_path / "fine.py").write_text("from vllm_ddtree.core.tree import build_tree\n")
    found = boundary_violations(tmp_path)
    assert len(found) == 2, found
    assert any("vllm.config" in v for v in found)
    assert any("vllm_ddtree.runner" in v for v in found)


def test_every_core_module_imports_without_vllm():
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None  # any 'import vllm...' raises ImportError\n"
        "import importlib\n"
        f"for m in {core_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "leaked = sorted(k for k in sys.modules if k == 'vllm' or k.startswith('vllm.'))\n"
        "assert leaked == ['vllm'], leaked\n"
        "glue = sorted(k for k in sys.modules if k.startswith('vllm_ddtree.')\n"
        "              and not k.startswith('vllm_ddtree.core'))\n"
        "assert glue == [], glue\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
