"""Check the seam inventory (``seams.py``) against a vLLM source tree.

Static: the tree is read with :mod:`ast`, never imported, so any vLLM can be
audited on any machine, an installed one or a wheel unpacked beside it
(``unzip vllm-X.whl 'vllm/*.py'``). Nothing here imports vLLM or torch.

Each seam's target (``module:Qual.name``) is resolved the way Python would
find it: the module's top-level definitions and ``from ... import`` re-exports,
then a class's body, the ``self.<name> = ...`` assignments in its methods,
and its base classes. What is found gets a fingerprint:

- functions and methods: the parameter list (names, kinds, defaults) and a
  hash of the definition's AST without its docstring, so formatting and
  comments do not count, but any change of code does;
- classes: their bases and a hash of the whole class;
- module constants: a hash of the assigned value;
- attributes: where they are defined (existence is what we rely on);
- compiled ops: the Python files that call or register them;
- environment variables: whether ``vllm/envs.py`` defines them.

The verdict per seam compares the fingerprint with the one recorded for the
vLLM version the plugin was written against (``seams_baseline.json``):
``unchanged``, ``changed (signature)``, ``changed (source)`` or ``missing``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_ddtree.patches.seams import SEAMS, Seam

BASELINE_FILE = Path(__file__).with_name("seams_baseline.json")

UNCHANGED = "unchanged"
CHANGED_SIGNATURE = "changed (signature)"
CHANGED_SOURCE = "changed (source)"
MISSING = "missing"
NOT_EXPECTED = "not in this line"


@dataclass(frozen=True)
class Fingerprint:
    what: str  # function | class | constant | attribute | op | env
    where: str  # module:qualname where it was found
    signature: str = ""
    source: str = ""

    def to_json(self) -> dict:
        return {"what": self.what, "where": self.where, "signature": self.signature,
                "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> "Fingerprint":
        return cls(d["what"], d["where"], d.get("signature", ""), d.get("source", ""))


@dataclass(frozen=True)
class Verdict:
    seam: Seam
    status: str
    found: Fingerprint | None
    detail: str = ""
    # How the plugin handles this difference on this vLLM line ('' if it is
    # not a reviewed one).
    handled: str = ""

    @property
    def ok(self) -> bool:
        """Unchanged, not used on this line, or a reviewed and handled change."""
        return self.status in (UNCHANGED, NOT_EXPECTED) or bool(self.handled)


def minor_line(version: str) -> str:
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version


def _hash(node: ast.AST) -> str:
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()[:12]


def _strip_docstring(node):
    body = getattr(node, "body", None)
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        node = type(node)(**{f: getattr(node, f) for f in node._fields})
        node.body = body[1:] or [ast.Pass()]
    return node


def signature_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(self, a, b=1, *args, c, **kw)``: names, kinds and defaults only."""
    a = fn.args
    parts: list[str] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        parts.append(arg.arg if d is None else f"{arg.arg}={ast.unparse(d)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(arg.arg if d is None else f"{arg.arg}={ast.unparse(d)}")
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    return "(" + ", ".join(parts) + ")"


def _top_level(stmts):
    """A module's or class's statements, looking into ``if``/``try`` blocks
    (version and import guards) but not into functions."""
    for s in stmts:
        if isinstance(s, ast.If):
            yield from _top_level(s.body)
            yield from _top_level(s.orelse)
        elif isinstance(s, ast.Try):
            yield from _top_level(s.body)
            for h in s.handlers:
                yield from _top_level(h.body)
            yield from _top_level(s.orelse)
        else:
            yield s


def _defines(stmt, name: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


class SourceTree:
    """A vLLM source tree: the directory that contains the ``vllm`` package."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"{self.root} has no vllm/__init__.py: pass the directory "
                                    "that contains the vllm package (site-packages, or an "
                                    "unpacked wheel)")
        self._asts: dict[str, ast.Module | None] = {}
        self.files_read: set[Path] = set()

    @property
    def version(self) -> str:
        text = (self.root / "vllm" / "_version.py")
        if text.is_file():
            m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
                          text.read_text())
            if m:
                return m.group(1)
        return "unknown"

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._asts:
            path = self.module_file(module)
            if path is None:
                self._asts[module] = None
            else:
                self.files_read.add(path)
                self._asts[module] = ast.parse(path.read_text(), filename=str(path))
        return self._asts[module]

    def _absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        is_pkg = (self.module_file(module) or Path()).name == "__init__.py"
        parts = module.split(".")
        keep = len(parts) - stmt.level + (1 if is_pkg else 0)
        base = ".".join(parts[:keep])
        return f"{base}.{stmt.module}" if stmt.module else base

    # ------------------------------------------------------------------ lookup
    def lookup(self, module: str, name: str, _depth: int = 0):
        """``(module, statement)`` defining ``name`` at the top of ``module``,
        following re-exports; ``None`` when it does not exist."""
        tree = self.module(module)
        if tree is None or _depth > 8:
            return None
        for s in _top_level(tree.body):
            if _defines(s, name):
                return module, s
        for s in _top_level(tree.body):
            if isinstance(s, ast.ImportFrom):
                for a in s.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(module, s)
                        found = self.lookup(src, a.name, _depth + 1)
                        if found is not None:
                            return found
                        if self.module_file(f"{src}.{a.name}") is not None:
                            return f"{src}.{a.name}", None  # a submodule
        return None

    def lookup_member(self, module: str, cls: ast.ClassDef, name: str, _seen=None):
        """``(module, class, statement, how)`` for ``cls.name``: a definition
        in the class body, a ``self.name`` assignment in one of its methods, or
        the same in a base class."""
        seen = _seen if _seen is not None else set()
        key = (module, cls.name)
        if key in seen:
            return None
        seen.add(key)
        for s in _top_level(cls.body):
            if _defines(s, name):
                return module, cls, s, "body"
        for s in cls.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(s):
                    targets = (node.targets if isinstance(node, ast.Assign)
                               else [node.target] if isinstance(node, (ast.AnnAssign,
                                                                       ast.AugAssign))
                               else [])
                    for t in targets:
                        if (isinstance(t, ast.Attribute) and t.attr == name
                                and isinstance(t.value, ast.Name) and t.value.id == "self"):
                            return module, cls, node, f"self.{name} in {s.name}"
        for base in cls.bases:
            found = self._resolve_class_expr(module, base)
            if found is not None:
                bmod, bcls = found
                hit = self.lookup_member(bmod, bcls, name, seen)
                if hit is not None:
                    return hit
        return None

    def _resolve_class_expr(self, module: str, expr):
        if isinstance(expr, ast.Subscript):  # Generic[T]
            expr = expr.value
        if isinstance(expr, ast.Name):
            hit = self.lookup(module, expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            mod_hit = self.lookup(module, expr.value.id)
            hit = self.lookup(mod_hit[0], expr.attr) if mod_hit and mod_hit[1] is None else None
        else:
            hit = None
        if hit is not None and isinstance(hit[1], ast.ClassDef):
            return hit
        return None

    # ------------------------------------------------------------------ fingerprints
    def fingerprint(self, seam: Seam) -> tuple[Fingerprint | None, str]:
        """What the tree has for ``seam``, or ``(None, why missing)``."""
        if seam.kind == "op":
            return self._op(seam.target)
        if seam.kind == "env":
            return self._env(seam.target)
        module, _, qual = seam.target.partition(":")
        if self.module(module) is None:
            return None, f"module {module} not found"
        first, *rest = qual.split(".")
        hit = self.lookup(module, first)
        if hit is None:
            return None, f"{module} has no {first}"
        mod, node = hit
        where = [getattr(node, "name", first)]  # the definition's own name (re-exports)
        owner_mod = mod
        how = "body"
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return None, f"{'.'.join(where)} is not a class, so it has no {part}"
            member = self.lookup_member(owner_mod, node, part)
            if member is None:
                return None, f"{'.'.join(where)} has no {part}"
            owner_mod, owner_cls, node, how = member
            where = [owner_cls.name, part]
        loc = f"{owner_mod}:{'.'.join(where)}"
        if node is None:
            return Fingerprint("module", loc), ""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Fingerprint("function", loc, signature_of(node),
                               _hash(_strip_docstring(node))), ""
        if isinstance(node, ast.ClassDef):
            bases = "(" + ", ".join(ast.unparse(b) for b in node.bases) + ")"
            return Fingerprint("class", loc, bases, _hash(_strip_docstring(node))), ""
        if how != "body":
            return Fingerprint("attribute", f"{loc} ({how})"), ""
        if isinstance(node, ast.AnnAssign) and node.value is None:
            return Fingerprint("attribute", f"{loc} (field {ast.unparse(node.annotation)})"), ""
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else node
        return Fingerprint("constant", loc, "", _hash(value)), ""

    def _python_files(self):
        yield from sorted((self.root / "vllm").rglob("*.py"))

    def _op(self, name: str) -> tuple[Fingerprint | None, str]:
        pat = re.compile(rf"\b(?:torch\.ops\.[A-Za-z_]+\.|_C\.|ops\.)?{re.escape(name)}\b")
        hits = []
        for p in self._python_files():
            text = p.read_text(errors="replace")
            if name in text and pat.search(text):
                hits.append(str(p.relative_to(self.root)))
        if not hits:
            return None, f"no Python file refers to the op {name}"
        return Fingerprint("op", ", ".join(hits[:3]) + (" ..." if len(hits) > 3 else "")), ""

    def _env(self, name: str) -> tuple[Fingerprint | None, str]:
        envs = self.module("vllm.envs")
        if envs is None:
            return None, "vllm/envs.py not found"
        text = self.module_file("vllm.envs").read_text()
        if f'"{name}"' not in text and f"'{name}'" not in text:
            return None, f"vllm/envs.py does not define {name}"
        return Fingerprint("env", "vllm.envs"), ""


def load_baseline(path: Path = BASELINE_FILE) -> dict:
    return json.loads(path.read_text())


def compare(seam: Seam, found: Fingerprint | None, missing_why: str,
            base: Fingerprint | None, version: str = "") -> Verdict:
    if version and not seam.expected_in(version):
        return Verdict(seam, NOT_EXPECTED, found, f"used from vLLM {seam.since} on")
    if found is None:
        return Verdict(seam, MISSING, None, missing_why)
    if seam.existence_only:
        return Verdict(seam, UNCHANGED, found, "")
    if base is None:
        return Verdict(seam, MISSING, found, "no baseline recorded for this seam")
    if found.what != base.what:
        return Verdict(seam, CHANGED_SIGNATURE, found, f"was a {base.what}, now a {found.what}")
    if found.signature != base.signature:
        return Verdict(seam, CHANGED_SIGNATURE, found,
                       f"{base.signature} -> {found.signature}")
    if found.source != base.source:
        return Verdict(seam, CHANGED_SOURCE, found, "")
    return Verdict(seam, UNCHANGED, found, "")


def audit(root: str | Path, seams: list[Seam] = SEAMS, baseline: dict | None = None,
          tree: SourceTree | None = None) -> tuple[str, list[Verdict]]:
    """``(version of the tree, one verdict per seam)`` against the baseline.

    A difference from the reference version counts as handled when the seam
    has a ``changes`` note for the tree's minor line and the tree still has the
    fingerprint that was reviewed for it (a later patch release that changes
    the seam again is flagged anew)."""
    tree = tree or SourceTree(root)
    baseline = baseline if baseline is not None else load_baseline()
    fps = baseline["seams"]
    line = minor_line(tree.version)
    reviewed = baseline.get("reviewed", {}).get(line, {}).get("seams", {})
    out = []
    for seam in seams:
        found, why = tree.fingerprint(seam)
        base = Fingerprint.from_json(fps[seam.target]) if seam.target in fps else None
        if base is None and seam.target in reviewed:  # new on this line
            base = Fingerprint.from_json(reviewed[seam.target])
        v = compare(seam, found, why, base, tree.version)
        note = seam.changes.get(line, "")
        if not v.ok and note and found is not None and seam.target in reviewed:
            if Fingerprint.from_json(reviewed[seam.target]) == found:
                v = Verdict(seam, v.status, found, v.detail, note)
            else:
                v = Verdict(seam, v.status, found,
                            (v.detail + "; " if v.detail else "") + f"changed since the "
                            f"{line} review")
        out.append(v)
    return tree.version, out


def review(root: str | Path, baseline: dict, seams: list[Seam] = SEAMS) -> dict:
    """Record the fingerprints of ``root``'s minor line for the seams that
    differ from the reference and carry a ``changes`` note for that line.
    Refuses while a difference has no note (it has not been reviewed)."""
    tree = SourceTree(root)
    line = minor_line(tree.version)
    if line == minor_line(baseline["reference"]):
        raise ValueError(f"{tree.version} is the reference line; record a baseline instead")
    _, verdicts = audit(root, seams, {**baseline, "reviewed": {}}, tree)
    todo = [v for v in verdicts if v.status not in (UNCHANGED, NOT_EXPECTED)
            and not v.seam.changes.get(line) and not (v.seam.since and v.found is not None)]
    if todo:
        raise ValueError(f"{len(todo)} seams differ in vLLM {tree.version} without a note "
                         f"for {line} in patches/seams.py:\n  " +
                         "\n  ".join(f"{v.status}: {v.seam.target} {v.detail}" for v in todo))
    rec = {v.seam.target: v.found.to_json() for v in verdicts
           if v.found is not None and (v.seam.changes.get(line) or v.seam.since)}
    out = dict(baseline)
    out["reviewed"] = {**baseline.get("reviewed", {}), line: {"from": tree.version,
                                                              "seams": rec}}
    return out


def record_baseline(root: str | Path, seams: list[Seam] = SEAMS) -> dict:
    """The fingerprints of every seam in ``root`` (all must exist)."""
    tree = SourceTree(root)
    fps, missing = {}, []
    for seam in seams:
        if not seam.expected_in(tree.version):
            continue
        found, why = tree.fingerprint(seam)
        if found is None:
            missing.append(f"{seam.target}: {why}")
        else:
            fps[seam.target] = found.to_json()
    if missing:
        raise ValueError("cannot record a baseline, seams missing:\n  " + "\n  ".join(missing))
    return {"vllm": tree.version, "seams": fps}


def source_text(tree: SourceTree, seam: Seam) -> str:
    """The source of what ``seam`` resolves to in ``tree`` ('' if none)."""
    fp, _ = tree.fingerprint(seam)
    if fp is None or fp.what not in ("function", "class", "constant"):
        return ""
    module, _, qual = fp.where.partition(":")
    path = tree.module_file(module)
    text = path.read_text()
    mod = tree.module(module)
    first, *rest = qual.split(".")
    node = next((s for s in _top_level(mod.body) if _defines(s, first)), None)
    for part in rest:
        node = next((s for s in _top_level(node.body) if _defines(s, part)), None)
    return ast.get_source_segment(text, node) or "" if node is not None else ""
