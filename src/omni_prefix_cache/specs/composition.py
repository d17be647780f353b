"""Load, validate and compile the composition spec (``spec/protocol.yaml``).

The composition names the component machines by role (``task`` ->
``write_task``, ...) and declares every facade and committer operation as
segments of steps over them. A segment runs atomically under one lock;
other threads interleave only between segments. Steps:

- ``"role.trigger"``: fire a component move; it must be enabled;
- ``"role.trigger?"``: fire it where enabled, else nothing;
- ``{do: EFFECT}``: a protocol effect declared in ``effects``;
- ``{when: GUARD, then: [...], else: [...]}`` (``GUARD`` may be ``not NAME``);
- ``{first_of: [[...], ...]}``: the first alternative whose leading step is
  an enabled move (or which starts with no move) runs;
- ``{couple: role.COUPLING}``: a coupling the role's machine declares.

``compile_operation`` turns an operation into plain closures over a
``Binding`` (the runtime's, the model checker's or a test's handlers), so
no YAML is interpreted per call. ``ProtocolSpec.mutated`` returns a patched
copy: the model checker's broken variants and spec mutants are patches of
this spec, not switches in code.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec, spec_dir

# Files in spec/ that are compositions, not machines (spec_names skips them).
COMPOSITION_NAMES = ("protocol",)

_TOP_KEYS = {
    "name",
    "description",
    "components",
    "locks",
    "pairs",
    "links",
    "effects",
    "guards",
    "operations",
    "orderings",
    "invariants",
}
_OP_KEYS = {"name", "caller", "meaning", "for_each", "entry", "segments"}


# ----------------------------------------------------------------- steps


@dataclass(frozen=True, eq=False)
class Fire:
    """Fire ``trigger`` on ``role``'s instance; ``optional`` = only where enabled."""

    role: str
    trigger: str
    optional: bool

    @property
    def label(self) -> str:
        return f"{self.role}.{self.trigger}" + ("?" if self.optional else "")


@dataclass(frozen=True, eq=False)
class Do:
    effect: str

    @property
    def label(self) -> str:
        return self.effect


@dataclass(frozen=True, eq=False)
class When:
    guard: str
    negate: bool
    then: tuple[Step, ...]
    orelse: tuple[Step, ...]

    @property
    def label(self) -> str:
        return f"when {'not ' if self.negate else ''}{self.guard}"


@dataclass(frozen=True, eq=False)
class FirstOf:
    alternatives: tuple[tuple[Step, ...], ...]

    @property
    def label(self) -> str:
        return "first of"


@dataclass(frozen=True, eq=False)
class Couple:
    role: str
    coupling: str

    @property
    def label(self) -> str:
        return f"{self.role}.{self.coupling}"


Step = Fire | Do | When | FirstOf | Couple


@dataclass(frozen=True, eq=False)
class Segment:
    """Atomic under ``lock`` (``steps``), or a blocking wait (``wait``)."""

    lock: str
    steps: tuple[Step, ...] = ()
    wait: str | None = None
    of: str | None = None
    raises: str | None = None

    @property
    def label(self) -> str:
        return f"wait {self.wait}" if self.wait else f"[{self.lock}]"


