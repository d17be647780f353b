"""``check``: breadth-first search over the model's reachable worlds.

Safety first (every invariant in every reachable world, every move's own
invariants), then liveness (``can_settle``: every reachable world can still
reach a settled one, by reverse reachability over the explored graph). The
result carries the counts and, for a violation, a shortest trace.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from omni_prefix_cache.specs.composition import ProtocolSpec
from omni_prefix_cache.specs.loader import MachineSpec
from omni_prefix_cache.testing.model_mutations import BROKEN
from omni_prefix_cache.testing.modelcheck import render
from omni_prefix_cache.testing.modelcheck.model import ComposedModel
from omni_prefix_cache.testing.modelcheck.world import Bounds, Label, Violation, World


@dataclass
class CheckResult:
    """What ``check`` found."""

    bounds: Bounds
    broken: str | None
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    final_state: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        head = f"model check ({self.bounds.describe()})" + (f", broken variant {self.broken!r}" if self.broken else "")
        lines = [
            head,
            f"states explored: {self.states}, transitions: {self.transitions}, max depth: {self.depth}, "
            f"elapsed: {self.seconds:.1f}s",
        ]
        if self.ok:
            lines.append("OK: every invariant holds in every reachable state; every state can still settle")
            return "\n".join(lines)
        assert self.violation is not None
        lines.append(f"VIOLATION {self.violation.name}: {self.violation.message}")
        lines.append(f"shortest counterexample ({len(self.trace)} steps):")
        lines += [f"  {i}. {step}" for i, step in enumerate(self.trace, 1)]
        if self.final_state:
            lines.append("state reached:")
            lines += [f"    {line}" for line in self.final_state]
        return "\n".join(lines)


def check(
    bounds: Bounds | None = None,
    broken: str | None = None,
    *,
    specs: Mapping[str, MachineSpec] | None = None,
    protocol: ProtocolSpec | None = None,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> CheckResult:
    """Breadth-first over every reachable state of the model.

    Stops at the first (hence shallowest) invariant violation. With none,
    checks that every reachable state can still reach a settled state
    (reverse reachability over the explored graph) and reports the
    shallowest one that cannot. ``max_states`` aborts a run that grows past
    it (ValueError). ``progress(expanded, found, depth)`` is called every
    1,000 expanded states.
    """
    bounds = bounds or Bounds()
    if broken in BROKEN and BROKEN[broken].at_least:
        raise_to = {k: max(v, getattr(bounds, k)) for k, v in BROKEN[broken].at_least.items()}
        bounds = dataclasses.replace(bounds, **raise_to)
    model = ComposedModel(bounds, broken, specs, protocol)
    result = CheckResult(bounds=bounds, broken=broken)
    start = time.perf_counter()
    init = model.initial()
    index: dict[World, int] = {init: 0}
    worlds: list[World] = [init]
    parent: list[int] = [-1]
    via: list[Label | None] = [None]
    depth: list[int] = [0]
    succ: list[list[int]] = []
    transitions = 0

    def fail(i: int, exc: Violation, label: Label | None = None) -> CheckResult:
        result.violation = exc
        result.trace = render.trace(model.facts, model.ops, worlds, parent, via, i)
        if label is not None:
            result.trace.append(f"{render.describe_label(model.facts, model.ops, label)}  =>  breaks {exc.name}")
        result.final_state = render.describe_world(model.facts, model.ops, worlds[i])
        result.states, result.transitions = len(worlds), transitions
        result.depth = max(depth)
        result.seconds = time.perf_counter() - start
        return result

    try:
        model.check_state(init)
    except Violation as exc:
        return fail(0, exc)
    queue = deque([0])
    while queue:
        i = queue.popleft()
        if progress is not None and i % 1000 == 0:
            progress(i, len(worlds), depth[i])
        w = worlds[i]
        out: list[int] = []
        try:
            for label, raw in model.successors(w):
                transitions += 1
                model.check_move(w, raw)
                nxt = model.canonical(raw)
                j = index.get(nxt)
                if j is None:
                    j = len(worlds)
                    index[nxt] = j
                    worlds.append(nxt)
                    parent.append(i)
                    via.append(label)
                    depth.append(depth[i] + 1)
                    try:
                        model.check_state(nxt)
                    except Violation as exc:
                        return fail(j, exc)
                    queue.append(j)
                    if max_states is not None and len(worlds) > max_states:
                        raise ValueError(f"more than {max_states} states; lower the bounds")
                out.append(j)
        except Violation as exc:
            return fail(i, exc, exc.label)
        succ.append(out)
    # Liveness: every state must still reach a settled one.
    pred: list[list[int]] = [[] for _ in worlds]
    for i, outs in enumerate(succ):
        for j in outs:
            pred[j].append(i)
    can = bytearray(len(worlds))
    todo = deque(i for i, w in enumerate(worlds) if model.settled(w))
    for i in todo:
        can[i] = 1
    while todo:
        for k in pred[todo.popleft()]:
            if not can[k]:
                can[k] = 1
                todo.append(k)
    stuck = [i for i in range(len(worlds)) if not can[i]]
    result.states, result.transitions = len(worlds), transitions
    result.depth = max(depth)
    if stuck:
        worst = min(stuck, key=lambda i: depth[i])
        reason = "no sequence of actions from the state reached settles it"
        if not succ[worst]:
            reason = "deadlock: no action is enabled in the state reached"
        why = "; ".join(render.unsettled(model.facts, worlds[worst]))
        fail(worst, Violation("can_settle", f"{reason} (unsettled there: {why})"))
    result.seconds = time.perf_counter() - start
    return result
