"""Render the composition spec: one swimlane picture per operation and an
overview of which operation moves which component (``make diagrams``).

A swimlane is a table: one column per component role the operation moves
(plus ``protocol`` for its own effects), one row per step in spec order,
and a shaded band per segment naming the lock it runs under: other threads
interleave only at those bands. Output is deterministic, like the machine
diagrams, so committed ``.dot`` files are checked for staleness.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Iterator

import graphviz

from omni_prefix_cache.specs.composition import (
    Couple,
    Do,
    Fire,
    FirstOf,
    OperationSpec,
    ProtocolSpec,
    Step,
    When,
)

_PROTOCOL = "protocol"
_SEGMENT_BG = "#e8eef7"
_WAIT_BG = "#fbe9d0"


def _rows(steps: tuple[Step, ...], conds: tuple[str, ...] = ()) -> Iterator[tuple[str, str, str]]:
    """(lane, text, conditions) per step, depth first; conditions read
    ``[guard, not guard, alt 2]`` (all must hold for the step to run)."""
    prefix = f"[{', '.join(conds)}] " if conds else ""
    for s in steps:
        if isinstance(s, Fire):
            yield s.role, s.trigger + ("?" if s.optional else ""), prefix
        elif isinstance(s, Do):
            yield _PROTOCOL, s.effect, prefix
        elif isinstance(s, Couple):
            yield s.role, f"couple {s.coupling}", prefix
        elif isinstance(s, When):
            yes = f"{'not ' if s.negate else ''}{s.guard}"
            no = s.guard if s.negate else f"not {s.guard}"
            yield from _rows(s.then, (*conds, yes))
            yield from _rows(s.orelse, (*conds, no))
        elif isinstance(s, FirstOf):
            for i, alt in enumerate(s.alternatives, 1):
                label = f"first of: alt {i}"
                if not alt:
                    yield _PROTOCOL, "(nothing)", f"[{', '.join((*conds, label))}] "
                yield from _rows(alt, (*conds, label))


def _lanes(op: OperationSpec, spec: ProtocolSpec) -> list[str]:
    used = {lane for seg in op.segments for lane, _, _ in _rows(seg.steps)}
    return [r for r in spec.components if r in used] + ([_PROTOCOL] if _PROTOCOL in used else [])


def swimlane_label(op: OperationSpec, spec: ProtocolSpec) -> str:
    """The HTML-like graphviz label of one operation's swimlane table."""
    lanes = _lanes(op, spec)
    width = len(lanes) + 1
    esc = html.escape
    out = ['<<table border="0" cellborder="1" cellspacing="0" cellpadding="4">']
    title = f"{op.name}" + (f" (for each {op.for_each})" if op.for_each else "")
    out.append(f'<tr><td colspan="{width}"><b>{esc(title)}</b><br/>{esc(op.meaning)}</td></tr>')
    out.append(f'<tr><td colspan="{width}"><i>caller: {esc(op.caller)}</i></td></tr>')
    if op.entry is not None:
        out.append(f'<tr><td colspan="{width}">runs only while {esc(op.entry.label)} is enabled</td></tr>')
    head = "".join(
        f"<td><b>{esc(lane)}</b><br/>{esc(spec.components[lane].name if lane in spec.components else 'effects')}</td>"
        for lane in lanes
    )
    out.append(f"<tr><td><b>#</b></td>{head}</tr>")
    n = 0
    for i, seg in enumerate(op.segments):
        if seg.wait:
            what = f"segment {i}: wait until {seg.wait} of {seg.of}"
            what += f"; raises if {seg.raises}" if seg.raises else ""
            out.append(f'<tr><td colspan="{width}" bgcolor="{_WAIT_BG}">{esc(what)}</td></tr>')
            continue
        band = f"segment {i}: under lock {seg.lock}"
        out.append(f'<tr><td colspan="{width}" bgcolor="{_SEGMENT_BG}">{esc(band)}</td></tr>')
        for lane, text, cond in _rows(seg.steps):
            n += 1
            cells = "".join(
                f'<td align="left">{esc(cond)}<b>{esc(text)}</b></td>' if lane == col else "<td></td>" for col in lanes
            )
            out.append(f"<tr><td>{n}</td>{cells}</tr>")
    rules = [r for r in spec.orderings if r.operation == op.name]
    for r in rules:
        out.append(f'<tr><td colspan="{width}" align="left">order {esc(r.name)}: {esc(" < ".join(r.order))}</td></tr>')
    out.append("</table>>")
    return "".join(out)


def render_operation_dot(op: OperationSpec, spec: ProtocolSpec) -> str:
    """DOT source of one operation's swimlane."""
    g = graphviz.Digraph(name=f"protocol_{op.name}")
    g.attr(fontname="Helvetica", fontsize="10")
    g.attr("node", shape="plaintext", fontname="Helvetica", fontsize="10")
    g.node(op.name, label=swimlane_label(op, spec))
    return str(g.source)


def render_overview_dot(spec: ProtocolSpec) -> str:
    """DOT source of the overview: operations -> the component machines
    they move, edges labelled with the triggers; links between machines."""
    g = graphviz.Digraph(name="protocol")
    g.attr(rankdir="LR", labelloc="t", fontname="Helvetica", fontsize="12")
    about = "\n".join(textwrap.wrap(spec.description, 100))
    g.attr(label=f"protocol: operations and the component moves they fire\n{about}")
    g.attr("node", fontname="Helvetica", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="8")
    for op in spec.operations:
        caller = "\n".join(textwrap.wrap(op.caller, 36))
        g.node(f"op_{op.name}", label=f"{op.name}\n{caller}", shape="box", style="rounded")
    for role, machine in spec.components.items():
        g.node(f"role_{role}", label=f"{role}\n[{machine.name}]", shape="ellipse")
    for op in spec.operations:
        by_role: dict[str, list[str]] = {}
        for s in op.walk():
            if isinstance(s, Fire):
                by_role.setdefault(s.role, []).append(s.trigger)
            elif isinstance(s, Couple):
                by_role.setdefault(s.role, []).append(s.coupling)
        for role, triggers in by_role.items():
            g.edge(f"op_{op.name}", f"role_{role}", label=", ".join(dict.fromkeys(triggers)))
    for link in spec.links:
        g.edge(
            f"role_{link.effect[0]}",
            f"role_{link.fires.role}",
            label=f"{link.effect[1]} fires {link.fires.label}",
            style="dashed",
        )
    return str(g.source)


def render_protocol(spec: ProtocolSpec) -> dict[str, str]:
    """File stem -> DOT source for every protocol diagram."""
    out = {"protocol": render_overview_dot(spec)}
    for op in spec.operations:
        out[f"protocol_{op.name}"] = render_operation_dot(op, spec)
    return out
