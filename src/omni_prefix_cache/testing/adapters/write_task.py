"""``WriteTaskAdapter``: plays ``write_task`` on ``omni_prefix_cache.writes.write_task.WriteTask``.

Maps each trigger to the runtime call(s) that fire it, reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime (see ``testing.stateful``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheUnmatchError,
    WriteSchedule,
)
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.specs.types.write_task import WriteTaskTrigger
from omni_prefix_cache.testing.specfacts import states_after
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    EnvRule,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    Refused,
    SpecAdapter,
)

# Runtime calls that fire each write_task trigger.
_TASK_APIS: dict[str, tuple[str, ...]] = {
    "enqueue": ("transition", "try_transition", "fire"),
    "claim_copy": ("try_fire", "transition"),
    "host_ready": ("mark_host_ready", "set_host_tensor", "transition"),
    "written": ("fire", "transition"),
    "fail": ("try_fire", "transition"),
}
# Calls that report a refusal by returning False instead of raising.
_TASK_SOFT_APIS = frozenset({"try_transition", "try_fire"})
# Effect name -> the task event it sets.
_EVENT_OF = {"set_host_ready": "host_ready", "set_done": "done"}


def _has_effect(effect: str, move: Any) -> bool:
    return effect in move.effects


class _TaskSystem:
    """The WriteTasks under test, plus what the harness saw them do."""

    def __init__(self) -> None:
        self.tasks: dict[int, Any] = {}
        self.claims: dict[int, int] = {}  # successful copy claims per tid
        self.appended_in: dict[int, list[str]] = {}  # state at each accepted append


class WriteTaskAdapter(SpecAdapter):
    """``write_task`` against WriteTask.

    Observed effects: ``set_host_ready`` / ``set_done`` as the task's
    ``host_ready`` / ``done`` events, ``drop_device_clone`` as "no chunk
    still holds clone tensors". Environment rules append chunks (accepted
    only in ``accepts_chunks`` states) and race 2-3 threads on claim_copy.
    """

    handle_name = "task"
    max_handles = 6

    def __init__(self, spec: MachineSpec | None = None):
        from omni_prefix_cache.writes.write_task import TaskState

        self.spec = spec or load_spec("write_task")
        unknown = sorted(set(self.spec.triggers) - set(_TASK_APIS))
        if unknown:
            raise SpecError(f"{self.spec.origin}: WriteTask has no call for triggers {unknown}")
        self.TaskState = TaskState
        self.dest_of = {m.trigger: m.dest for m in self.spec.moves}
        self.accepts = frozenset(self.spec.tagged("accepts_chunks"))
        self.event_states = {
            event: states_after(self.spec, functools.partial(_has_effect, effect))
            for effect, event in _EVENT_OF.items()
        }
        self.claimed_states = states_after(self.spec, lambda m: m.trigger == "claim_copy")

    # ----------------------------------------------------------- system
    def new_system(self) -> _TaskSystem:
        return _TaskSystem()

    @staticmethod
    def _chunk(handle: int, n: int) -> Any:
        from omni_prefix_cache.writes.chunks import WriteChunk

        slots = torch.arange(2 * handle, 2 * handle + 2, dtype=torch.int64) + 100 * n
        return WriteChunk(slots_cpu=slots, tensors={HIDDEN_KEY: torch.full((2, 4), float(handle))})

    def create(self, system: _TaskSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.writes.write_task import WriteTask

        system.tasks[handle] = WriteTask(
            tid=handle, req_id=f"r{handle}", write_n=1, schedule=args["schedule"], chunks=[self._chunk(handle, 0)]
        )
        system.claims[handle] = 0
        system.appended_in[handle] = []

    def fire(self, system: _TaskSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        task = system.tasks[handle]
        api = "try_fire" if defer else args["api"]
        dest = self.TaskState[self.dest_of[trigger]]
        if api == "transition":
            task.transition(dest)
            ok = True
        elif api == "try_transition":
            ok = task.try_transition(dest)
        elif api == "try_fire":
            ok = task.try_fire(WriteTaskTrigger(trigger), defer=defer)
        elif api == "fire":
            task.fire(WriteTaskTrigger(trigger))
            ok = True
        elif api == "mark_host_ready":
            task.mark_host_ready()
            ok = True
        elif api == "set_host_tensor":
            task.set_host_tensor([(c, k, t.clone()) for c in task.chunks for k, t in c.tensors.items()])
            ok = True
        else:  # pragma: no cover - _TASK_APIS lists every api
            raise AssertionError(api)
        if not ok:
            raise Refused(f"{api} returned False")
        if trigger == "claim_copy":
            system.claims[handle] += 1

    def wake(self, system: _TaskSystem, handle: int) -> None:
        system.tasks[handle].wake_failed_waiters()

    def read_state(self, system: _TaskSystem, handle: int) -> str:
        return str(system.tasks[handle].state.name)

    def observe(self, system: _TaskSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            task = system.tasks[h]
            out[(h, "host_ready")] = task.host_ready.is_set()
            out[(h, "done")] = task.done.is_set()
            out[(h, "device_clone")] = any(c.tensors for c in task.chunks)
            out[(h, "chunks")] = len(task.chunks)
        return out

    # ------------------------------------------------------------ model
    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update(
            {
                (handle, "host_ready"): False,
                (handle, "done"): False,
                (handle, "device_clone"): True,
                (handle, "chunks"): 1,
            }
        )

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def setter(key: str, value: bool) -> Callable[[MoveCtx], None]:
            def run(ctx: MoveCtx) -> None:
                ctx.model.obs[(ctx.handle, key)] = value

            return run

        return {
            "drop_device_clone": setter("device_clone", False),
            "set_host_ready": setter("host_ready", True),
            "set_done": setter("done", True),
        }

    def create_args(self, data: Any, model: ModelWorld) -> dict[str, Any]:
        return {"schedule": data.draw(st.sampled_from(list(WriteSchedule)), label="schedule")}

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        return {"api": data.draw(st.sampled_from(_TASK_APIS[trigger]), label="api")}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if args["api"] in _TASK_SOFT_APIS:
            return Refusal(Refused)
        return Refusal(OmniPrefixCacheUnmatchError, r"task \d+: illegal transition \w+ -> \w+")

    # ------------------------------------------------------- environment
    def env_rules(self) -> Sequence[EnvRule]:
        def any_task(model: ModelWorld) -> bool:
            return bool(model.states)

        def append(machine: GeneratedMachine, data: Any) -> None:
            handle = data.draw(st.sampled_from(sorted(machine.model.states)), label="task")
            task = machine.system.tasks[handle]
            state = machine.model.states[handle]
            closed = task.append_chunk(self._chunk(handle, len(task.chunks)))
            if (closed is None) != (state in self.accepts):
                raise Discrepancy(f"append to task {handle} in {state}: runtime returned {closed!r}")
            if closed is None:
                machine.system.appended_in[handle].append(task.state.name)
                machine.model.obs[(handle, "chunks")] += 1
            elif closed.name != state:
                raise Discrepancy(f"append to task {handle} in {state}: closing state reported as {closed.name}")

        def race_claim(machine: GeneratedMachine, data: Any) -> None:
            handle = data.draw(st.sampled_from(sorted(machine.model.states)), label="task")
            racers = data.draw(st.integers(2, 3), label="racers")
            task = machine.system.tasks[handle]
            barrier = threading.Barrier(racers)
            won: list[bool] = []

            def claim() -> None:
                barrier.wait()
                won.append(task.try_fire(WriteTaskTrigger.CLAIM_COPY))

            threads = [threading.Thread(target=claim) for _ in range(racers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            outcome, move = machine.model_outcome(handle, "claim_copy", {})
            expected = 1 if outcome == "moved" else 0
            if sum(won) != expected:
                raise Discrepancy(f"{racers} racing claim_copy on task {handle}: {sum(won)} winners, spec {expected}")
            machine.system.claims[handle] += sum(won)
            if move is not None and outcome == "moved":
                machine.apply_model_move(handle, move, {})

        return (EnvRule("append_chunk", append, any_task), EnvRule("race_claim_copy", race_claim, any_task))

    # ------------------------------------------------------------ invariants
    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def events_match_state(m: GeneratedMachine) -> None:
            for h, task in m.system.tasks.items():
                state = task.state.name
                owed = self._owed_events(m.model, h)
                for event, (always, sometimes) in self.event_states.items():
                    is_set = getattr(task, event).is_set()
                    if event in owed:
                        continue
                    if state in always and not is_set:
                        raise Discrepancy(f"task {h} in {state}: {event} is not set")
                    if state not in sometimes and is_set:
                        raise Discrepancy(f"task {h} in {state}: {event} is set")

        def append_only_before_copy(m: GeneratedMachine) -> None:
            for h, task in m.system.tasks.items():
                seen = m.system.appended_in[h]
                if len(task.chunks) != 1 + len(seen):
                    raise Discrepancy(f"task {h}: {len(task.chunks)} chunks, {len(seen)} appends accepted")
                late = [s for s in seen if s not in self.accepts]
                if late:
                    raise Discrepancy(f"task {h}: chunks appended in {late}")

        def single_copy_claim(m: GeneratedMachine) -> None:
            always, _ = self.claimed_states
            for h, task in m.system.tasks.items():
                n = m.system.claims[h]
                if n > 1 or (task.state.name in always and n != 1):
                    raise Discrepancy(f"task {h} in {task.state.name}: {n} successful copy claims")

        return {
            "events_match_state": events_match_state,
            "append_only_before_copy": append_only_before_copy,
            "single_copy_claim": single_copy_claim,
        }

    @staticmethod
    def _owed_events(model: ModelWorld, handle: int) -> set[str]:
        """Events whose effect a deferred move still owes on ``handle``."""
        move = model.owed.get(handle)
        return set() if move is None else {_EVENT_OF[e] for e in move.spec.deferrable if e in _EVENT_OF}
