"""Hypothesis state machines generated from a spec.

``build_machine(adapter)`` turns any spec into a ``RuleBasedStateMachine``:

- one ``create`` rule filling a Bundle of handles (task ids, holders, slots);
- one ``fire_<trigger>`` rule per trigger of the spec. It fires the trigger
  on the runtime object and on a model that interprets the spec's compiled
  table (source states, guards, effects). A declared move must succeed on
  the runtime; an undeclared one (or one a guard refuses) must be refused
  the way the adapter says (normally the spec'd error);
- a ``drive`` rule that walks one handle along the spec's shortest path to
  the source of the move the run has taken least and fires it (so deep
  moves are covered in every run, each step checked like a fire rule);
- a ``wake`` rule when a move has deferrable effects (the caller runs them
  after publishing its record);
- the adapter's environment rules (e.g. racing claimants, guard flags);
- one ``@invariant`` per named spec invariant.

After every rule the runtime and the model must agree on every handle's
state and on every declared effect's observable trace (``observe``). The
adapter is the only per-runtime code; the rules come from the spec, so a
changed spec changes the generated tests with no test edit.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs.compiled import CompiledMachine, CompiledMove, compile_machine
from omni_prefix_cache.specs.loader import MachineSpec, SpecError

Outcome = Literal["moved", "blocked", "illegal"]


class Refused(Exception):
    """Raised by an adapter when the runtime refused a trigger without an
    exception of its own (a ``try_*`` call returning False)."""


class Discrepancy(AssertionError):
    """The runtime and the spec model disagree; the message says where."""


@dataclass(frozen=True)
class Refusal:
    """How the runtime must refuse a trigger: an exception of ``error``
    (a type or tuple of types) whose message matches ``match`` if given."""

    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str | None = None


@dataclass
class ModelWorld:
    """The spec side of a generated machine.

    ``states``: handle -> state name. ``obs``: what ``observe`` must return
    (the model's expected effect traces). ``info``: per-handle adapter facts
    (kind, page, ...). ``env``: world facts (guard flags, counters).
    ``owed``: handle -> the deferred move whose deferrable effects have
    not run yet.
    ``moved``: how often each (trigger, source) move ran (coverage).
    """

    spec: MachineSpec
    states: dict[int, str] = field(default_factory=dict)
    obs: dict[Hashable, Any] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    owed: dict[int, CompiledMove] = field(default_factory=dict)
    moved: Counter[tuple[str, str]] = field(default_factory=Counter)
    refused: Counter[tuple[str, str, str]] = field(default_factory=Counter)


@dataclass
class MoveCtx:
    """What a model guard or effect sees: the world, the handle, the
    trigger's drawn arguments."""

    model: ModelWorld
    handle: int
    trigger: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class EnvRule:
    """An extra rule contributed by an adapter (racing claimants, guard
    flags, appends). ``run(machine, data)`` fires it and checks its own
    outcome; ``enabled(model)`` is its precondition."""

    name: str
    run: Callable[[GeneratedMachine, Any], None]
    enabled: Callable[[ModelWorld], bool] | None = None


class SpecAdapter:
    """How one runtime object plays one spec. Subclass per runtime.

    System side: ``new_system``, ``create``, ``fire``, ``read_state``,
    ``observe``, ``wake``. Model side: ``model_guards`` / ``model_effects``
    (bound into the spec's compiled table by name, so both sides must list
    the same names), ``model_create``, ``model_after_move``. ``invariants``
    implements the spec's named invariants; ``unchecked_invariants`` names
    the ones this runtime cannot check, with the reason.
    """

    spec: MachineSpec
    handle_name: str = "handle"
    max_handles: int = 4
    illegal_error: type[BaseException] = OmniPrefixCacheUnmatchError
    # Do not fire triggers on handles in a final state (for runtimes that
    # never reuse an id and so cannot tell a released handle from a new one).
    retire_final: bool = False

    # ----------------------------------------------------------- system side
    def new_system(self) -> Any:
        raise NotImplementedError

    def create(self, system: Any, handle: int, args: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def fire(self, system: Any, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        """Fire ``trigger``; raise the runtime's refusal (or Refused)."""
        raise NotImplementedError

    def read_state(self, system: Any, handle: int) -> str:
        raise NotImplementedError

    def observe(self, system: Any, handles: Sequence[int]) -> dict[Hashable, Any]:
        """The runtime's observable effect traces, keyed like ``ModelWorld.obs``."""
        return {}

    def wake(self, system: Any, handle: int) -> None:
        """Run the deferrable effects a deferred move still owes."""
        raise NotImplementedError(f"{type(self).__name__} cannot run deferred effects")

    def close(self, system: Any) -> None:
        """Release what ``new_system`` started (threads, pools)."""

    def can_express(self, trigger: str, state: str) -> bool:
        """False where the runtime's API has no way to even attempt
        ``trigger`` from ``state`` (e.g. ``save`` of an already issued step
        id: the runtime issues fresh ids). Such illegal moves are skipped."""
        return True

    # ------------------------------------------------------------ model side
    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        return {}

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        """Record a new handle's expected observations and facts."""

    def model_after_move(self, ctx: MoveCtx, move: CompiledMove) -> None:
        """Bookkeeping a move implies beyond its declared effects (a page)."""

    def new_model(self, model: ModelWorld) -> None:
        """Initialise ``model.env`` for a fresh world."""

    # ------------------------------------------------------------- drawing
    def create_args(self, data: Any, model: ModelWorld) -> dict[str, Any]:
        return {}

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        return {}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        """How the runtime refuses ``trigger`` (None: a silent no-op)."""
        return Refusal(self.illegal_error)

    def env_rules(self) -> Sequence[EnvRule]:
        return ()

    # ------------------------------------------------------------ invariants
    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        return {}

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {}


class _NoArgs(Mapping[str, Any]):
    """Arguments not drawn yet: every lookup is a KeyError."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


_NO_ARGS = _NoArgs()


def _fail(message: str) -> Discrepancy:
    return Discrepancy(message)


class GeneratedMachine(RuleBasedStateMachine):
    """Base of every generated machine: the runtime, the model, and the
    checks shared by all rules."""

    adapter: SpecAdapter
    compiled: CompiledMachine
    depth: dict[str, int]
    paths: dict[tuple[str, str], tuple[str, ...]]
    all_moves: tuple[tuple[str, str], ...]
    on_move: Callable[[str, str, str], None] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.system = self.adapter.new_system()
        self.model = ModelWorld(spec=self.adapter.spec)
        self.adapter.new_model(self.model)

    def teardown(self) -> None:
        self.adapter.close(self.system)

    # ------------------------------------------------------------ model
    def model_outcome(self, handle: int, trigger: str, args: Mapping[str, Any]) -> tuple[Outcome, CompiledMove | None]:
        """What the spec says ``trigger`` does to ``handle`` now."""
        state = self.compiled.State[self.model.states[handle]]
        move = self.compiled.move(state, trigger)
        if move is None:
            return "illegal", None
        ctx = MoveCtx(self.model, handle, trigger, args)
        if not all(guard(ctx) for guard in move.guards):
            return "blocked", move
        return "moved", move

    def likely_movers(self, trigger: str) -> list[int]:
        """Handles in a source state of ``trigger`` whose guards pass, as far
        as guards can be judged before the trigger's arguments are drawn."""
        out = []
        for h in sorted(self.model.states):
            move = self.compiled.move(self.compiled.State[self.model.states[h]], trigger)
            if move is None:
                continue
            ctx = MoveCtx(self.model, h, trigger, _NO_ARGS)
            try:
                ok = all(guard(ctx) for guard in move.guards)
            except KeyError:  # the guard needs an argument: cannot tell yet
                ok = True
            if ok:
                out.append(h)
        return out

    def fire_checked(self, handle: int, trigger: str, data: Any) -> bool:
        """Fire ``trigger`` on ``handle`` on both sides and check they agree:
        a declared move must succeed, anything else must be refused as the
        adapter says. True if the spec moved the handle."""
        state = self.model.states[handle]
        if self.adapter.retire_final and state in self.compiled.spec.final_states:
            return False
        args = self.adapter.trigger_args(data, self.model, handle, trigger)
        outcome, move = self.model_outcome(handle, trigger, args)
        where = f"{trigger} on {self.adapter.handle_name} {handle} in {state}" + (f" {dict(args)}" if args else "")
        if outcome == "moved":
            assert move is not None
            defer = bool(move.deferrable and data.draw(st.booleans(), label="defer effects"))
            try:
                self.adapter.fire(self.system, handle, trigger, args, defer)
            except Exception as exc:
                raise _fail(
                    f"{where}: the spec declares {state} -> {move.dest.name}; the runtime refused: {exc!r}"
                ) from exc
            self.apply_model_move(handle, move, args, defer)
            where += f" -> {move.dest.name}" + (" (effects deferred)" if defer else "")
        elif not self.adapter.can_express(trigger, state):
            self.model.refused[(trigger, state, "inexpressible")] += 1
            return False
        else:
            refusal = self.adapter.refusal(trigger, args, outcome)
            self.model.refused[(trigger, state, outcome)] += 1
            self.expect_refusal(
                f"{where} ({outcome} per spec)",
                refusal,
                lambda: self.adapter.fire(self.system, handle, trigger, args, False),
            )
        self.check_agree(where)
        return outcome == "moved"

    def _steer_rank(self, trigger: str, handle: int) -> tuple[int, int]:
        state = self.model.states[handle]
        return self.model.moved[(trigger, state)], -self.depth[state]

    def apply_model_move(self, handle: int, move: CompiledMove, args: Mapping[str, Any], defer: bool = False) -> None:
        """Move the model along ``move`` and run its declared effects (the
        deferrable ones later, by ``wake``, when ``defer``)."""
        ctx = MoveCtx(self.model, handle, move.trigger, args)
        self.model.states[handle] = move.dest.name
        self.model.moved[(move.trigger, move.source.name)] += 1
        if self.on_move is not None:
            self.on_move(move.trigger, move.source.name, move.dest.name)
        self.adapter.model_after_move(ctx, move)
        for effect in move.undeferrable if defer else move.effects:
            effect(ctx)
        if defer and move.deferrable:
            self.model.owed[handle] = move

    # ----------------------------------------------------------- checks
    def check_agree(self, where: str) -> None:
        """Runtime and model agree on every state and effect trace."""
        for handle, expected in self.model.states.items():
            got = self.adapter.read_state(self.system, handle)
            if got != expected:
                raise _fail(
                    f"{where}: {self.adapter.handle_name} {handle} is {got} on the runtime, {expected} per spec"
                )
        got_obs = self.adapter.observe(self.system, tuple(self.model.states))
        if got_obs != self.model.obs:
            keys = sorted(set(got_obs) | set(self.model.obs), key=repr)
            diff = [
                f"{k!r}: runtime {got_obs.get(k, '<missing>')!r}, spec {self.model.obs.get(k, '<missing>')!r}"
                for k in keys
                if got_obs.get(k, "<missing>") != self.model.obs.get(k, "<missing>")
            ]
            raise _fail(f"{where}: declared effects disagree: " + "; ".join(diff))

    def expect_refusal(self, where: str, refusal: Refusal | None, call: Callable[[], None]) -> None:
        """Run ``call``; it must raise as ``refusal`` says (or return if None)."""
        try:
            call()
        except Exception as exc:
            if refusal is None:
                raise _fail(f"{where}: the runtime raised {exc!r}; the spec expects a silent no-op") from exc
            if not isinstance(exc, refusal.error):
                raise _fail(f"{where}: the runtime raised {exc!r}; the spec expects {refusal.error}") from exc
            if refusal.match is not None and not re.search(refusal.match, str(exc)):
                raise _fail(f"{where}: error {str(exc)!r} does not match {refusal.match!r}") from exc
            return
        if refusal is not None:
            raise _fail(f"{where}: the runtime accepted it; the spec expects a refusal ({refusal.error})")


def _create_rule(handles: Bundle) -> Callable[..., int]:
    def create(self: GeneratedMachine, data: Any) -> int:
        handle = len(self.model.states)
        args = self.adapter.create_args(data, self.model)
        self.adapter.create(self.system, handle, args)
        self.model.states[handle] = self.compiled.initial.name
        self.adapter.model_create(self.model, handle, args)
        self.check_agree(f"create {self.adapter.handle_name} {handle}")
        return handle

    create.__name__ = f"create_{handles.name}"
    limited = precondition(lambda self: len(self.model.states) < self.adapter.max_handles)(create)
    return cast(Callable[..., int], rule(target=handles, data=st.data())(limited))


def _fire_rule(trigger: str, handles: Bundle) -> Callable[..., None]:
    def fire(self: GeneratedMachine, handle: int, data: Any) -> None:
        eligible = self.likely_movers(trigger)
        # Three times in four steer to a handle the spec lets move, so long
        # chains are reached; otherwise keep the Bundle's pick (often illegal).
        if eligible and data.draw(st.integers(0, 3), label="steer to a legal source") > 0:
            # Prefer the source states this trigger has moved from least in
            # this run, then the deepest of them (the hardest to reach).
            rank = {h: self._steer_rank(trigger, h) for h in eligible}
            best = [h for h in eligible if rank[h] == min(rank.values())]
            handle = data.draw(st.sampled_from(best), label=self.adapter.handle_name)
        self.fire_checked(handle, trigger, data)

    fire.__name__ = f"fire_{trigger}"
    return rule(handle=handles, data=st.data())(fire)


def _drive_rule() -> Callable[..., None]:
    def drive(self: GeneratedMachine, data: Any) -> None:
        """Walk one handle along the spec's shortest path to the source of
        the move this run has taken least, then fire it: deep moves get
        covered in every run, each step checked like a fire rule."""
        live = [h for h, s in self.model.states.items() if s not in self.compiled.spec.final_states]
        plans = []
        for trigger, source in self.all_moves:
            for h in live:
                path = self.paths.get((self.model.states[h], source))
                if path is not None:
                    plans.append((self.model.moved[(trigger, source)], len(path), trigger, source, h, path))
        if not plans:
            return
        fewest = min(p[0] for p in plans)
        choice = data.draw(st.sampled_from([p for p in plans if p[0] == fewest]), label="drive to")
        _, _, trigger, _, handle, path = choice
        for step in (*path, trigger):
            if not self.fire_checked(handle, step, data):
                return

    return rule(data=st.data())(precondition(lambda self: bool(self.model.states))(drive))


def _wake_rule(handles: Bundle) -> Callable[..., None]:
    def wake(self: GeneratedMachine, handle: int, data: Any) -> None:
        if self.model.owed and data.draw(st.booleans(), label="steer to an owed handle"):
            handle = data.draw(st.sampled_from(sorted(self.model.owed)), label=self.adapter.handle_name)
        self.adapter.wake(self.system, handle)
        owed = self.model.owed.pop(handle, None)
        effects = owed.deferrable if owed is not None else ()
        ctx = MoveCtx(self.model, handle, "wake", {})
        for effect in effects:
            effect(ctx)
        self.check_agree(f"wake {self.adapter.handle_name} {handle} ({len(effects)} deferred effects)")

    return rule(handle=handles, data=st.data())(wake)


def _env_rule(env: EnvRule) -> Callable[..., None]:
    def run(self: GeneratedMachine, data: Any) -> None:
        env.run(self, data)
        self.check_agree(env.name)

    run.__name__ = f"env_{env.name}"
    if env.enabled is not None:
        enabled = env.enabled
        run = precondition(lambda self: enabled(self.model))(run)
    return rule(data=st.data())(run)


def _invariant_rule(name: str, check: Callable[[GeneratedMachine], None]) -> Callable[..., None]:
    def inv(self: GeneratedMachine) -> None:
        check(self)

    inv.__name__ = f"invariant_{name}"
    return invariant()(inv)


def _depths(spec: MachineSpec) -> dict[str, int]:
    """Each state's distance (in moves) from the initial state."""
    depth = {spec.initial: 0}
    frontier = [spec.initial]
    while frontier:
        nxt = []
        for m in spec.moves:
            for src in m.source:
                if src in frontier and m.dest not in depth:
                    depth[m.dest] = depth[src] + 1
                    nxt.append(m.dest)
        frontier = nxt
    return {s: depth.get(s, 0) for s in spec.state_names}


def _paths(spec: MachineSpec) -> dict[tuple[str, str], tuple[str, ...]]:
    """(from, to) -> the triggers of a shortest path (ignoring guards)."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for start in spec.state_names:
        out[(start, start)] = ()
        frontier = [start]
        while frontier:
            nxt = []
            for here in frontier:
                for m in spec.moves:
                    if here in m.source and (start, m.dest) not in out:
                        out[(start, m.dest)] = (*out[(start, here)], m.trigger)
                        nxt.append(m.dest)
            frontier = nxt
    return out


def build_machine(
    adapter: SpecAdapter,
    *,
    on_move: Callable[[str, str, str], None] | None = None,
) -> type[GeneratedMachine]:
    """The generated ``RuleBasedStateMachine`` for ``adapter.spec``.

    Raises SpecError when the adapter's model handlers do not match the
    spec's guard/effect names, or when a named invariant of the spec is
    neither implemented nor listed as unchecked (or the adapter checks one
    the spec does not declare). ``on_move(trigger, source, dest)`` is called
    for every move the model takes (coverage).
    """
    spec = adapter.spec
    compiled = compile_machine(spec, guards=adapter.model_guards(), effects=adapter.model_effects())
    declared = {inv.name for inv in spec.invariants}
    checks = dict(adapter.invariants())
    unchecked = dict(adapter.unchecked_invariants())
    missing = sorted(declared - set(checks) - set(unchecked))
    if missing:
        raise SpecError(f"{spec.origin}: invariants {missing} have no check in {type(adapter).__name__}")
    extra = sorted((set(checks) | set(unchecked)) - declared)
    if extra:
        raise SpecError(f"{spec.origin}: {type(adapter).__name__} checks invariants {extra} the spec does not declare")

    handles = Bundle(adapter.handle_name + "s")
    ns: dict[str, Any] = {
        "adapter": adapter,
        "compiled": compiled,
        "depth": _depths(spec),
        "paths": _paths(spec),
        "all_moves": tuple((m.trigger, src) for m in spec.moves for src in m.source),
        "on_move": staticmethod(on_move) if on_move is not None else None,
        "handles": handles,
        "unchecked": unchecked,
        "__doc__": f"Generated from {spec.origin} for {type(adapter).__name__}.",
    }
    ns[f"create_{handles.name}"] = _create_rule(handles)
    has_deferrable = any(m.deferrable for m in spec.moves)
    for trigger in spec.triggers:
        ns[f"fire_{trigger}"] = _fire_rule(trigger, handles)
    ns["drive"] = _drive_rule()
    if has_deferrable:
        ns["wake"] = _wake_rule(handles)
    for env in adapter.env_rules():
        ns[f"env_{env.name}"] = _env_rule(env)
    for name in sorted(declared & set(checks)):
        ns[f"invariant_{name}"] = _invariant_rule(name, checks[name])
    cls_name = "".join(p.title() for p in spec.name.split("_")) + "Generated" + type(adapter).__name__
    return type(cls_name, (GeneratedMachine,), ns)
