"""Load and validate state-machine specs.

A spec is a YAML mapping in the dict shape ``transitions.Machine`` accepts
(``states`` with ``name``/``final``, ``transitions`` with ``trigger``,
``source``, ``dest``, ``conditions``, ``after``), extended with:

- ``name`` / ``enum`` / ``description`` at the top level;
- per state: ``meaning`` (one line), ``initial``, ``tags``;
- per move: ``meaning`` and ``deferrable``: the subset of its effects that a
  caller may run later, once it has published a record the woken waiters
  must find (e.g. a failure record before the failure wakes joiners);
- ``invariants``: a list of ``{name, meaning}``;
- ``couplings``: rules tying several instances of the machine together in
  one move, ``{name, fires, others, meaning}``: the runtime fires trigger
  ``fires`` on the instances an operation names and ``others`` on every
  other instance it covers (e.g. slot tenancy: the keys a save writes
  ``map``, every other key of the same slots ``reset``).

Validation here is structural. Whether every guard/effect name is one the
runtime registers is checked when the spec is compiled against the
runtime's handlers (``compiled.compile_machine``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError

# The package that carries spec/*.yaml (mapped onto the repo's spec/ folder).
SPEC_PACKAGE = "omni_prefix_cache._spec"

_TOP_KEYS = {"name", "enum", "description", "states", "transitions", "invariants", "couplings"}
_COUPLING_KEYS = {"name", "fires", "others", "meaning"}
_STATE_KEYS = {"name", "meaning", "initial", "final", "tags"}
_MOVE_KEYS = {"trigger", "source", "dest", "conditions", "after", "meaning", "deferrable"}
# The state tags the runtime asks for (docs/spec_format.md lists their meanings).
KNOWN_TAGS = frozenset(
    {
        *("rest", "waits", "accepts_chunks", "failure", "owned", "holds_page", "read_baseline", "read_owner"),
        *("read_pool", "read_refused", "tier_held"),
    }
)


# A trigger of the machine being compiled, as its spec spells it. The generic
# loader and compiler serve every machine, so they cannot name one machine's
# trigger enum; each runtime module types its own triggers with its spec's
# generated ``<Spec>Trigger`` (specs/types/), a StrEnum and so a TriggerName too.
TriggerName: TypeAlias = str


class SpecError(OmniPrefixCacheUnmatchError):
    """A spec file is malformed; the message names the file and the item."""


@dataclass(frozen=True, eq=False)
class StateSpec:
    name: str
    meaning: str
    initial: bool
    final: bool
    tags: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class MoveSpec:
    trigger: TriggerName
    source: tuple[str, ...]
    dest: str
    guards: tuple[str, ...]
    effects: tuple[str, ...]
    meaning: str
    deferrable: tuple[str, ...]

    @property
    def label(self) -> str:
        """``trigger [guard, ...] / effect, ...`` as the diagrams show it."""
        text = self.trigger
        if self.guards:
            text += f" [{', '.join(self.guards)}]"
        if self.effects:
            text += f" / {', '.join(self.effects)}"
        return text


@dataclass(frozen=True, eq=False)
class InvariantSpec:
    name: str
    meaning: str


@dataclass(frozen=True, eq=False)
class CouplingSpec:
    """One move over several instances: ``fires`` on the named ones,
    ``others`` on the rest the operation covers."""

    name: str
    fires: TriggerName
    others: TriggerName
    meaning: str


@dataclass(frozen=True, eq=False)
class MachineSpec:
    """A validated machine declaration. Identity equality on purpose:
    ``transitions`` compares models with ``==`` and skips equal ones."""

    name: str
    enum_name: str
    description: str
    states: tuple[StateSpec, ...]
    moves: tuple[MoveSpec, ...]
    invariants: tuple[InvariantSpec, ...]
    origin: str
    couplings: tuple[CouplingSpec, ...] = ()

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def initial(self) -> str:
        return next(s.name for s in self.states if s.initial)

    @property
    def final_states(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if s.final)

    @property
    def triggers(self) -> tuple[TriggerName, ...]:
        """Distinct triggers in declaration order."""
        return tuple(dict.fromkeys(m.trigger for m in self.moves))

    @property
    def guard_names(self) -> frozenset[str]:
        return frozenset(g for m in self.moves for g in m.guards)

    @property
    def effect_names(self) -> frozenset[str]:
        return frozenset(e for m in self.moves for e in m.effects)

    def settling_states(self) -> tuple[str, ...]:
        """Where every state must be able to end up: the final states, or for
        a machine that cycles forever (no final state), its ``rest`` states."""
        return self.final_states or tuple(s.name for s in self.states if "rest" in s.tags)

    def tagged(self, tag: str) -> tuple[str, ...]:
        return tuple(s.name for s in self.states if tag in s.tags)


def _fail(origin: str, where: str, what: str) -> SpecError:
    return SpecError(f"{origin}: {where}: {what}")


def _names(value: Any, origin: str, where: str, field: str) -> tuple[str, ...]:
    """A name or list of names (the ``transitions`` shorthand) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise _fail(origin, where, f"'{field}' must be a name or a list of names, got {value!r}")


