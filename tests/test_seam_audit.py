"""The seam inventory and its audit (patches/seams.py, patches/audit.py,
scripts/seam_audit.py): the installed vLLM holds, the inventory covers what
the code imports and patches, the README follows it, and the audit sees a
renamed or re-signed vLLM name."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from vllm_ddtree.patches import all_patches
from vllm_ddtree.patches import audit as A
from vllm_ddtree.patches.seams import SEAMS, by_target

REPO = Path(__file__).resolve().parent.parent
PLUGIN_DIRS = [REPO / "vllm_ddtree", REPO / "patches", REPO / "kernels"]


def _script():
    spec = importlib.util.spec_from_file_location("seam_audit", REPO / "scripts" / "seam_audit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def installed(script):
    root = script.installed_root()
    tree = A.SourceTree(root)
    version, verdicts = A.audit(root, tree=tree)
    return root, tree, version, verdicts


def test_installed_vllm_holds_every_seam(installed):
    root, _, version, verdicts = installed
    bad = [f"{v.status}: {v.seam.target} {v.detail}" for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    if version == A.load_baseline()["reference"]:
        assert all(v.status in (A.UNCHANGED, A.NOT_EXPECTED) for v in verdicts)


def test_inventory_is_well_formed():
    by_target()  # no duplicates
    assert len(SEAMS) > 150
    base = A.load_baseline()
    for s in SEAMS:
        if s.since is None:
            assert s.target in base["seams"], f"{s.target} has no recorded fingerprint"
        for line in s.changes:
            assert s.target in base["reviewed"].get(line, {}).get("seams", {}), \
                f"{s.target}: a {line} note without a reviewed fingerprint"


def test_every_patch_is_a_patched_seam_and_back():
    patched = {s.target for s in SEAMS if s.kind == "patched"}
    targets = {p.target for p in all_patches()}
    assert targets == patched


def test_patch_table_in_readme_matches_the_patches():
    text = (REPO / "patches" / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(\w+\.py)`[^|]*\| `([^`]+)` \|.*\| (\S+) \| (\S+) \|$", line)
        if m:
            rows[m.group(2)] = (m.group(1), m.group(4))
    for p in all_patches():
        assert p.target in rows, f"patches/README.md has no row for {p.target}"
        assert rows[p.target][1] == p.vllm_versions, (p.target, rows[p.target][1])
    assert set(rows) == {p.target for p in all_patches()}


def test_readme_section_is_generated_from_the_inventory(script):
    text = (REPO / "patches" / "README.md").read_text()
    assert script.readme_section() in text, (
        "patches/README.md is out of date: run scripts/seam_audit.py --write-readme")


def _vllm_imports():
    """``(file, line, 'module:name')`` for every ``from vllm... import name``
    in the plugin (modules imported whole are their own seams' prefix)."""
    out = []
    for d in PLUGIN_DIRS:
        for path in sorted(d.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                        node.module == "vllm" or node.module.startswith("vllm.")):
                    for a in node.names:
                        out.append((path.name, node.lineno, f"{node.module}:{a.name}"))
    return out


WHOLE_MODULES = {"vllm:_custom_ops"}  # used as ops.<name>; each name is its own seam


def test_every_vllm_import_is_in_the_inventory():
    targets = {s.target for s in SEAMS}
    prefixes = {t.split(".")[0] if ":" not in t else t.split(":")[0] + ":" + t.split(":")[1]
                .split(".")[0] for t in targets}
    missing = [f"{f}:{line} {name}" for f, line, name in _vllm_imports()
               if name not in targets and name not in prefixes and name not in WHOLE_MODULES]
    assert not missing, "imported from vLLM but not in patches/seams.py:\n" + "\n".join(missing)


def _copy_tree(tree: A.SourceTree, dest: Path) -> Path:
    for path in tree.files_read | {tree.root / "vllm" / "__init__.py",
                                   tree.root / "vllm" / "_version.py"}:
        rel = path.relative_to(tree.root)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest / rel)
    for pkg in dest.rglob("*"):  # parents of copied modules are packages
        if pkg.is_dir() and not (pkg / "__init__.py").exists():
            (pkg / "__init__.py").write_text("")
    # the op and env checks read these too
    for extra in ("vllm/envs.py", "vllm/_custom_ops.py"):
        src = tree.root / extra
        if src.exists():
            shutil.copy(src, dest / extra)
    return dest


