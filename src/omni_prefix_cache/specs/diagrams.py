"""Render every spec as a graphviz diagram (``make diagrams``).

The structure (states, moves, guards, effects) is read from the
``transitions`` machine built from the spec; the prose (meanings,
description) from the spec itself. Output is deterministic so a committed
``.dot`` can be compared byte for byte with a fresh render.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Mapping
from pathlib import Path

import graphviz

from omni_prefix_cache.specs.loader import MachineSpec, load_all_specs
from omni_prefix_cache.specs.oracle import build_oracle


def _wrap(text: str, width: int = 34) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def render_dot(spec: MachineSpec) -> str:
    """The DOT source for one spec."""
    machine, _ = build_oracle(spec)
    meaning = {s.name: s.meaning for s in spec.states}
    g = graphviz.Digraph(name=spec.name)
    g.attr(rankdir="LR", labelloc="t", fontname="Helvetica", fontsize="12")
    g.attr(label=f"{spec.name} ({spec.enum_name})\n{_wrap(spec.description, 90)}")
    g.attr("node", shape="box", style="rounded", fontname="Helvetica", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="9")
    g.node("__start__", label="", shape="point", width="0.15")
    for name, state in machine.states.items():
        extra = {"peripheries": "2", "style": "rounded,bold"} if state.final else {}
        suffix = "\n(final)" if state.final else ""
        g.node(name, label=f"{name}\n{_wrap(meaning[name])}{suffix}", **extra)
    g.edge("__start__", machine.initial)
    deferrable = {(m.trigger, src): set(m.deferrable) for m in spec.moves for src in m.source}
    if any(deferrable.values()):
        g.node("__note__", label="* effect may run after the caller publishes its record", shape="plaintext")
    for c in spec.couplings:
        text = f"coupling {c.name}: one move fires {c.fires} on the instances named, {c.others} on all others"
        g.node(f"__coupling_{c.name}__", label=f"{_wrap(text, 60)}\n{_wrap(c.meaning, 60)}", shape="note")
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for t in transitions:
                guards = [str(c.func) for c in t.conditions]
                label = trigger + (f" [{', '.join(guards)}]" if guards else "")
                if t.after:
                    late = deferrable[(trigger, source)]
                    label += " / " + ", ".join(f"{e}*" if e in late else str(e) for e in t.after)
                g.edge(source, t.dest, label=label)
    return str(g.source)


def _all_sources() -> dict[str, str]:
    """File stem -> DOT source: every machine, then the protocol's pictures."""
    from omni_prefix_cache.specs.composition import load_protocol
    from omni_prefix_cache.specs.composition_diagrams import render_protocol

    out = {name: render_dot(spec) for name, spec in load_all_specs().items()}
    out.update(render_protocol(load_protocol()))
    return out


def write_diagrams(out_dir: Path, *, svg: bool = True, extra: Mapping[str, str] | None = None) -> list[Path]:
    """Write ``<name>.dot`` (and ``.svg`` when graphviz's ``dot`` exists);
    ``extra``: more pictures (file stem -> DOT source) drawn beside the specs'."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    dot_bin = shutil.which("dot")
    for name, source in {**_all_sources(), **(extra or {})}.items():
        dot_path = out_dir / f"{name}.dot"
        dot_path.write_text(source)
        written.append(dot_path)
        if svg:
            if dot_bin is None:
                raise RuntimeError("graphviz 'dot' not found: apt-get install -y graphviz")
            svg_path = out_dir / f"{name}.svg"
            subprocess.run([dot_bin, "-Tsvg", "-o", str(svg_path), str(dot_path)], check=True)
            written.append(svg_path)
    return written


def stale_diagrams(out_dir: Path, extra: Mapping[str, str] | None = None) -> list[str]:
    """Names whose committed ``.dot`` differs from a fresh render (``extra``
    as for ``write_diagrams``)."""
    stale = []
    sources = {**_all_sources(), **(extra or {})}
    for name, source in sources.items():
        path = out_dir / f"{name}.dot"
        if not path.is_file() or path.read_text() != source:
            stale.append(name)
    # A leftover picture of an operation or machine the specs no longer have.
    stale.extend(sorted(p.stem for p in out_dir.glob("*.dot") if p.stem not in sources))
    return stale
