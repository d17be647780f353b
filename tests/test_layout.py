"""The package's layout rules (docs/layout.md): no import circle, no
cross-module ``_private`` access in src/ outside ``compat/``, no use of a
compat seam alias outside ``compat/`` and the seed suite (nor of compat's
public upstream aliases outside the tests of upstream's names), and module sizes.

Run ``python tests/test_layout.py`` for the full list of what breaks a rule.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omni_prefix_cache.tools import package_map

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "omni_prefix_cache"
COMPAT = PKG / "compat"
TESTING = PKG / "testing"
SEED_SUITE = ROOT / "tests" / "test_seed_suite.py"
# The tests of upstream's names themselves: they may call compat's public aliases.
UPSTREAM_NAME_TESTS = {SEED_SUITE, ROOT / "tests" / "test_compat_views.py", ROOT / "tests" / "test_upstream_names.py"}
MAX_LINES = 450
MAX_LINES_TESTING = 600
# `self._x` and friends: the object's own names.
OWN = {"self", "cls", "mcs"}
# Public API spelled with an underscore: namedtuple methods.
ALLOWED_ATTRS = {"_replace", "_asdict", "_fields", "_make"}
# Other libraries' private names are theirs to keep, not this rule's.
FOREIGN_ROOTS = {"torch", "sys", "np", "numpy", "os", "threading", "vllm"}


def src_modules() -> dict[str, Path]:
    return package_map.modules(PKG)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in(path: Path, folder: Path) -> bool:
    return folder in path.parents


# ------------------------------------------------------------------ imports


def import_cycles() -> list[list[str]]:
    return package_map.cycles(package_map.module_graph(PKG))


# ------------------------------------------------------------------ private access


@dataclass(frozen=True)
class Hit:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.what}"


def own_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: module-level names, class
    members, and attributes it assigns on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in OWN:
                names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
    return {n for n in names if _is_private(n)}


def _string_attr_calls(node: ast.Call) -> Iterator[str]:
    """``getattr(x, "_name")``, ``setattr``, ``hasattr``, ``patch.object``:
    the private name a call reaches by string."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name in {"getattr", "setattr", "hasattr", "delattr", "object"} and len(node.args) >= 2:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_private(arg.value):
            yield arg.value


def private_access(path: Path, extra_own: set[str] = frozenset()) -> list[Hit]:  # type: ignore[assignment]
    """``other._name`` where the module does not define ``_name`` itself,
    and ``from omni_prefix_cache... import _name``."""
    tree = ast.parse(path.read_text())
    own = own_names(tree) | set(extra_own)
    hits: list[Hit] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("omni_prefix_cache"):
            for alias in node.names:
                if _is_private(alias.name):
                    hits.append(Hit(path, node.lineno, f"imports {node.module}.{alias.name}"))
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            value = node.value
            if isinstance(value, ast.Name) and value.id in OWN:
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if node.attr in own or node.attr in ALLOWED_ATTRS:
                continue
            root = value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in FOREIGN_ROOTS:
                continue
            hits.append(Hit(path, node.lineno, f"reads {ast.unparse(value)}.{node.attr}"))
        elif isinstance(node, ast.Call):
            for name in _string_attr_calls(node):
                if name not in own and name not in ALLOWED_ATTRS:
                    hits.append(Hit(path, node.lineno, f"reaches {name!r} by name"))
    return hits


def runtime_private_access() -> list[Hit]:
    hits: list[Hit] = []
    for path in src_modules().values():
        if not _in(path, COMPAT):
            hits.extend(private_access(path))
    return hits


# ------------------------------------------------------------------ seam aliases


def seam_aliases() -> set[str]:
    """The private members the compat mixins define (upstream's spellings)."""
    names: set[str] = set()
    for path in COMPAT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(item.name):
                        names.add(item.name)
    return names