def parse_spec(data: Mapping[str, Any], origin: str = "<spec>") -> MachineSpec:
    """Validate one spec mapping and return its declaration.

    Raises SpecError naming ``origin`` and the offending item on: unknown or
    missing fields, duplicate states, not exactly one initial state, a move
    naming an unknown state, a move out of a final state, two moves for the
    same (trigger, source), an unreachable state, or a state that cannot
    reach a final (or, for cyclic machines, a ``rest``) state.
    """
    if not isinstance(data, Mapping):
        raise _fail(origin, "top level", "a spec must be a mapping")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise _fail(origin, "top level", f"unknown fields {sorted(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise _fail(origin, "top level", f"'name' must be an identifier, got {name!r}")
    enum_name = data.get("enum")
    if not isinstance(enum_name, str) or not enum_name.isidentifier():
        raise _fail(origin, "top level", f"'enum' must be an identifier, got {enum_name!r}")

    raw_states = data.get("states")
    if not isinstance(raw_states, list) or not raw_states:
        raise _fail(origin, "states", "must be a non-empty list")
    states: list[StateSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_states):
        where = f"state #{i}"
        if not isinstance(raw, Mapping):
            raise _fail(origin, where, "must be a mapping with at least 'name' and 'meaning'")
        unknown = set(raw) - _STATE_KEYS
        if unknown:
            raise _fail(origin, where, f"unknown fields {sorted(unknown)}")
        sname = raw.get("name")
        if not isinstance(sname, str) or not sname.isidentifier():
            raise _fail(origin, where, f"'name' must be an identifier, got {sname!r}")
        where = f"state {sname}"
        if sname in seen:
            raise _fail(origin, where, "declared twice")
        seen.add(sname)
        meaning = raw.get("meaning")
        if not isinstance(meaning, str) or not meaning.strip():
            raise _fail(origin, where, "needs a one-line 'meaning'")
        tags = _names(raw.get("tags"), origin, where, "tags")
        unknown_tags = sorted(set(tags) - KNOWN_TAGS)
        if unknown_tags:
            raise _fail(origin, where, f"unknown tags {unknown_tags} (known: {', '.join(sorted(KNOWN_TAGS))})")
        states.append(
            StateSpec(
                name=sname,
                meaning=meaning.strip(),
                initial=bool(raw.get("initial", False)),
                final=bool(raw.get("final", False)),
                tags=tags,
            )
        )
    initials = [s.name for s in states if s.initial]
    if len(initials) != 1:
        raise _fail(origin, "states", f"exactly one initial state required, found {initials or 'none'}")

    raw_moves = data.get("transitions")
    if not isinstance(raw_moves, list) or not raw_moves:
        raise _fail(origin, "transitions", "must be a non-empty list")
    final = {s.name for s in states if s.final}
    moves: list[MoveSpec] = []
    seen_pairs: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(raw_moves):
        where = f"transition #{i}"
        if not isinstance(raw, Mapping):
            raise _fail(origin, where, "must be a mapping")
        unknown = set(raw) - _MOVE_KEYS
        if unknown:
            raise _fail(origin, where, f"unknown fields {sorted(unknown)}")
        trigger = raw.get("trigger")
        if not isinstance(trigger, str) or not trigger.isidentifier():
            raise _fail(origin, where, f"'trigger' must be an identifier, got {trigger!r}")
        where = f"transition #{i} ({trigger})"
        source = _names(raw.get("source"), origin, where, "source")
        if not source:
            raise _fail(origin, where, "needs a 'source'")
        dest = raw.get("dest")
        for s in (*source, dest):
            if s not in seen:
                raise _fail(origin, where, f"unknown state {s!r}")
        for s in source:
            if s in final:
                raise _fail(origin, where, f"moves out of final state {s}")
            prev = seen_pairs.get((trigger, s))
            if prev is not None:
                raise _fail(origin, where, f"second move for trigger {trigger!r} from {s} (first: transition #{prev})")
            seen_pairs[(trigger, s)] = i
        meaning = raw.get("meaning")
        if not isinstance(meaning, str) or not meaning.strip():
            raise _fail(origin, where, "needs a one-line 'meaning'")
        effects = _names(raw.get("after"), origin, where, "after")
        deferrable = _names(raw.get("deferrable"), origin, where, "deferrable")
        if not set(deferrable) <= set(effects):
            raise _fail(origin, where, f"deferrable {sorted(set(deferrable) - set(effects))} are not among its effects")
        moves.append(
            MoveSpec(
                trigger=trigger,
                source=source,
                dest=str(dest),  # checked above: a declared state
                guards=_names(raw.get("conditions"), origin, where, "conditions"),
                effects=effects,
                meaning=meaning.strip(),
                deferrable=deferrable,
            )
        )

    invariants: list[InvariantSpec] = []
    for i, raw in enumerate(data.get("invariants") or []):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str) or not raw.get("meaning"):
            raise _fail(origin, f"invariant #{i}", "needs 'name' and 'meaning'")
        invariants.append(InvariantSpec(name=raw["name"], meaning=str(raw["meaning"]).strip()))

    triggers = {m.trigger for m in moves}
    couplings: list[CouplingSpec] = []
    for i, raw in enumerate(data.get("couplings") or []):
        where = f"coupling #{i}"
        if not isinstance(raw, Mapping) or set(raw) != _COUPLING_KEYS:
            raise _fail(origin, where, f"needs exactly {sorted(_COUPLING_KEYS)}")
        if not isinstance(raw["name"], str) or not raw["name"].isidentifier():
            raise _fail(origin, where, f"'name' must be an identifier, got {raw['name']!r}")
        for field_name in ("fires", "others"):
            if raw[field_name] not in triggers:
                raise _fail(origin, f"coupling {raw['name']}", f"{field_name} {raw[field_name]!r} is not a trigger")
        couplings.append(
            CouplingSpec(
                name=raw["name"], fires=raw["fires"], others=raw["others"], meaning=str(raw["meaning"]).strip()
            )
        )
    for m in moves:
        for handler in (*m.guards, *m.effects):
            if handler in triggers or handler == "state":
                raise _fail(origin, f"transition ({m.trigger})", f"handler name {handler!r} clashes with a trigger")
    spec = MachineSpec(
        name=name,
        enum_name=enum_name,
        description=str(data.get("description", "")).strip(),
        states=tuple(states),
        moves=tuple(moves),
        invariants=tuple(invariants),
        origin=origin,
        couplings=tuple(couplings),
    )
    _check_graph(spec)
    _check_waits(spec)
    return spec