@dataclass(frozen=True, eq=False)
class OperationSpec:
    name: str
    caller: str
    meaning: str
    for_each: str | None
    segments: tuple[Segment, ...]
    # The move that admits an instance: the operation runs for it only while
    # this move is enabled, and is a no-op otherwise (e.g. fail of a task
    # already terminal). None: always runs.
    entry: Fire | None = None

    def walk(self) -> Iterator[Step]:
        """Every step, depth first, in declaration order."""
        for seg in self.segments:
            yield from _walk(seg.steps)

    @functools.cached_property
    def moves(self) -> frozenset[tuple[str, str]]:
        """(role, trigger) of every move this operation may fire."""
        return frozenset((s.role, s.trigger) for s in self.walk() if isinstance(s, Fire))

    def segment(self, index: int, name: str | None = None) -> OperationSpec:
        """Segment ``index`` alone, as an operation (an executor runs the
        segments of an operation it shares with another executor)."""
        seg = self.segments[index]
        return OperationSpec(name or f"{self.name}[{index}]", self.caller, self.meaning, self.for_each, (seg,))

    def projected(self, roles: frozenset[str], effects: frozenset[str], name: str | None = None) -> OperationSpec:
        """The steps of ``roles`` and ``effects`` only, in the same order and
        under the same guards (a ``when`` whose branches project to nothing
        is dropped; an empty segment stays, as a no-op): what one executor
        runs of an operation whose other steps another executor runs."""

        def keep(steps: tuple[Step, ...]) -> tuple[Step, ...]:
            out: list[Step] = []
            for s in steps:
                if isinstance(s, Fire | Couple):
                    if s.role in roles:
                        out.append(s)
                elif isinstance(s, Do):
                    if s.effect in effects:
                        out.append(s)
                elif isinstance(s, When):
                    then, orelse = keep(s.then), keep(s.orelse)
                    if then or orelse:
                        out.append(When(s.guard, s.negate, then, orelse))
                else:
                    alts = tuple(keep(a) for a in s.alternatives)
                    if any(alts):
                        out.append(FirstOf(alts))
            return tuple(out)

        segments = tuple(
            seg if seg.wait else Segment(seg.lock, keep(seg.steps), None, None, None) for seg in self.segments
        )
        return OperationSpec(name or f"{self.name}|{sorted(roles)}", self.caller, self.meaning, self.for_each, segments)

    def order_labels(self) -> list[str]:
        """Step labels in order (waits as ``wait EVENT``), for ordering rules."""
        out: list[str] = []
        for seg in self.segments:
            if seg.wait:
                out.append(f"wait {seg.wait}")
            out.extend(s.label for s in _walk(seg.steps) if isinstance(s, Fire | Do | Couple))
        return out


def _walk(steps: Sequence[Step]) -> Iterator[Step]:
    for s in steps:
        yield s
        if isinstance(s, When):
            yield from _walk(s.then)
            yield from _walk(s.orelse)
        elif isinstance(s, FirstOf):
            for alt in s.alternatives:
                yield from _walk(alt)


@dataclass(frozen=True, eq=False)
class Named:
    name: str
    meaning: str


@dataclass(frozen=True, eq=False)
class InvariantSpec:
    name: str
    meaning: str
    checked_by: tuple[str, ...]  # "model" and/or "tests": who must bind a checker


@dataclass(frozen=True, eq=False)
class Link:
    """A component effect implemented by firing another component's move."""

    effect: tuple[str, str]  # (role, effect name)
    fires: Fire
    meaning: str


@dataclass(frozen=True, eq=False)
class Ordering:
    name: str
    operation: str
    order: tuple[str, ...]
    meaning: str


@dataclass(frozen=True, eq=False)
class ProtocolSpec:
    name: str
    description: str
    components: Mapping[str, MachineSpec]
    locks: tuple[Named, ...]
    pairs: Mapping[str, tuple[str, ...]]
    links: tuple[Link, ...]
    effects: tuple[Named, ...]
    guards: tuple[Named, ...]
    operations: tuple[OperationSpec, ...]
    orderings: tuple[Ordering, ...]
    invariants: tuple[InvariantSpec, ...]
    raw: Mapping[str, Any] = field(repr=False)
    origin: str = "protocol.yaml"

    @functools.cached_property
    def ops(self) -> dict[str, OperationSpec]:
        return {op.name: op for op in self.operations}

    @property
    def effect_names(self) -> frozenset[str]:
        return frozenset(e.name for e in self.effects)

    @property
    def guard_names(self) -> frozenset[str]:
        return frozenset(g.name for g in self.guards)

    @property
    def invariant_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.invariants)

    def invariants_for(self, checker: str) -> tuple[str, ...]:
        """Names of the invariants ``checker`` ("model" or "tests") must check."""
        return tuple(i.name for i in self.invariants if checker in i.checked_by)

    def ordering_violations(self) -> list[str]:
        """Ordering rules the operations' step order breaks (empty when sound)."""
        out = []
        for rule in self.orderings:
            labels = self.ops[rule.operation].order_labels()
            where = [labels.index(item) if item in labels else -1 for item in rule.order]
            if any(i < 0 for i in where):
                missing = [item for item, i in zip(rule.order, where) if i < 0]
                out.append(f"{rule.name}: operation {rule.operation} has no step {missing}")
            elif where != sorted(where):
                out.append(f"{rule.name}: operation {rule.operation} runs {labels} (rule order {list(rule.order)})")
        return out

    def mutated(
        self, patch: Callable[[dict[str, Any]], None], *, check_orderings: bool = False, check_coverage: bool = True
    ) -> ProtocolSpec:
        """A copy with ``patch`` applied to the raw mapping, re-validated.
        Ordering rules are not enforced on a mutant (breaking one is what a
        mutant may do; the model check and the tests must find it);
        ``check_coverage=False`` also lets it drop every firing of a move or
        every use of an effect."""
        data = copy.deepcopy(dict(self.raw))
        patch(data)
        return parse_protocol(
            data, origin=f"{self.origin} (mutated)", check_orderings=check_orderings, check_coverage=check_coverage
        )


