"""``build_machine``: the protocol tests' Hypothesis machine from the spec.

One rule per driver of the spec's operations (``workload.DRIVERS``) and of
the engine's workload (``workload.WORKLOAD_RULES``), made from the
``ProtocolMachine`` drivers, and one ``@invariant()`` per invariant the
spec declares for the tests, bound to its ``ProtocolChecks`` checker
(``workload.CHECKERS``). A missing driver or checker is a SpecError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import consumes, invariant, multiple, precondition, rule

from omni_prefix_cache.specs.composition import ProtocolSpec, load_protocol
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.testing.protocol_tests.checks import ProtocolChecks
from omni_prefix_cache.testing.protocol_tests.machine import ProtocolMachine
from omni_prefix_cache.testing.protocol_tests.workload import (
    BLOCK_SIZE,
    CHECKERS,
    DEPTH,
    DRIVERS,
    MAX_REQUESTS,
    NUM_BLOCKS,
    WORKLOAD_RULES,
)
from omni_prefix_cache.testing.serving_model import RecentFirstAllocator

# The generated classes' home: the package callers import them from.
_HOME = "omni_prefix_cache.testing.protocol_tests"


def _rule_defs(eager: bool) -> dict[str, Callable[[type[ProtocolMachine]], Any]]:
    """Rule name -> a factory making the Hypothesis rule on the class."""
    steps = ProtocolMachine.steps

    def plain(name: str, pre: Callable[[Any], bool] | None = None, **strategies: Any) -> Any:
        def make(cls: type[ProtocolMachine]) -> Any:
            driver: Callable[..., Any] = getattr(cls, f"drive_{name}")

            def run(self: Any, **kw: Any) -> Any:
                return driver(self, **kw)

            run.__name__ = run.__qualname__ = name
            run.__doc__ = driver.__doc__
            as_rule: Callable[[Any], Any] = rule(**strategies)
            out = as_rule(run)
            return precondition(pre)(out) if pre is not None else out

        return make

    def new_step_rule(cls: type[ProtocolMachine]) -> Any:
        def new_step(self: Any, data: Any) -> Any:
            sid = self.drive_new_step(data)
            return multiple() if sid is None else sid

        new_step.__doc__ = ProtocolMachine.drive_new_step.__doc__
        ready = precondition(lambda self: self.pending is None and len(self.expects) < DEPTH)
        return ready(rule(target=steps, data=st.data())(new_step))

    def interim_tenant_rule(cls: type[ProtocolMachine]) -> Any:
        def interim_tenant(self: Any, data: Any) -> Any:
            return multiple(*self.drive_interim_tenant(data))

        interim_tenant.__doc__ = ProtocolMachine.drive_interim_tenant.__doc__
        ready = precondition(
            lambda self: (
                self.pending is None
                and len(self.expects) <= DEPTH - 2
                and isinstance(self.model.alloc, RecentFirstAllocator)
                and bool(self.model.running())
                and len(self.model.requests) < MAX_REQUESTS
            )
        )
        return ready(rule(target=steps, data=st.data())(interim_tenant))

    def resume_rule(cls: type[ProtocolMachine]) -> Any:
        def resume(self: Any, data: Any) -> Any:
            sid = self.drive_resume(data)
            return multiple() if sid is None else sid

        resume.__doc__ = ProtocolMachine.drive_resume.__doc__
        ready = precondition(
            lambda self: self.pending is None and len(self.expects) < DEPTH and bool(self.model.running())
        )
        return ready(rule(target=steps, data=st.data())(resume))

    def save_rule(cls: type[ProtocolMachine]) -> Any:
        def save(self: Any) -> Any:
            sid = self.drive_save()
            return multiple() if sid is None else sid

        save.__doc__ = ProtocolMachine.drive_save.__doc__
        return precondition(lambda self: self.pending is not None)(rule(target=steps)(save))

    def consume(name: str) -> Any:
        def make(cls: type[ProtocolMachine]) -> Any:
            driver = getattr(cls, f"drive_{name}")

            def run(self: Any, sid: Any, **kw: Any) -> None:
                driver(self, sid, **kw)

            run.__name__ = run.__qualname__ = name
            extra: dict[str, Any] = {"data": st.data()} if name == "materialize" else {}
            as_rule: Callable[[Any], Any] = rule(sid=consumes(steps), **extra)
            return as_rule(run)

        return make

    def idle(self: Any) -> bool:
        return self.pending is None and not self.dead

    return {
        "new_step": new_step_rule,
        "save": save_rule,
        "interim_tenant": interim_tenant_rule,
        "resume": resume_rule,
        "finish_or_abort": plain(
            "finish_or_abort",
            lambda self: len(self.model.requests) >= 2 and self.pending is None,
            action=st.sampled_from(["finish", "abort"]),
            data=st.data(),
        ),
        "drain": plain("drain", lambda self: self.pending is None, data=st.data()),
        # The committer's operations, each enabled when it has work.
        "committer_claim": plain(
            "committer_claim", lambda self: not self.EAGER and bool(self.ctrl.queues.high or self.ctrl.queues.low)
        ),
        "committer_copy": plain("committer_copy", lambda self: not self.EAGER and bool(self.ctrl.queues.claimed)),
        "committer_write": plain("committer_write", lambda self: not self.EAGER and bool(self.ctrl.queues.blocked)),
        # One armed failure per run, after a few saves: a run keeps serving
        # (and reusing blocks) for a while before it dies.
        "inject_failure": plain(
            "inject_failure",
            lambda self: not self.dead and self.saves >= 2 and not (self.poison["copy"] or self.poison["write"]),
            where=st.sampled_from(["copy", "write"]),
            data=st.data(),
        ),
        "join": plain("join", lambda self: bool(self.ctrl.parts.registry.tasks), data=st.data()),
        "submit_queued": plain(
            "submit_queued",
            lambda self: not self.dead and not self.side_submitted,  # once per run
            slot=st.integers(0, NUM_BLOCKS * BLOCK_SIZE - 1),
        ),
        "materialize": consume("materialize"),
        # The request lifecycle (life_drivers).
        "client": plain("client", lambda self: bool(self.desk.inbox) and not self.dead, data=st.data()),
        "replace": plain(
            "replace", lambda self: idle(self) and any(r.live for r in self.model.requests.values()), data=st.data()
        ),
        "reuse_id": plain(
            "reuse_id",
            lambda self: idle(self) and len(self.model.requests) < MAX_REQUESTS and bool(self.reusable()),
            data=st.data(),
        ),
        "stale_events": plain(
            "stale_events", lambda self: idle(self) and bool(self.engine.stale_ids()), data=st.data()
        ),
        "replay_step": plain("replay_step", lambda self: idle(self) and self.engine.last is not None),
        "optimistic_resume": plain(
            "optimistic_resume",
            lambda self: (
                idle(self)
                and len(self.expects) < DEPTH
                and self.model.alloc.can_allocate(1)
                and bool(self.optimistic_candidates())
            ),
            data=st.data(),
        ),
        "discard": consume("discard"),
        "preempt": plain("preempt", lambda self: self.pending is None and bool(self.model.running()), data=st.data()),
        "prefetch_run": plain("prefetch_run", lambda self: bool(self.prefetch.pending) and self.paused is None),
        "prefetch_pause": plain("prefetch_pause", lambda self: self.paused is None and bool(self.prefetch.pending)),
        "prefetch_resume": plain("prefetch_resume", lambda self: self.paused is not None),
        "paused_reader_slots_reused": plain(
            "paused_reader_slots_reused",
            lambda self: (
                self.paused is not None
                and self.paused_reader in self.model.requests
                and self.pending is None
                and len(self.expects) < DEPTH
            ),
            prefix=st.integers(0, 2),
            data=st.data(),
        ),
    }


def _checker(name: str) -> Any:
    """The invariant running checker ``name`` of the machine's ``checks``."""
    method: Callable[[ProtocolChecks], None] = getattr(ProtocolChecks, name)

    def check(self: Any) -> None:
        method(self.checks)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = method.__doc__
    return invariant()(check)


