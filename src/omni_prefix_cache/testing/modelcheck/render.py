"""Rendering of the model's worlds, actions and traces as text.

Functions over ``ModelFacts`` (state names) and the compiled operations
(how many segments each has): an action's label (``escalate(task 0)``,
``committer_write[2](task 1)``), the change one action makes, a whole
world, why a world is not settled, and a trace from the initial state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omni_prefix_cache.specs.composition import CompiledOperation
from omni_prefix_cache.testing.modelcheck.facts import ModelFacts
from omni_prefix_cache.testing.modelcheck.world import IMM, KIND_NAMES, THREAD_NAMES, Label, World, holders_text

Operations = Mapping[str, CompiledOperation]


def unsettled(f: ModelFacts, w: World) -> list[str]:
    """Why ``w`` is not settled (empty when it is)."""
    why = [
        f"task {tid} is {f.T(t.state).name}" + (" and owes its wakes" if t.owed else "")
        for tid, t in enumerate(w.tasks)
        if t.state not in f.task_final or t.owed
    ]
    why += [f"page {p} is held by {holders_text(busy)}" for p, busy in enumerate(w.pages) if busy]
    why += [f"{f.cell(i)} is {f.Occ(s.state).name}" for i, s in enumerate(w.slots) if s.state not in f.slot_rest]
    why += [f"the {THREAD_NAMES[i]} is inside {run[0]}" for i, run in enumerate(w.threads) if run]
    return why


def describe_label(f: ModelFacts, ops: Operations, label: Label) -> str:
    """An action by name, with the segments it ran and what it raised."""
    op, first, last, args, raised = label
    return op_label(f, ops, op, first, args, last) + raised


def op_label(f: ModelFacts, ops: Operations, op: str, seg: int, args: tuple[int, ...], last: int = -1) -> str:
    """Operation ``op`` at segment ``seg`` (to ``last``) with its arguments, by name."""
    req, kind, slot, sid, tid, _, keys = args
    segs = f"{seg}" if last <= seg else f"{seg}-{last}"
    name = op + (f"[{segs}]" if len(ops[op].segments) > 1 else "")
    if op == "save":
        mm = "".join(f"+mm{k}" for k in range(1, f.keys) if keys >> (k - 1) & 1)
        what = f"r{req}, {KIND_NAMES[kind]} write of slot {slot}{mm}, step {sid}"
    elif op == "new_step":
        what = f"plan a read of {f.cell(slot)} for step {sid}"
    elif op in ("materialize", "discard", "abandon_save"):
        what = f"step {sid}"
    elif tid >= 0:
        what = f"task {tid}"
    else:
        what = ""
    return f"{name}({what})"


def describe_change(f: ModelFacts, a: World, b: World) -> str:
    """What changed from ``a`` to ``b``, component by component."""
    T, Occ, H, S, P = f.T, f.Occ, f.H, f.S, f.P
    parts: list[str] = []
    for tid, t in enumerate(b.tasks):
        if tid >= len(a.tasks):
            parts.append(f"task {tid} {'imm' if t.sched == IMM else 'def'} {T(t.state).name}")
            continue
        o = a.tasks[tid]
        if o.state != t.state:
            parts.append(f"task {tid} {T(o.state).name}->{T(t.state).name}")
        if o.position != t.position:
            parts.append(f"task {tid} position {P(o.position).name}->{P(t.position).name}")
        if o.holder != t.holder:
            parts.append(f"task {tid} holder {H(o.holder).name}->{H(t.holder).name}")
        if o.reassigned != t.reassigned:
            parts.append(f"task {tid} reassigned {list(t.reassigned)}")
        if (o.host_ready, o.done) != (t.host_ready, t.done):
            parts.append(f"task {tid} events host_ready={t.host_ready} done={t.done}")
    for sid, step in enumerate(b.steps):
        was = a.steps[sid] if sid < len(a.steps) else None
        if was is None or (was.state, was.holder) != (step.state, step.holder):
            parts.append(f"step {sid} {S(step.state).name} holder {H(step.holder).name} (page {step.page})")
    for slot, cell in enumerate(b.slots):
        if a.slots[slot] != cell:
            owner = f" owner task {cell.owner}" if cell.owner >= 0 else ""
            stale = " (previous tenant's rows)" if cell.stale else ""
            parts.append(f"{f.cell(slot)} {Occ(cell.state).name}{owner} v{cell.version}{stale}")
    if (a.hi, a.lo) != (b.hi, b.lo):
        parts.append(f"queues hi={list(b.hi)} lo={list(b.lo)}")
    if a.completed != b.completed or a.failed != b.failed:
        parts.append(f"records completed={list(b.completed)} failed={list(b.failed)}")
    if a.staged != b.staged:
        parts.append(f"staged {b.staged}")
    if a.sticky != b.sticky:
        parts.append("failure sticky")
    if a.awake != b.awake:
        parts.append("committer awake" if b.awake else "committer asleep")
    if a.reads != b.reads:
        parts.append(
            "reads "
            + ", ".join(
                f"{f.R(r.state).name} {f.cell(r.slot)} v{r.version}" + (" preserved" if r.preserved else "")
                for r in b.reads
            )
        )
    return "; ".join(parts) or "no change"


def describe_world(f: ModelFacts, ops: Operations, w: World) -> list[str]:
    """Every component of ``w``, one line per task, then queues, threads, pages, slots."""
    T, H, P = f.T, f.H, f.P
    lines = [
        f"task {tid}: {T(t.state).name} at {P(t.position).name} ({'immediate' if t.sched == IMM else 'deferred'}, "
        f"r{t.req}) host_ready={t.host_ready} done={t.done} holder={H(t.holder).name} slots={list(t.slots)}"
        + (f" reassigned={list(t.reassigned)}" if t.reassigned else "")
        + (" wakes owed" if t.owed else "")
        for tid, t in enumerate(w.tasks)
    ]
    lines.append(
        f"queues hi={list(w.hi)} lo={list(w.lo)}; staged {w.staged}; committer {'awake' if w.awake else 'asleep'}"
    )
    lines += [
        f"{THREAD_NAMES[i]}: inside {op_label(f, ops, run[0], run[1], run[2])}, next segment {run[1]}"
        for i, run in enumerate(w.threads)
        if run
    ]
    lines.append("pages " + ", ".join(f"{p}: [{holders_text(h)}]" for p, h in enumerate(w.pages)))
    lines.append(
        "slots "
        + ", ".join(f"{f.cell(i)}: {f.Occ(s.state).name}/{s.owner}/v{s.version}" for i, s in enumerate(w.slots))
    )
    return lines


_FIELDS: dict[type, dict[str, int]] = {}


def trace(
    f: ModelFacts, ops: Operations, worlds: Sequence[World], parent: Sequence[int], via: Sequence[Label | None], i: int
) -> list[str]:
    """The actions from the initial world (index 0) to world ``i``, each
    with the change it made (``parent``/``via``: the search tree)."""
    path = []
    while parent[i] >= 0:
        path.append(i)
        i = parent[i]
    return [
        f"{describe_label(f, ops, via[j])}  =>  {describe_change(f, worlds[parent[j]], worlds[j])}"  # type: ignore[arg-type]
        for j in reversed(path)
    ]