# ----------------------------------------------------------------- parsing


def _fail(origin: str, where: str, what: str) -> SpecError:
    return SpecError(f"{origin}: {where}: {what}")


def _named_list(data: Any, origin: str, where: str) -> tuple[Named, ...]:
    if not isinstance(data, list):
        raise _fail(origin, where, "must be a list of {name, meaning}")
    out: list[Named] = []
    for i, raw in enumerate(data):
        if not isinstance(raw, Mapping) or set(raw) != {"name", "meaning"}:
            raise _fail(origin, f"{where} #{i}", "needs exactly 'name' and 'meaning'")
        name = raw["name"]
        if not isinstance(name, str) or not name.isidentifier():
            raise _fail(origin, f"{where} #{i}", f"'name' must be an identifier, got {name!r}")
        if any(n.name == name for n in out):
            raise _fail(origin, f"{where} {name}", "declared twice")
        out.append(Named(name, str(raw["meaning"]).strip()))
    return tuple(out)


def _invariants(data: Any, origin: str) -> tuple[InvariantSpec, ...]:
    if not isinstance(data, list):
        raise _fail(origin, "invariants", "must be a list of {name, meaning, checked_by}")
    out: list[InvariantSpec] = []
    for i, raw in enumerate(data):
        if not isinstance(raw, Mapping) or set(raw) != {"name", "meaning", "checked_by"}:
            raise _fail(origin, f"invariant #{i}", "needs exactly 'name', 'meaning' and 'checked_by'")
        by = tuple(raw["checked_by"]) if isinstance(raw["checked_by"], list) else ()
        if not by or not set(by) <= {"model", "tests"}:
            raise _fail(origin, f"invariant {raw['name']}", "'checked_by' is a non-empty list of model, tests")
        if any(inv.name == raw["name"] for inv in out):
            raise _fail(origin, f"invariant {raw['name']}", "declared twice")
        out.append(InvariantSpec(str(raw["name"]), str(raw["meaning"]).strip(), by))
    return tuple(out)


class _Parser:
    def __init__(self, origin: str, components: Mapping[str, MachineSpec], effects: set[str], guards: set[str]):
        self.origin = origin
        self.components = components
        self.effects = effects
        self.guards = guards

    def fire(self, text: str, where: str) -> Fire:
        optional = text.endswith("?")
        role, _, trigger = text.removesuffix("?").partition(".")
        machine = self.components.get(role)
        if machine is None:
            raise _fail(self.origin, where, f"unknown role {role!r} in {text!r} (roles: {sorted(self.components)})")
        if trigger not in machine.triggers:
            raise _fail(self.origin, where, f"{machine.name} has no trigger {trigger!r} (in {text!r})")
        return Fire(role, trigger, optional)

    def guard(self, text: Any, where: str) -> tuple[str, bool]:
        if not isinstance(text, str):
            raise _fail(self.origin, where, f"a guard must be a name, got {text!r}")
        negate = text.startswith("not ")
        name = text.removeprefix("not ").strip()
        if name not in self.guards:
            raise _fail(self.origin, where, f"undeclared guard {name!r}")
        return name, negate

    def steps(self, raw: Any, where: str) -> tuple[Step, ...]:
        if not isinstance(raw, list):
            raise _fail(self.origin, where, "steps must be a list")
        return tuple(self.step(s, f"{where} step #{i}") for i, s in enumerate(raw))

    def step(self, raw: Any, where: str) -> Step:
        if isinstance(raw, str):
            return self.fire(raw, where)
        if not isinstance(raw, Mapping):
            raise _fail(self.origin, where, f"a step is a move name or a mapping, got {raw!r}")
        if set(raw) == {"do"}:
            if raw["do"] not in self.effects:
                raise _fail(self.origin, where, f"undeclared effect {raw['do']!r}")
            return Do(raw["do"])
        if "when" in raw:
            if not set(raw) <= {"when", "then", "else"} or "then" not in raw:
                raise _fail(self.origin, where, "'when' takes 'then' and an optional 'else'")
            name, negate = self.guard(raw["when"], where)
            return When(name, negate, self.steps(raw["then"], where), self.steps(raw.get("else", []), where))
        if set(raw) == {"first_of"}:
            alts = raw["first_of"]
            if not isinstance(alts, list) or not alts:
                raise _fail(self.origin, where, "'first_of' takes a non-empty list of step lists")
            return FirstOf(tuple(self.steps(a, f"{where} alternative #{i}") for i, a in enumerate(alts)))
        if set(raw) == {"couple"}:
            role, _, name = str(raw["couple"]).partition(".")
            machine = self.components.get(role)
            if machine is None or name not in {c.name for c in machine.couplings}:
                raise _fail(self.origin, where, f"no coupling {raw['couple']!r}")
            return Couple(role, name)
        raise _fail(self.origin, where, f"unknown step form {dict(raw)!r}")