def rule_table(spec: ProtocolSpec) -> dict[str, str]:
    """Operation -> driver rule, for every operation of ``spec``. Raises
    SpecError for an operation with no driver (the spec grew, the tests did not)."""
    missing = [op.name for op in spec.operations if op.name not in DRIVERS]
    if missing:
        raise SpecError(f"{spec.origin}: operations {missing} have no driver in protocol_tests.DRIVERS")
    return {op.name: DRIVERS[op.name] for op in spec.operations}


def invariant_table(spec: ProtocolSpec) -> dict[str, str]:
    """Invariant (checked_by tests) -> checker method. Raises SpecError for a
    declared invariant with no checker."""
    names = spec.invariants_for("tests")
    missing = [n for n in names if n not in CHECKERS]
    if missing:
        raise SpecError(f"{spec.origin}: invariants {missing} have no checker in protocol_tests.CHECKERS")
    return {n: CHECKERS[n] for n in names}


def build_machine(spec: ProtocolSpec | None = None, *, eager: bool) -> type[ProtocolMachine]:
    """A RuleBasedStateMachine class for ``spec`` (default: the shipped one)."""
    spec = spec or load_protocol()
    ops = rule_table(spec)
    checks = invariant_table(spec)
    defs = _rule_defs(eager)
    names = list(dict.fromkeys(r for r in ops.values() if r != "teardown")) + list(WORKLOAD_RULES)
    attrs: dict[str, Any] = {"EAGER": eager, "SPEC": spec, "__module__": _HOME}
    for name in names:
        attrs[name] = defs[name](ProtocolMachine)
    for inv, method in checks.items():
        attrs[f"inv_{inv}"] = _checker(method)
    title = "Eager" if eager else "Manual"
    return type(f"{title}ProtocolMachine", (ProtocolMachine,), attrs)


def invariant_names() -> tuple[str, ...]:
    """The names a generated machine's failures may be attributed to."""
    return tuple(CHECKERS)