def seam_alias_uses() -> list[Hit]:
    aliases = seam_aliases()
    paths = [p for p in src_modules().values() if not _in(p, COMPAT)]
    paths += [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != SEED_SUITE]
    paths += sorted((ROOT / "tests_vllm").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    hits: list[Hit] = []
    for path in paths:
        tree = ast.parse(path.read_text())
        own = own_names(tree) - aliases if path.is_relative_to(ROOT / "tests") else own_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in aliases and node.attr not in own:
                hits.append(Hit(path, node.lineno, f"uses seam alias {node.attr}"))
            elif isinstance(node, ast.Call):
                for name in _string_attr_calls(node):
                    if name in aliases and name not in own:
                        hits.append(Hit(path, node.lineno, f"uses seam alias {name!r} by name"))
    return hits


def upstream_public_aliases() -> set[str]:
    """Upstream's public spellings the compat mixins define (``get_task``,
    ``fetch_host``, ``claim_copy``...) that nothing outside ``compat/``
    defines: a use of one is a use of compat, whatever the receiver."""
    names: set[str] = set()
    for path in COMPAT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_"):
                        names.add(item.name)
    defined: set[str] = set()
    for path in src_modules().values():
        if _in(path, COMPAT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
    return names - defined


def upstream_alias_uses() -> list[Hit]:
    """Uses of ``upstream_public_aliases`` outside ``compat/`` and the tests of
    upstream's names (the seed suite, compat's own, the name list)."""
    aliases = upstream_public_aliases()
    paths = [p for p in src_modules().values() if not _in(p, COMPAT)]
    paths += [p for p in sorted((ROOT / "tests").rglob("*.py")) if p not in UPSTREAM_NAME_TESTS]
    paths += sorted((ROOT / "tests_vllm").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    hits: list[Hit] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in aliases:
                hits.append(Hit(path, node.lineno, f"uses upstream alias {node.attr}"))
    return hits


# ------------------------------------------------------------------ sizes


def oversized() -> list[str]:
    out = []
    for path in src_modules().values():
        limit = MAX_LINES_TESTING if _in(path, TESTING) else MAX_LINES
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(ROOT)}: {n} lines (limit {limit})")
    return out


# ------------------------------------------------------------------ tests


def test_no_import_cycle_in_src() -> None:
    cycles = import_cycles()
    assert not cycles, "import circles in src/: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_cross_module_private_access_outside_compat() -> None:
    hits = runtime_private_access()
    assert not hits, f"{len(hits)} private accesses in src/ outside compat/:\n" + "\n".join(map(str, hits[:40]))


def test_seam_aliases_only_in_compat_and_the_seed_suite() -> None:
    hits = seam_alias_uses()
    assert not hits, f"{len(hits)} uses of compat seam aliases:\n" + "\n".join(map(str, hits[:40]))


def test_upstream_public_aliases_only_in_compat_and_the_tests_of_upstreams_names() -> None:
    hits = upstream_alias_uses()
    assert not hits, f"{len(hits)} uses of compat's public upstream aliases:\n" + "\n".join(map(str, hits[:40]))


def test_the_upstream_alias_rule_can_fail() -> None:
    # The controller's moved names are compat's alone; ``append_chunk`` is WriteTask's too.
    aliases = upstream_public_aliases()
    assert {"get_task", "fetch_host", "pin_budget", "stage_step_host", "drain_completed", "claim_copy"} <= aliases
    assert "append_chunk" not in aliases and "join" not in aliases
    path = ROOT / "tests" / "_layout_probe.py"
    path.write_text("def f(ctrl):\n    return ctrl.fetch_host, ctrl.join\n")
    try:
        assert [h.what for h in upstream_alias_uses() if h.path == path] == ["uses upstream alias fetch_host"]
    finally:
        path.unlink()


def test_module_sizes() -> None:
    big = oversized()
    assert not big, "modules over their size limit:\n" + "\n".join(big)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f(o):\n    return o._x\n", ["reads o._x"]),
        ("class A:\n    def f(self):\n        return self._x\n", []),
        ("class A:\n    def __init__(self):\n        self._x = 1\n    def eq(self, o):\n        return o._x\n", []),
        ("from omni_prefix_cache.writes.staging import _X\n", ["imports omni_prefix_cache.writes.staging._X"]),
        ("def f(o):\n    return getattr(o, '_y')\n", ["reaches '_y' by name"]),
        ("def f(o):\n    return o.__class__\n", []),
    ],
)
def test_private_access_rule_can_fail(tmp_path: Path, source: str, expected: list[str]) -> None:
    path = ROOT / "tests" / "_layout_probe.py"
    path.write_text(source)
    try:
        assert [h.what for h in private_access(path)] == expected
    finally:
        path.unlink()


def test_cycle_finder_can_fail(tmp_path: Path) -> None:
    pkg = tmp_path / "omni_prefix_cache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from omni_prefix_cache import b\n")
    (pkg / "b.py").write_text("if False:\n    from omni_prefix_cache.a import x\n")
    (pkg / "c.py").write_text("from omni_prefix_cache.a import y\n")
    graph = package_map.module_graph(pkg)
    assert graph["omni_prefix_cache.c"] == {"omni_prefix_cache.a"}
    assert package_map.cycles(graph) == [["omni_prefix_cache.a", "omni_prefix_cache.b"]]


def report() -> None:
    cycles = import_cycles()
    print(f"import circles: {len(cycles)}")
    for c in cycles:
        print("  " + " <-> ".join(c))
    by_file: dict[Path, list[Hit]] = defaultdict(list)
    for hit in runtime_private_access():
        by_file[hit.path].append(hit)
    print(f"private accesses in src/ outside compat/: {sum(map(len, by_file.values()))}")
    for path, hits in sorted(by_file.items()):
        print(f"  {path.relative_to(ROOT)}: {len(hits)}")
        for hit in hits:
            print(f"    {hit.line}: {hit.what}")
    uses = seam_alias_uses()
    print(f"seam alias uses outside compat/ and the seed suite: {len(uses)}")
    for hit in uses:
        print(f"  {hit}")
    upstream = upstream_alias_uses()
    print(f"upstream alias uses outside compat/ and the tests of upstream's names: {len(upstream)}")
    for hit in upstream:
        print(f"  {hit}")
    big = oversized()
    print(f"oversized modules: {len(big)}")
    for line in big:
        print("  " + line)


if __name__ == "__main__":
    report()