def parse_protocol(
    data: Mapping[str, Any], origin: str = "protocol.yaml", *, check_orderings: bool = True, check_coverage: bool = True
) -> ProtocolSpec:
    """Validate a composition mapping against the shipped component specs.

    Raises SpecError naming the item on: unknown fields, a role naming no
    machine, a step firing a trigger its machine lacks, an undeclared effect,
    guard or lock, a `pairs` table not covering the position machine, a
    component trigger no operation or link fires (``check_coverage``), and
    (``check_orderings``) an ordering rule the operations' step order breaks.
    """
    if not isinstance(data, Mapping):
        raise _fail(origin, "top level", "must be a mapping")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise _fail(origin, "top level", f"unknown fields {sorted(unknown)}")
    raw_components = data.get("components")
    if not isinstance(raw_components, Mapping) or not raw_components:
        raise _fail(origin, "components", "must map role -> machine spec name")
    components = {str(role): load_spec(str(name)) for role, name in raw_components.items()}
    locks = _named_list(data.get("locks"), origin, "locks")
    effects = _named_list(data.get("effects"), origin, "effects")
    guards = _named_list(data.get("guards"), origin, "guards")
    invariants = _invariants(data.get("invariants"), origin)
    parser = _Parser(origin, components, {e.name for e in effects}, {g.name for g in guards})
    lock_names = {lk.name for lk in locks}

    operations: list[OperationSpec] = []
    for i, raw in enumerate(data.get("operations") or []):
        if not isinstance(raw, Mapping) or not set(raw) <= _OP_KEYS or "name" not in raw:
            raise _fail(origin, f"operation #{i}", f"fields are {sorted(_OP_KEYS)}")
        name = str(raw["name"])
        where = f"operation {name}"
        if any(op.name == name for op in operations):
            raise _fail(origin, where, "declared twice")
        for_each = raw.get("for_each")
        if for_each is not None and for_each not in components:
            raise _fail(origin, where, f"for_each names no role: {for_each!r}")
        segments: list[Segment] = []
        for j, seg in enumerate(raw.get("segments") or []):
            swhere = f"{where} segment #{j}"
            if not isinstance(seg, Mapping):
                raise _fail(origin, swhere, "must be a mapping")
            if "wait" in seg:
                if not set(seg) <= {"wait", "of", "raises"}:
                    raise _fail(origin, swhere, "a wait takes 'of' and an optional 'raises'")
                raises = parser.guard(seg["raises"], swhere)[0] if "raises" in seg else None
                segments.append(Segment("none", (), str(seg["wait"]), str(seg.get("of", "")), raises))
                continue
            if set(seg) != {"lock", "steps"} or seg["lock"] not in lock_names:
                raise _fail(origin, swhere, f"needs 'lock' (one of {sorted(lock_names)}) and 'steps'")
            segments.append(Segment(str(seg["lock"]), parser.steps(seg["steps"], swhere)))
        if not segments:
            raise _fail(origin, where, "has no segments")
        entry = parser.fire(str(raw["entry"]), f"{where} entry") if "entry" in raw else None
        op = OperationSpec(
            name, str(raw.get("caller", "")), str(raw.get("meaning", "")), for_each, tuple(segments), entry
        )
        if entry is not None and (entry.role, entry.trigger) not in op.moves:
            raise _fail(origin, where, f"entry {entry.label} is not a move of the operation")
        operations.append(op)

    links: list[Link] = []
    for i, raw in enumerate(data.get("links") or []):
        where = f"link #{i}"
        role, _, eff = str(raw.get("effect", "")).partition(".")
        if role not in components or eff not in components[role].effect_names:
            raise _fail(origin, where, f"{raw.get('effect')!r} is no effect of a component")
        links.append(Link((role, eff), parser.fire(str(raw.get("fires", "")), where), str(raw.get("meaning", ""))))

    pairs_raw = data.get("pairs") or {}
    pairs = {str(k): tuple(v) for k, v in pairs_raw.items()}
    if "position" in components and "task" in components:
        if set(pairs) != set(components["position"].state_names):
            raise _fail(origin, "pairs", f"must list every {components['position'].name} state")
        bad = {t for ts in pairs.values() for t in ts} - set(components["task"].state_names)
        if bad:
            raise _fail(origin, "pairs", f"unknown task states {sorted(bad)}")

    orderings = []
    for i, raw in enumerate(data.get("orderings") or []):
        op_name = str(raw.get("operation"))
        if op_name not in {o.name for o in operations}:
            raise _fail(origin, f"ordering #{i}", f"names no operation: {op_name!r}")
        orderings.append(Ordering(str(raw["name"]), op_name, tuple(raw["order"]), str(raw.get("meaning", ""))))

    spec = ProtocolSpec(
        name=str(data.get("name")),
        description=str(data.get("description", "")).strip(),
        components=components,
        locks=locks,
        pairs=pairs,
        links=tuple(links),
        effects=effects,
        guards=guards,
        operations=tuple(operations),
        orderings=tuple(orderings),
        invariants=invariants,
        raw=data,
        origin=origin,
    )
    fired = {(s.role, s.trigger) for op in spec.operations for s in op.walk() if isinstance(s, Fire)}
    fired |= {(lk.fires.role, lk.fires.trigger) for lk in spec.links}
    for op in spec.operations:
        for s in op.walk():
            if isinstance(s, Couple):
                c = next(c for c in components[s.role].couplings if c.name == s.coupling)
                fired |= {(s.role, c.fires), (s.role, c.others)}
    machines_fired = {(components[r].name, t) for r, t in fired}
    for role, machine in components.items():
        unused = [t for t in machine.triggers if (machine.name, t) not in machines_fired]
        if unused and check_coverage:
            raise _fail(origin, f"component {role}", f"{machine.name} triggers {unused} are fired by no operation")
    used_effects = {s.effect for op in spec.operations for s in op.walk() if isinstance(s, Do)}
    if spec.effect_names - used_effects and check_coverage:
        raise _fail(origin, "effects", f"declared but used by no operation: {sorted(spec.effect_names - used_effects)}")
    if check_orderings:
        bad_orders = spec.ordering_violations()
        if bad_orders:
            raise _fail(origin, "orderings", "; ".join(bad_orders))
    return spec


