"""The package map: which sub-package imports which, drawn from the source.

``module_graph()`` reads every module of the installed package with ``ast``
(imports anywhere in a module count: module scope, ``TYPE_CHECKING`` blocks
and function bodies), so the picture is the code's, not a description of it.
``render_package_map()`` folds it into one node per layer (a sub-package, or
a top-level module such as ``manager``) listing its modules, with an edge per
layer it imports. ``make diagrams`` writes it as ``diagrams/packages.dot``
(and ``.svg``) beside the spec diagrams, checked for staleness like them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = "omni_prefix_cache"
ROOT = Path(__file__).resolve().parents[1]

# One line per layer in the picture, top (calls down) to bottom.
LAYER_NOTES = {
    "manager": "the engine-facing facade",
    "adapter": "scheduler output -> request events",
    "compat": "upstream's private names for its tests",
    "ops": "stats, Prometheus collector",
    "reads": "hit planning, planned reads, materialize",
    "steps": "per-step tables under the state lock",
    "controller": "the write path's facade",
    "writes": "tasks, queues, staging, committer",
    "specs": "spec loading, compiling, generated types",
    "device": "copy engine, sync, index tensors",
    "telemetry": "spec-generated metrics, data-path figures",
    "interface": "config, policy, ids, outputs",
    "errors": "the error classes, no torch",
    "tools": "cli, bench, simulate, gpu_check",
    "testing": "generated tests, model check, explorer",
}
# Drawn without their out-edges: harness layers that may import any layer.
HARNESS = {"tools", "testing"}
# Every layer imports them (ids, config, errors): drawn once, without edges.
SHARED = {"interface", "errors"}


def module_name(path: Path, root: Path = ROOT) -> str:
    """``omni_prefix_cache.steps.write_ledger`` for its file under ``root``."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in the file."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(me)
    return out


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    known = modules(root)
    return {name: imports_of(path, known, root) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one
    module (Tarjan's algorithm, iterative so deep packages cannot overflow)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def layer_of(module: str) -> str:
    """The layer a module belongs to: its sub-package, or itself at top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """Layer -> layers it imports, and layer -> its modules (short names)."""
    edges: dict[str, set[str]] = defaultdict(set)
    members: dict[str, list[str]] = defaultdict(list)
    for module, deps in graph.items():
        layer = layer_of(module)
        if layer == PACKAGE or layer in {"__main__"}:
            continue
        rest = module.split(".")[2:]
        if rest:
            members[layer].append(".".join(rest))
        edges.setdefault(layer, set())
        for dep in deps:
            target = layer_of(dep)
            if target not in {layer, PACKAGE}:
                edges[layer].add(target)
    return dict(edges), {k: sorted(v) for k, v in members.items()}


def render_package_map(root: Path = ROOT) -> str:
    """DOT source of the layer graph (deterministic, for the staleness check)."""
    edges, members = layer_graph(module_graph(root))
    order = [name for name in LAYER_NOTES if name in edges] + sorted(set(edges) - set(LAYER_NOTES))
    lines = [
        "digraph packages {",
        '\tlabel="omni_prefix_cache: layers and their imports (generated from the source by make diagrams)"',
        "\tlabelloc=t rankdir=TB fontname=Helvetica fontsize=12 nodesep=0.3 ranksep=0.5",
        "\tnode [fontname=Helvetica fontsize=10 shape=box style=rounded]",
        '\tedge [color="#555555" arrowsize=0.6]',
    ]
    for name in order:
        note = LAYER_NOTES.get(name, "")
        listed = members.get(name, [])
        head = [f"{name}/" if listed else name] + ([f"({note})"] if note else [])
        body = "\\n".join(head)
        if listed:
            body += "\\n" + "\\n".join(_wrap_names(listed))
        if name in HARNESS:
            body += "\\n(may import any layer)"
        if name in SHARED:
            body += "\\n(imported by every layer)"
        style = ' style="rounded,dashed"' if name in HARNESS | {"compat"} else ""
        lines.append(f'\t"{name}" [label="{body}"{style}]')
    for name in order:
        if name in HARNESS:
            continue
        for dep in sorted(edges[name] - SHARED):
            dashed = " [style=dashed]" if name == "compat" else ""
            lines.append(f'\t"{name}" -> "{dep}"{dashed}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _wrap_names(names: list[str], width: int = 48) -> list[str]:
    out: list[str] = []
    line = ""
    for name in names:
        candidate = f"{line}, {name}" if line else name
        if len(candidate) > width and line:
            out.append(line + ",")
            line = name
        else:
            line = candidate
    if line:
        out.append(line)
    return out
