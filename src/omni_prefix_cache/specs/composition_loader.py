"""Load and validate the composition spec (``spec/protocol.yaml``): the
``ProtocolSpec`` it parses into, checked against the shipped component
machine specs (``specs.loader``) when it is read, not when it runs.

``ProtocolSpec.mutated`` returns a patched copy: the model checker's broken
variants and spec mutants are patches of this spec, not switches in code.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from omni_prefix_cache.specs.composition_executors import parse_executors
from omni_prefix_cache.specs.composition_grammar import (
    Couple,
    Do,
    Executor,
    Fire,
    FirstOf,
    OperationSpec,
    Segment,
    Step,
    When,
)
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec, spec_dir

_TOP_KEYS = {
    "name",
    "description",
    "components",
    "locks",
    "executors",
    "pairs",
    "links",
    "effects",
    "guards",
    "operations",
    "orderings",
    "invariants",
}
_OP_KEYS = {"name", "caller", "meaning", "for_each", "entry", "segments"}


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
    executors: Mapping[str, Executor]
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

    def share(self, executor: str, operation: str, *segments: str) -> OperationSpec:
        """What ``executor`` runs of ``operation`` (of the named ``segments``
        only, when given): its steps projected on the executor's roles in
        that operation and its effects. KeyError for an unknown executor,
        operation or segment."""
        ex = self.executors[executor]
        op = self.ops[operation]
        if segments:
            op = op.only(*segments)
        return op.projected(ex.roles_in(operation), ex.effects)

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
    operations = _operations(data.get("operations") or [], parser, {lk.name for lk in locks})
    executors = parse_executors(data.get("executors"), components, {e.name for e in effects}, operations, origin)
    # Checked in this order, so a spec with several faults names the first one.
    links = _links(data.get("links") or [], parser)
    pairs = _pairs(data.get("pairs") or {}, components, origin)
    orderings = _orderings(data.get("orderings") or [], operations, origin)
    spec = ProtocolSpec(
        name=str(data.get("name")),
        description=str(data.get("description", "")).strip(),
        components=components,
        locks=locks,
        executors=executors,
        pairs=pairs,
        links=links,
        effects=effects,
        guards=guards,
        operations=operations,
        orderings=orderings,
        invariants=invariants,
        raw=data,
        origin=origin,
    )
    if check_coverage:
        _check_coverage(spec)
    if check_orderings:
        bad_orders = spec.ordering_violations()
        if bad_orders:
            raise _fail(origin, "orderings", "; ".join(bad_orders))
    return spec


def _operations(raw_ops: Any, parser: _Parser, lock_names: set[str]) -> tuple[OperationSpec, ...]:
    origin = parser.origin
    operations: list[OperationSpec] = []
    for i, raw in enumerate(raw_ops):
        if not isinstance(raw, Mapping) or not set(raw) <= _OP_KEYS or "name" not in raw:
            raise _fail(origin, f"operation #{i}", f"fields are {sorted(_OP_KEYS)}")
        name = str(raw["name"])
        where = f"operation {name}"
        if any(op.name == name for op in operations):
            raise _fail(origin, where, "declared twice")
        for_each = raw.get("for_each")
        if for_each is not None and for_each not in parser.components:
            raise _fail(origin, where, f"for_each names no role: {for_each!r}")
        segments = tuple(
            _segment(seg, parser, lock_names, f"{where} segment #{j}")
            for j, seg in enumerate(raw.get("segments") or [])
        )
        if not segments:
            raise _fail(origin, where, "has no segments")
        names = [seg.name for seg in segments]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise _fail(origin, where, f"segment names {twice} are used twice (executors run a segment by name)")
        entry = parser.fire(str(raw["entry"]), f"{where} entry") if "entry" in raw else None
        op = OperationSpec(name, str(raw.get("caller", "")), str(raw.get("meaning", "")), for_each, segments, entry)
        if entry is not None and (entry.role, entry.trigger) not in op.moves:
            raise _fail(origin, where, f"entry {entry.label} is not a move of the operation")
        operations.append(op)
    return tuple(operations)


def _segment(seg: Any, parser: _Parser, lock_names: set[str], where: str) -> Segment:
    if not isinstance(seg, Mapping):
        raise _fail(parser.origin, where, "must be a mapping")
    name = seg.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise _fail(parser.origin, where, f"needs a 'name' (an identifier), got {name!r}")
    where = f"{where} ({name})"
    if "wait" in seg:
        if not set(seg) <= {"name", "wait", "of", "raises"}:
            raise _fail(parser.origin, where, "a wait takes 'of' and an optional 'raises'")
        raises = parser.guard(seg["raises"], where)[0] if "raises" in seg else None
        return Segment(name, "none", (), str(seg["wait"]), str(seg.get("of", "")), raises)
    if set(seg) != {"name", "lock", "steps"} or seg["lock"] not in lock_names:
        raise _fail(parser.origin, where, f"needs 'name', 'lock' (one of {sorted(lock_names)}) and 'steps'")
    return Segment(name, str(seg["lock"]), parser.steps(seg["steps"], where))


def _links(raw_links: Any, parser: _Parser) -> tuple[Link, ...]:
    links: list[Link] = []
    for i, raw in enumerate(raw_links):
        where = f"link #{i}"
        role, _, eff = str(raw.get("effect", "")).partition(".")
        if role not in parser.components or eff not in parser.components[role].effect_names:
            raise _fail(parser.origin, where, f"{raw.get('effect')!r} is no effect of a component")
        links.append(Link((role, eff), parser.fire(str(raw.get("fires", "")), where), str(raw.get("meaning", ""))))
    return tuple(links)


def _pairs(pairs_raw: Any, components: Mapping[str, MachineSpec], origin: str) -> dict[str, tuple[str, ...]]:
    pairs = {str(k): tuple(v) for k, v in pairs_raw.items()}
    if "position" in components and "task" in components:
        if set(pairs) != set(components["position"].state_names):
            raise _fail(origin, "pairs", f"must list every {components['position'].name} state")
        bad = {t for ts in pairs.values() for t in ts} - set(components["task"].state_names)
        if bad:
            raise _fail(origin, "pairs", f"unknown task states {sorted(bad)}")
    return pairs


def _orderings(raw_orders: Any, operations: tuple[OperationSpec, ...], origin: str) -> tuple[Ordering, ...]:
    orderings = []
    for i, raw in enumerate(raw_orders):
        op_name = str(raw.get("operation"))
        if op_name not in {o.name for o in operations}:
            raise _fail(origin, f"ordering #{i}", f"names no operation: {op_name!r}")
        orderings.append(Ordering(str(raw["name"]), op_name, tuple(raw["order"]), str(raw.get("meaning", ""))))
    return tuple(orderings)


def _check_coverage(spec: ProtocolSpec) -> None:
    """Every component trigger is fired by an operation, a link or a
    coupling, and every declared effect is used; else SpecError."""
    components = spec.components
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
        if unused:
            raise _fail(spec.origin, f"component {role}", f"{machine.name} triggers {unused} are fired by no operation")
    used_effects = {s.effect for op in spec.operations for s in op.walk() if isinstance(s, Do)}
    if spec.effect_names - used_effects:
        unused_effects = sorted(spec.effect_names - used_effects)
        raise _fail(spec.origin, "effects", f"declared but used by no operation: {unused_effects}")


@functools.cache
def load_protocol(name: str = "protocol") -> ProtocolSpec:
    """The shipped composition ``spec/<name>.yaml`` (cached per process)."""
    path = spec_dir() / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path.name}: cannot read: {exc}") from exc
    return parse_protocol(data, origin=path.name)