@functools.cache
def load_protocol(name: str = "protocol") -> ProtocolSpec:
    """The shipped composition ``spec/<name>.yaml`` (cached per process)."""
    path = spec_dir() / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path.name}: cannot read: {exc}") from exc
    return parse_protocol(data, origin=path.name)


# ----------------------------------------------------------------- compiling


class Binding(Protocol):
    """What an executor of the protocol supplies (runtime, model, test).

    Resolved once per step at compile time, so a call pays a closure call,
    not a name lookup: ``move(role, trigger)`` returns ``(enabled, fire)``,
    where ``enabled(ctx)`` says whether the move may fire now (its source
    state and guards) and ``fire(ctx)`` performs it with its effects;
    ``coupling(role, name)`` returns the coupling's runner. ``ctx`` is the
    executor's per-call context (a task, a world, a step...).

    Optional: ``try_move(role, trigger)`` returns ``attempt(ctx) -> bool``,
    which fires the move if it is enabled, atomically, and says whether it
    did. Where a binding has it, a step calls it instead of ``enabled`` then
    ``fire`` (one check, no window between them); ``first_of`` still tests
    its alternatives with ``enabled``.
    """

    def move(self, role: str, trigger: str) -> tuple[Callable[[Any], bool], Callable[[Any], None]]: ...

    def coupling(self, role: str, name: str) -> Callable[[Any], None]: ...


Run = Callable[[Any], None]


class ProtocolViolation(SpecError):
    """An operation tried a move its spec lists but the state does not allow."""


