"""Facts derived from a spec's graph (no Hypothesis needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_prefix_cache.specs.loader import MachineSpec


def states_after(spec: MachineSpec, passed: Callable[[Any], bool]) -> tuple[frozenset[str], frozenset[str]]:
    """States where every / some path from the initial state took a move
    with ``passed(move)``: ``(always, sometimes)``. E.g. ``passed`` = "has
    effect set_done" gives the states where ``done`` must / may be set."""
    names = spec.state_names
    # always: greatest fixpoint (start all-true, initial false).
    always = {s: s != spec.initial for s in names}
    changed = True
    while changed:
        changed = False
        for s in names:
            if not always[s]:
                continue
            into = [(src, m) for m in spec.moves if m.dest == s for src in m.source]
            ok = s != spec.initial and all(passed(m) or always[src] for src, m in into)
            if not ok:
                always[s] = False
                changed = True
    # sometimes: least fixpoint.
    sometimes = {s: False for s in names}
    changed = True
    while changed:
        changed = False
        for m in spec.moves:
            for src in m.source:
                if not sometimes[m.dest] and (passed(m) or sometimes[src]):
                    sometimes[m.dest] = True
                    changed = True
    return frozenset(s for s, v in always.items() if v), frozenset(s for s, v in sometimes.items() if v)