def test_audit_sees_a_renamed_and_a_resigned_name(installed, tmp_path, script):
    _, tree, _, _ = installed
    copy = _copy_tree(tree, tmp_path / "vllm-copy")
    # the copy alone audits like the original
    assert all(v.ok for v in A.audit(copy)[1])
    som = copy / "vllm" / "v1" / "structured_output" / "__init__.py"
    text = som.read_text()
    text = text.replace("def _fill_bitmasks(", "def _fill_token_bitmasks(", 1)
    text = re.sub(r"def _get_constraint_bounds\(\s*self,", "def _get_constraint_bounds(self, extra,",
                  text, count=1)
    som.write_text(text)
    _, verdicts = A.audit(copy)
    got = {v.seam.target: v for v in verdicts if not v.ok}
    som_name = "vllm.v1.structured_output:StructuredOutputManager"
    assert got[f"{som_name}._fill_bitmasks"].status == A.MISSING
    assert got[f"{som_name}._get_constraint_bounds"].status == A.CHANGED_SIGNATURE
    assert set(got) == {f"{som_name}._fill_bitmasks", f"{som_name}._get_constraint_bounds"}
    assert script.main([str(copy)]) == 1
    assert script.main([str(copy), "--no-strict"]) == 0


def test_audit_sees_a_changed_body_and_a_moved_class(installed, tmp_path):
    _, tree, _, _ = installed
    copy = _copy_tree(tree, tmp_path / "vllm-copy")
    sched = copy / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    text = sched.read_text()
    i = text.index("def update_draft_token_ids(")
    j = text.index(":\n", i) + 2
    sched.write_text(text[:j] + "        pass\n" + text[j:])
    (copy / "vllm" / "v1" / "spec_decode" / "dflash.py").write_text("")
    _, verdicts = A.audit(copy)
    got = {v.seam.target: v.status for v in verdicts if not v.ok}
    assert got["vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids"] == A.CHANGED_SOURCE
    assert got["vllm.v1.spec_decode.dflash:DFlashProposer"] == A.MISSING


def test_resolver_follows_reexports_bases_and_self_attributes(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .impl import Base as Exported\n")
    (pkg / "sub" / "impl.py").write_text(
        "class Base:\n    x: int\n    def __init__(self):\n        self.y = 1\n"
        "    def f(self, a, b=2, *, c):\n        '''doc'''\n        return a\n")
    (pkg / "child.py").write_text("from vllm.sub import Exported\nclass Child(Exported):\n"
                                  "    pass\n")
    tree = A.SourceTree(tmp_path)
    from vllm_ddtree.patches.seams import Seam

    def fp(target, kind="attribute"):
        return tree.fingerprint(Seam(target, kind, "runner", "t"))[0]

    assert fp("vllm.child:Child.f", "signature").signature == "(self, a, b=2, *, c)"
    assert fp("vllm.child:Child.y").where.endswith("(self.y in __init__)")
    assert "field int" in fp("vllm.child:Child.x").where
    assert fp("vllm.sub:Exported", "imported").where == "vllm.sub.impl:Base"
    assert fp("vllm.child:Child.z") is None
    # a docstring edit is not a change; a body edit is
    before = fp("vllm.child:Child.f", "signature").source
    impl = pkg / "sub" / "impl.py"
    impl.write_text(impl.read_text().replace("'''doc'''", "'''other doc'''"))
    assert A.SourceTree(tmp_path).fingerprint(Seam("vllm.child:Child.f", "signature", "runner",
                                                   "t"))[0].source == before
    impl.write_text(impl.read_text().replace("return a", "return b"))
    assert A.SourceTree(tmp_path).fingerprint(Seam("vllm.child:Child.f", "signature", "runner",
                                                   "t"))[0].source != before