def _check_waits(spec: MachineSpec) -> None:
    """A ``waits`` state's stays are timed from the move that enters it to
    the move that leaves it: a final state is never left, and a state only
    creation enters (no move from another state) has no start to time."""
    entered = {m.dest for m in spec.moves if any(s != m.dest for s in m.source)}
    for state in spec.states:
        if "waits" not in state.tags:
            continue
        if state.final:
            raise _fail(spec.origin, f"state {state.name}", "a final state cannot be tagged waits (it is never left)")
        if state.name not in entered:
            raise _fail(spec.origin, f"state {state.name}", "tagged waits but no move enters it from another state")


def _check_graph(spec: MachineSpec) -> None:
    succ: dict[str, set[str]] = {s: set() for s in spec.state_names}
    pred: dict[str, set[str]] = {s: set() for s in spec.state_names}
    for m in spec.moves:
        for s in m.source:
            succ[s].add(m.dest)
            pred[m.dest].add(s)
    reach = _closure([spec.initial], succ)
    for s in spec.state_names:
        if s not in reach:
            raise _fail(spec.origin, f"state {s}", f"unreachable from initial state {spec.initial}")
    settle = spec.settling_states()
    if not settle:
        raise _fail(spec.origin, "states", "no final state and no state tagged 'rest' to settle in")
    can_settle = _closure(settle, pred)
    for s in spec.state_names:
        if s not in can_settle:
            raise _fail(spec.origin, f"state {s}", f"cannot reach a final/rest state {list(settle)}")


def _closure(start: Iterable[str], edges: Mapping[str, set[str]]) -> set[str]:
    seen = set(start)
    todo = deque(seen)
    while todo:
        for nxt in edges[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def spec_dir() -> Path:
    """Directory holding the spec files this package was built with.

    In a source checkout (``<root>/src/omni_prefix_cache`` beside ``<root>/spec``) that is the
    checkout's own ``spec/``: an editable install maps ``omni_prefix_cache._spec`` to the
    checkout it was installed from, which is the wrong one for a second worktree run with
    ``PYTHONPATH=<worktree>/src``. Installed from a wheel, it is the shipped ``_spec`` package.
    """
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent.parent / "spec"
    if package.parent.name == "src" and (checkout / "protocol.yaml").is_file():
        return checkout
    return Path(str(resources.files(SPEC_PACKAGE)))


def spec_names() -> tuple[str, ...]:
    """Names of every shipped spec, sorted."""
    # protocol.yaml is the composition of these machines (specs.composition).
    return tuple(sorted(p.stem for p in spec_dir().glob("*.yaml") if p.stem != "protocol"))


def read_spec_file(path: Path) -> MachineSpec:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{path.name}: not valid YAML: {exc}") from exc
    spec = parse_spec(data, origin=path.name)
    if spec.name != path.stem:
        raise SpecError(f"{path.name}: top level: name {spec.name!r} does not match the file name")
    return spec


@functools.cache
def load_spec(name: str) -> MachineSpec:
    """The shipped spec ``spec/<name>.yaml``, validated (cached per process)."""
    path = spec_dir() / f"{name}.yaml"
    if not path.is_file():
        raise SpecError(f"{name}.yaml: no such spec (shipped: {', '.join(spec_names())})")
    return read_spec_file(path)


def load_all_specs() -> dict[str, MachineSpec]:
    return {name: load_spec(name) for name in spec_names()}