@dataclass(frozen=True, eq=False, slots=True)
class CompiledOperation:
    """An operation bound to an executor: one closure per segment (a wait
    segment compiles to a no-op: the executor performs waits itself, see
    ``spec.segments[i].wait``), and ``admits(ctx)`` from its entry move."""

    spec: OperationSpec
    segments: tuple[Run, ...]
    admits: Callable[[Any], bool]

    def run(self, ctx: Any) -> bool:
        """All segments in order, if the entry move admits ``ctx`` (no locks
        taken: for executors that hold what the segments need, or none)."""
        if not self.admits(ctx):
            return False
        for seg in self.segments:
            seg(ctx)
        return True


def _always(ctx: Any) -> bool:
    return True


def compile_operation(
    op: OperationSpec,
    binding: Binding,
    effects: Mapping[str, Callable[[Any], None]],
    guards: Mapping[str, Callable[[Any], bool]],
) -> CompiledOperation:
    """Bind ``op`` to ``binding`` and the effect/guard handlers. A handler
    missing from the mappings raises SpecError now, not at the first call."""

    def steps(seq: tuple[Step, ...]) -> Run:
        runs = tuple(step(s) for s in seq)
        if len(runs) == 1:
            return runs[0]

        def run_all(ctx: Any) -> None:
            for r in runs:
                r(ctx)

        return run_all

    try_move: Callable[[str, str], Callable[[Any], bool]] | None = getattr(binding, "try_move", None)

    def step(s: Step) -> Run:
        if isinstance(s, Fire) and try_move is not None:
            attempt = try_move(s.role, s.trigger)
            if s.optional:
                return attempt  # type: ignore[return-value]  # its bool is ignored
            what = s.label

            def must_now(ctx: Any) -> None:
                if not attempt(ctx):
                    raise ProtocolViolation(f"operation {op.name}: {what} is not enabled for {ctx!r}")

            return must_now
        if isinstance(s, Fire):
            enabled, fire = binding.move(s.role, s.trigger)
            if s.optional:

                def maybe(ctx: Any) -> None:
                    if enabled(ctx):
                        fire(ctx)

                return maybe
            label = s.label

            def must(ctx: Any) -> None:
                if not enabled(ctx):
                    raise ProtocolViolation(f"operation {op.name}: {label} is not enabled for {ctx!r}")
                fire(ctx)

            return must
        if isinstance(s, Do):
            if s.effect not in effects:
                raise SpecError(f"operation {op.name}: effect {s.effect!r} has no handler")
            return effects[s.effect]
        if isinstance(s, When):
            if s.guard not in guards:
                raise SpecError(f"operation {op.name}: guard {s.guard!r} has no handler")
            g, neg = guards[s.guard], s.negate
            then = steps(s.then) if s.then else None
            orelse = steps(s.orelse) if s.orelse else None

            def when(ctx: Any) -> None:
                if bool(g(ctx)) != neg:
                    if then is not None:
                        then(ctx)
                elif orelse is not None:
                    orelse(ctx)

            return when
        if isinstance(s, FirstOf):
            alts: list[tuple[Callable[[Any], bool], Run | None]] = []
            for alt in s.alternatives:
                head = alt[0] if alt else None
                test = binding.move(head.role, head.trigger)[0] if isinstance(head, Fire) else _always
                alts.append((test, steps(alt) if alt else None))

            def first_of(ctx: Any) -> None:
                for test, run in alts:
                    if test(ctx):
                        if run is not None:
                            run(ctx)
                        return

            return first_of
        if isinstance(s, Couple):
            return binding.coupling(s.role, s.coupling)
        raise TypeError(s)  # pragma: no cover - the parser builds only the forms above

    def nothing(ctx: Any) -> None:
        return None

    segments = tuple(steps(seg.steps) if seg.steps else nothing for seg in op.segments)
    admits = binding.move(op.entry.role, op.entry.trigger)[0] if op.entry is not None else _always
    return CompiledOperation(op, segments, admits)


def compile_protocol(
    spec: ProtocolSpec,
    binding: Binding,
    effects: Mapping[str, Callable[[Any], None]],
    guards: Mapping[str, Callable[[Any], bool]],
    *,
    only: Sequence[str] | None = None,
) -> dict[str, CompiledOperation]:
    """``compile_operation`` for every operation (or those in ``only``)."""
    names = spec.ops if only is None else only
    unknown = [n for n in names if n not in spec.ops]
    if unknown:
        raise SpecError(f"{spec.origin}: no operations {unknown}")
    return {n: compile_operation(spec.ops[n], binding, effects, guards) for n in names}
