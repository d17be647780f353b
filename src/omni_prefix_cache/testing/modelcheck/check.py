"""``check``: breadth-first search over the models' reachable worlds.

Two worlds, searched one after the other: the write path
(``ComposedModel``) and the request lifecycle (``LifecycleModel``). In each,
safety first (every invariant in every reachable world, every move's own
invariants), then liveness (``can_settle``: every reachable world can still
reach a settled one, by reverse reachability over the explored graph; and,
for a model that declares an idle rule, ``idle_writes_land``: every world
whose engine is idle reaches an idle-settled one by the other threads' moves
alone). The result carries the counts and, for a violation, a shortest trace.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_prefix_cache.specs.composition import ProtocolSpec
from omni_prefix_cache.specs.loader import MachineSpec
from omni_prefix_cache.testing.model_mutations import BROKEN
from omni_prefix_cache.testing.modelcheck.life_model import LifecycleModel
from omni_prefix_cache.testing.modelcheck.model import ComposedModel
from omni_prefix_cache.testing.modelcheck.world import Bounds, Violation


@dataclass
class PartResult:
    """What the search found in one of the two worlds."""

    model: str
    bounds: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0


@dataclass
class CheckResult:
    """What ``check`` found: totals over the worlds searched (``parts``),
    and the first violation with its shortest trace."""

    bounds: Bounds
    broken: str | None
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    final_state: list[str] = field(default_factory=list)
    parts: list[PartResult] = field(default_factory=list)
    model: str = ""  # the world the violation was found in

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        head = f"model check ({self.bounds.describe()}; {self.bounds.life.describe()})" + (
            f", broken variant {self.broken!r}" if self.broken else ""
        )
        lines = [head]
        lines += [
            f"{p.model}: states explored: {p.states}, transitions: {p.transitions}, max depth: {p.depth}, "
            f"elapsed: {p.seconds:.1f}s"
            for p in self.parts
        ]
        lines.append(
            f"states explored: {self.states}, transitions: {self.transitions}, max depth: {self.depth}, "
            f"elapsed: {self.seconds:.1f}s"
        )
        if self.ok:
            lines.append(
                "OK: every invariant holds in every reachable state; every state can still settle "
                "(with the engine idle, by the other threads alone)"
            )
            return "\n".join(lines)
        assert self.violation is not None
        lines.append(f"VIOLATION {self.violation.name} ({self.model} model): {self.violation.message}")
        lines.append(f"shortest counterexample ({len(self.trace)} steps):")
        lines += [f"  {i}. {step}" for i, step in enumerate(self.trace, 1)]
        if self.final_state:
            lines.append("state reached:")
            lines += [f"    {line}" for line in self.final_state]
        return "\n".join(lines)


class SearchModel(Protocol):
    """What the search needs of a model (``ComposedModel``, ``LifecycleModel``)."""

    name: str

    def describe(self) -> str: ...
    def initial(self) -> Any: ...
    def successors(self, w: Any) -> Iterator[tuple[Any, Any]]: ...
    def canonical(self, w: Any) -> Any: ...
    def settled(self, w: Any) -> bool: ...
    def unsettled(self, w: Any) -> list[str]: ...
    def check_state(self, w: Any) -> None: ...
    def check_move(self, before: Any, after: Any, label: Any) -> None: ...
    def label_text(self, label: Any) -> str: ...
    def change_text(self, a: Any, b: Any) -> str: ...
    def world_text(self, w: Any) -> list[str]: ...


MODELS = ("write", "lifecycle")


def check(
    bounds: Bounds | None = None,
    broken: str | None = None,
    *,
    specs: Mapping[str, MachineSpec] | None = None,
    protocol: ProtocolSpec | None = None,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    models: Sequence[str] = MODELS,
) -> CheckResult:
    """Breadth-first over every reachable state of each model in
    ``models``: the write path (``ComposedModel``, ``bounds``) and the
    lifecycle (``LifecycleModel``, ``bounds.life``); a catalogued mutation's
    own model first.

    Stops at the first (hence shallowest) invariant violation. With none,
    checks that every reachable state can still reach a settled state
    (reverse reachability over the explored graph) and reports the
    shallowest one that cannot. ``max_states`` aborts a world that grows
    past it (ValueError). ``progress(expanded, found, depth)`` is called
    every 1,000 expanded states. Raises SpecError for a spec the models
    cannot run.
    """
    bounds = bounds or Bounds()
    if broken in BROKEN and BROKEN[broken].at_least:
        raise_to = {k: max(v, getattr(bounds, k)) for k, v in BROKEN[broken].at_least.items()}
        bounds = dataclasses.replace(bounds, **raise_to)
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        raise ValueError(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    write = ComposedModel(bounds, broken, specs, protocol)
    built: dict[str, SearchModel] = {"write": write, "lifecycle": LifecycleModel(bounds.life, write.spec)}
    order = list(models)
    if broken in BROKEN and BROKEN[broken].model in order:
        order.remove(BROKEN[broken].model)
        order.insert(0, BROKEN[broken].model)
    result = CheckResult(bounds=bounds, broken=broken)
    for name in order:
        part = _search(built[name], result, max_states, progress)
        result.parts.append(part)
        result.states += part.states
        result.transitions += part.transitions
        result.depth = max(result.depth, part.depth)
        result.seconds += part.seconds
        if result.violation is not None:
            result.model = built[name].name
            break
    return result


def _trace(model: SearchModel, worlds: list[Any], parent: list[int], via: list[Any], i: int) -> list[str]:
    path = []
    while parent[i] >= 0:
        path.append(i)
        i = parent[i]
    return [
        f"{model.label_text(via[j])}  =>  {model.change_text(worlds[parent[j]], worlds[j])}" for j in reversed(path)
    ]


def _search(
    model: SearchModel,
    result: CheckResult,
    max_states: int | None,
    progress: Callable[[int, int, int], None] | None,
) -> PartResult:
    """One model's search; a violation goes into ``result``."""
    part = PartResult(model.name, model.describe())
    start = time.perf_counter()
    init = model.initial()
    index: dict[Any, int] = {init: 0}
    worlds: list[Any] = [init]
    parent: list[int] = [-1]
    via: list[Any] = [None]
    depth: list[int] = [0]
    succ: list[list[int]] = []
    # Per successor edge: an action of a thread other than the engine's (the idle rule's graph).
    background = getattr(model, "background", None)
    bg: list[list[bool]] = []
    transitions = 0

    def fail(i: int, exc: Violation, label: Any = None) -> PartResult:
        result.violation = exc
        result.trace = _trace(model, worlds, parent, via, i)
        if label is not None:
            result.trace.append(f"{model.label_text(label)}  =>  breaks {exc.name}")
        result.final_state = model.world_text(worlds[i])
        part.states, part.transitions = len(worlds), transitions
        part.depth = max(depth)
        part.seconds = time.perf_counter() - start
        return part

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
        out_bg: list[bool] = []
        try:
            for label, raw in model.successors(w):
                transitions += 1
                try:
                    model.check_move(w, raw, label)
                except Violation as exc:
                    exc.label = label
                    raise
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
                if background is not None:
                    out_bg.append(background(label))
        except Violation as exc:
            return fail(i, exc, exc.label)
        succ.append(out)
        bg.append(out_bg)
    part.states, part.transitions = len(worlds), transitions
    part.depth = max(depth)
    # The idle rule first: where the engine makes no further call, the other threads settle alone.
    if background is not None:
        idle = _idle_stuck(model, worlds, succ, bg)
        if idle is not None:
            worst = min(idle, key=lambda i: depth[i])
            why = "; ".join(model.unsettled(worlds[worst]))
            return fail(
                worst,
                Violation(
                    model.idle_invariant,  # type: ignore[attr-defined]
                    "the engine makes no further call here, and no sequence of the other threads' actions "
                    f"empties the queues and releases every staging page (unsettled there: {why})",
                ),
            )
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
    part.states, part.transitions = len(worlds), transitions
    part.depth = max(depth)
    if stuck:
        worst = min(stuck, key=lambda i: depth[i])
        reason = "no sequence of actions from the state reached settles it"
        if not succ[worst]:
            reason = "deadlock: no action is enabled in the state reached"
        why = "; ".join(model.unsettled(worlds[worst]))
        return fail(worst, Violation("can_settle", f"{reason} (unsettled there: {why})"))
    part.seconds = time.perf_counter() - start
    return part


def _idle_stuck(model: Any, worlds: list[Any], succ: list[list[int]], bg: list[list[bool]]) -> list[int] | None:
    """The worlds ``model.idle`` judges that reach no ``model.idle_settled``
    world over background edges alone (reverse reachability); None if none."""
    pred: list[list[int]] = [[] for _ in worlds]
    for i, outs in enumerate(succ):
        for j, back in zip(outs, bg[i]):
            if back:
                pred[j].append(i)
    can = bytearray(len(worlds))
    todo = deque(i for i, w in enumerate(worlds) if model.idle_settled(w))
    for i in todo:
        can[i] = 1
    while todo:
        for k in pred[todo.popleft()]:
            if not can[k]:
                can[k] = 1
                todo.append(k)
    stuck = [i for i, w in enumerate(worlds) if not can[i] and model.idle(w)]
    return stuck or None
