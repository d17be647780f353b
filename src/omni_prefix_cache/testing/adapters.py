"""Adapters that play the specs against the real runtime objects.

- ``WriteTaskAdapter``: ``write_task`` on ``omni_prefix_cache.writes.write_task.WriteTask``.
- ``StagingHolderAdapter``: ``staging_holder`` on ``StagingBufferPool``.
- ``SlotOccupancyAdapter``: ``slot_occupancy`` on ``SlotOccupancy``.
- ``StepContextAdapter``: ``step_context`` on ``OmniPrefixCacheManager``.
- ``PlannedReadAdapter``: ``planned_read`` on ``PlannedReads``.

Each maps a trigger to the runtime call(s) that fire it (several APIs per
trigger where the runtime has them, drawn at random), reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime.
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
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    WriteSchedule,
)
from omni_prefix_cache.specs.compiled import CompiledMove
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
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

# ------------------------------------------------------------------ WriteTask

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


# -------------------------------------------------------------- staging pool


class _CountingCondition(threading.Condition):
    """A condition that counts ``notify_all`` calls (the pool's wakes)."""

    def __init__(self) -> None:
        super().__init__()
        self.wakes = 0

    def notify_all(self) -> None:
        self.wakes += 1
        super().notify_all()


class _PoolSystem:
    def __init__(self, depth: int, capacity: int):
        from omni_prefix_cache.writes.staging import StagingBufferPool

        self.pool = StagingBufferPool(depth, capacity)
        self.pool._page_freed = self.wakes = _CountingCondition()
        self.kinds: dict[int, str] = {}
        # Holder ids are issued at a handle's first move, as the runtime issues
        # step ids and tids from counters: first holds come in id order.
        self.holders: dict[int, Any] = {}
        self.next_id: dict[str, int] = {"step": 0, "task": 0}

    def holder(self, handle: int) -> Any:
        """The handle's holder; one that never held a page gets the next id
        tentatively (kept by ``issued`` only once a claim or bind succeeds)."""
        from omni_prefix_cache.writes.staging import StagingBufferHolder

        if handle in self.holders:
            return self.holders[handle]
        kind = self.kinds[handle]
        make = StagingBufferHolder.for_step if kind == "step" else StagingBufferHolder.for_task
        return make(self.next_id[kind])

    def issued(self, handle: int, holder: Any) -> None:
        if handle not in self.holders:
            self.holders[handle] = holder
            self.next_id[holder.kind] += 1


class StagingHolderAdapter(SpecAdapter):
    """``staging_holder`` against StagingBufferPool over ``depth`` pages.

    A handle is one holder (a step or a task holder). ``claim`` takes the
    lowest free page (the model predicts it); ``bind`` draws the page; the
    release triggers name the page the model says the holder holds (or a
    drawn one when it holds none). Observed: each page's holder set, and
    the number of claimer wakes (``wake_claimers_if_free``).

    RELEASED is final on the pool too: a released holder that tries to
    claim or bind again is refused.
    """

    handle_name = "holder"
    max_handles = 6
    retire_final = False

    def __init__(self, spec: MachineSpec | None = None, depth: int = 2):
        self.spec = spec or load_spec("staging_holder")
        self.depth = depth

    def new_system(self) -> _PoolSystem:
        return _PoolSystem(self.depth, capacity=4)

    def create(self, system: _PoolSystem, handle: int, args: Mapping[str, Any]) -> None:
        system.kinds[handle] = args["kind"]

    def fire(self, system: _PoolSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        holder = system.holder(handle)
        if trigger == "claim":
            system.pool.claim(holder, timeout=0)
            system.issued(handle, holder)
        elif trigger == "bind":
            system.pool.bind(args["page"], holder)
            system.issued(handle, holder)
        else:
            system.pool.release(args["page"], holder, StagingHolderTrigger(trigger))

    def read_state(self, system: _PoolSystem, handle: int) -> str:
        if handle not in system.holders:
            return "UNHELD"  # no id issued yet: it never held a page
        return str(system.pool.holder_state(system.holders[handle]).name)

    def observe(self, system: _PoolSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        index = {holder: h for h, holder in system.holders.items()}
        out: dict[Hashable, Any] = {("wakes",): system.wakes.wakes}
        out.update({("page", p): frozenset(index[x] for x in busy) for p, busy in enumerate(system.pool._busy)})
        return out

    # ------------------------------------------------------------ model
    def new_model(self, model: ModelWorld) -> None:
        model.obs.update({("page", p): frozenset() for p in range(self.depth)})
        model.obs[("wakes",)] = 0

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.info[handle] = {"kind": args["kind"], "page": None}

    @staticmethod
    def _free_pages(model: ModelWorld) -> list[int]:
        pages = [k for k in model.obs if isinstance(k, tuple) and k[0] == "page"]
        return [p for p in range(len(pages)) if not model.obs[("page", p)]]

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {
            "is_step_holder": lambda ctx: ctx.model.info[ctx.handle]["kind"] == "step",
            "is_task_holder": lambda ctx: ctx.model.info[ctx.handle]["kind"] == "task",
            "page_free": lambda ctx: bool(self._free_pages(ctx.model)),
            "page_busy": lambda ctx: bool(ctx.model.obs[("page", ctx.args["page"])]),
        }

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def wake_claimers_if_free(ctx: MoveCtx) -> None:
            # Runs after the release: wakes claimers when the page is now free.
            page = ctx.args["page"]
            if not ctx.model.obs[("page", page)]:
                ctx.model.obs[("wakes",)] += 1

        return {"wake_claimers_if_free": wake_claimers_if_free}

    def model_after_move(self, ctx: MoveCtx, move: CompiledMove) -> None:
        info = ctx.model.info[ctx.handle]
        if move.dest.name == "HELD":
            page = self._free_pages(ctx.model)[0] if move.trigger == "claim" else ctx.args["page"]
            info["page"] = page
            ctx.model.obs[("page", page)] = ctx.model.obs[("page", page)] | {ctx.handle}
        else:
            page = info["page"]
            info["page"] = None
            ctx.model.obs[("page", page)] = ctx.model.obs[("page", page)] - {ctx.handle}

    def create_args(self, data: Any, model: ModelWorld) -> dict[str, Any]:
        return {"kind": data.draw(st.sampled_from(["step", "task"]), label="kind")}

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if trigger == "claim":
            return {}
        page = model.info[handle]["page"]
        if page is None or trigger == "bind":
            busy = [p for p in range(self.depth) if model.obs[("page", p)]]
            # Mostly a busy page, so binds are not all refused by page_busy.
            if busy and data.draw(st.booleans(), label="busy page"):
                page = data.draw(st.sampled_from(busy), label="page")
            else:
                page = data.draw(st.integers(0, self.depth - 1), label="page")
        return {"page": page}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if trigger == "claim" and outcome == "blocked":
            return Refusal(OmniPrefixCacheStagingTimeoutError, r"no free staging page")
        return Refusal(OmniPrefixCacheUnmatchError)

    # ------------------------------------------------------------ invariants
    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def free_iff_no_holder(m: GeneratedMachine) -> None:
            pool = m.system.pool
            for p, busy in enumerate(pool._busy):
                held_here = {x for x, page in pool._page_of.items() if page == p}
                if busy != held_here:
                    raise Discrepancy(f"page {p}: busy set {busy} but holders on it {held_here}")
                for x in busy:
                    if pool.holder_state(x).name != "HELD":
                        raise Discrepancy(f"page {p} is busy with {x}, which is not HELD")

        def one_step_holder_per_page(m: GeneratedMachine) -> None:
            for p, busy in enumerate(m.system.pool._busy):
                steps = [x for x in busy if x.kind == "step"]
                if len(steps) > 1:
                    raise Discrepancy(f"page {p} has step holders {steps}")

        return {"free_iff_no_holder": free_iff_no_holder, "one_step_holder_per_page": one_step_holder_per_page}

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {"task_holder_has_live_task": "needs the controller's tasks; the composed model check covers it"}


# ------------------------------------------------------------ slot occupancy


# The second key of the occupancy under test: moved only by take_tenancy.
_OTHER_KEY = "m"


class _OccSystem:
    """A SlotOccupancy over the key under test and a second key that only
    slot tenancy moves, with its manager hooks recorded per key."""

    def __init__(self, num_slots: int):
        from omni_prefix_cache.steps.occupancy import SlotOccupancy

        self.occ = SlotOccupancy(num_slots, on_reassign=self._on_reassign, on_reuse=self._on_reuse)
        self.table = self.occ.add_key(HIDDEN_KEY)
        self.other = self.occ.add_key(_OTHER_KEY)
        self.reassigned: dict[int, frozenset[int]] = {}
        self.other_reassigned: dict[int, frozenset[int]] = {}
        self.reuses: dict[int, int] = {}
        self.seen_versions: dict[int, int] = {}

    def _on_reassign(self, tid: int, key: str, slots: torch.Tensor) -> None:
        book = self.reassigned if key == HIDDEN_KEY else self.other_reassigned
        book[tid] = book.get(tid, frozenset()) | frozenset(slots.tolist())

    def _on_reuse(self, key: str, slots: torch.Tensor) -> None:
        if key != HIDDEN_KEY:
            return
        for s in slots.tolist():
            self.reuses[s] = self.reuses.get(s, 0) + 1


class SlotOccupancyAdapter(SpecAdapter):
    """``slot_occupancy`` against SlotOccupancy (one key, ``num_slots`` rows).

    A handle is one slot. ``map`` draws the new owner tid, ``commit`` /
    ``drop`` the writer (mostly the current owner). Observed effects:
    ``set_owner`` / ``clear_owner`` as the slot's tid, ``bump_version`` as
    its version, ``reassign_from_old_owner`` as the slots the manager's
    on_reassign hook records per old owner, ``preserve_pending_reads`` as
    the on_reuse hook calls per slot. ``reset`` has no new owner (tid -1).
    An environment rule applies one trigger to several slots in one
    vectorised call (all or nothing when a row is illegal); another takes
    slot tenancy (the ``take_tenancy`` coupling) writing the key under test
    and maybe the second key, which must then be IN_TRANSIT with the
    tenant or, when not written, ABSENT (``tenant_owns_all_keys``).
    """

    handle_name = "slot"
    max_handles = 4
    tids = 3

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("slot_occupancy")
        unknown = sorted(set(self.spec.triggers) - {"map", "commit", "drop", "reset"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: SlotOccupancy has no call for triggers {unknown}")
        self.tenancy = {c.name: c for c in self.spec.couplings}.get("take_tenancy")

    def new_system(self) -> _OccSystem:
        return _OccSystem(self.max_handles)

    def create(self, system: _OccSystem, handle: int, args: Mapping[str, Any]) -> None:
        pass  # every slot row exists from the start; the handle brings it under test

    def fire(self, system: _OccSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        moved = system.occ.apply(trigger, HIDDEN_KEY, torch.tensor([handle]), args["tid"])
        if moved != 1:
            raise Refused(f"{trigger}: {moved} rows moved")

    def read_state(self, system: _OccSystem, handle: int) -> str:
        from omni_prefix_cache.steps.occupancy import SlotState

        return SlotState(int(system.table.state[handle])).name

    def observe(self, system: _OccSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            out[("owner", h)] = int(system.table.tids[h])
            out[("version", h)] = int(system.table.slot_version[h])
            out[("reuses", h)] = system.reuses.get(h, 0)
        for tid, slots in system.reassigned.items():
            out[("reassigned", tid)] = slots
        return out

    # ------------------------------------------------------------ model
    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update({("owner", handle): -1, ("version", handle): 0, ("reuses", handle): 0})

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {"owned_by_writer": lambda ctx: ctx.model.obs[("owner", ctx.handle)] == ctx.args["tid"]}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def set_owner(ctx: MoveCtx) -> None:
            ctx.model.obs[("owner", ctx.handle)] = ctx.args["tid"]

        def clear_owner(ctx: MoveCtx) -> None:
            ctx.model.obs[("owner", ctx.handle)] = -1

        def bump_version(ctx: MoveCtx) -> None:
            ctx.model.obs[("version", ctx.handle)] += 1

        def preserve_pending_reads(ctx: MoveCtx) -> None:
            ctx.model.obs[("reuses", ctx.handle)] += 1

        def reassign_from_old_owner(ctx: MoveCtx) -> None:
            old = ctx.model.obs[("owner", ctx.handle)]
            if old != ctx.args["tid"]:  # remapping its own slot takes nothing
                key = ("reassigned", old)
                ctx.model.obs[key] = ctx.model.obs.get(key, frozenset()) | {ctx.handle}

        return {
            "set_owner": set_owner,
            "clear_owner": clear_owner,
            "bump_version": bump_version,
            "preserve_pending_reads": preserve_pending_reads,
            "reassign_from_old_owner": reassign_from_old_owner,
        }

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if self.tenancy is not None and trigger == self.tenancy.others:
            return {"tid": -1}  # the key loses its rows to a tenant that does not write it
        owner = model.obs[("owner", handle)]
        if trigger != "map" and owner >= 0 and data.draw(st.booleans(), label="the owner writes"):
            return {"tid": owner}
        return {"tid": data.draw(st.integers(0, self.tids - 1), label="tid")}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if outcome == "blocked":
            return Refusal(Refused)  # a guard-refused row stays; apply reports 0 moved
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger} is illegal from")

    def env_rules(self) -> Sequence[EnvRule]:
        def vector(machine: GeneratedMachine, data: Any) -> None:
            handles = sorted(machine.model.states)
            picked = data.draw(st.lists(st.sampled_from(handles), min_size=2, unique=True), label="slots")
            trigger = data.draw(st.sampled_from(self.spec.triggers), label="trigger")
            rows = [(h, self.trigger_args(data, machine.model, h, trigger)) for h in picked]
            outcomes = [machine.model_outcome(h, trigger, a) for h, a in rows]
            call: Callable[[], Any] = lambda: machine.system.occ.apply(  # noqa: E731
                trigger, HIDDEN_KEY, torch.tensor(picked), torch.tensor([a["tid"] for _, a in rows])
            )
            where = f"vectorised {trigger} on slots {picked}"
            if any(o == "illegal" for o, _ in outcomes):
                machine.expect_refusal(where, Refusal(OmniPrefixCacheUnmatchError, "is illegal from"), call)
                return
            moved = call()
            expected = sum(o == "moved" for o, _ in outcomes)
            if moved != expected:
                raise Discrepancy(f"{where}: {moved} rows moved, spec {expected}")
            for (h, a), (o, move) in zip(rows, outcomes, strict=True):
                if o == "moved" and move is not None:
                    machine.apply_model_move(h, move, a)

        def take_tenancy(machine: GeneratedMachine, data: Any) -> None:
            assert self.tenancy is not None
            handles = sorted(machine.model.states)
            picked = data.draw(st.lists(st.sampled_from(handles), min_size=1, unique=True), label="slots")
            tid = data.draw(st.integers(0, self.tids - 1), label="tenant tid")
            both = data.draw(st.booleans(), label=f"the tenant writes {_OTHER_KEY!r} too")
            writes: dict[str, Any] = {HIDDEN_KEY: tid, **({_OTHER_KEY: tid} if both else {})}
            machine.system.occ.take_tenancy(torch.tensor(picked), writes)
            other = machine.model.env.setdefault("other", {})
            lost = machine.model.env.setdefault("other_reassigned", {})
            for h in picked:
                outcome, move = machine.model_outcome(h, self.tenancy.fires, {"tid": tid})
                if outcome != "moved" or move is None:
                    raise Discrepancy(f"take_tenancy: {self.tenancy.fires} is {outcome} from {machine.model.states[h]}")
                machine.apply_model_move(h, move, {"tid": tid})
                old = other.get(h, ("ABSENT", -1))
                # Reset takes the rows from any owner, a takeover from another one.
                if old[0] == "IN_TRANSIT" and (not both or old[1] != tid):
                    lost[old[1]] = lost.get(old[1], frozenset()) | {h}
                other[h] = ("IN_TRANSIT", tid) if both else ("ABSENT", -1)
            machine.check_agree(f"take_tenancy of slots {picked} by tid {tid} (writes {sorted(writes)})")

        rules = [EnvRule("vector_apply", vector, lambda model: len(model.states) >= 2)]
        if self.tenancy is not None:
            rules.append(EnvRule("take_tenancy", take_tenancy, lambda model: len(model.states) >= 1))
        return tuple(rules)

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def owner_iff_in_transit(m: GeneratedMachine) -> None:
            m.system.occ.check_invariants()
            t = m.system.table
            bad = ((t.state == 1) != (t.tids != -1)).nonzero().flatten().tolist()
            if bad:
                raise Discrepancy(f"slots {bad}: owner set iff IN_TRANSIT broken")

        def version_monotonic(m: GeneratedMachine) -> None:
            for h in m.model.states:
                v = int(m.system.table.slot_version[h])
                if v < m.system.seen_versions.get(h, 0):
                    raise Discrepancy(f"slot {h}: version went down to {v}")
                if v != m.system.reuses.get(h, 0):
                    raise Discrepancy(f"slot {h}: version {v} after {m.system.reuses.get(h, 0)} reuses")
                m.system.seen_versions[h] = v

        def tenant_owns_all_keys(m: GeneratedMachine) -> None:
            from omni_prefix_cache.steps.occupancy import SlotState

            t = m.system.other
            for h, (state, owner) in m.model.env.get("other", {}).items():
                got = (SlotState(int(t.state[h])).name, int(t.tids[h]))
                if got != (state, owner):
                    raise Discrepancy(f"slot {h}: key {_OTHER_KEY!r} is {got} after its last tenancy, expected {state}")
            want = m.model.env.get("other_reassigned", {})
            if m.system.other_reassigned != want:
                raise Discrepancy(
                    f"key {_OTHER_KEY!r}: rows taken from old owners {m.system.other_reassigned}, expected {want}"
                )

        return {
            "owner_iff_in_transit": owner_iff_in_transit,
            "version_monotonic": version_monotonic,
            "tenant_owns_all_keys": tenant_owns_all_keys,
        }

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {"owner_is_live_task": "needs the manager's task registry; the composed model check covers it"}


# -------------------------------------------------------------- step context


class _EmptyView:
    """A group view with no batch: every save is a leftover-only step."""

    block_size = 4

    def batch_req_ids(self) -> list[str]:
        return []

    def step_slots_cpu(self, order: Sequence[str], num_scheduled: Mapping[str, int]) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64)


class _ManagerSystem:
    def __init__(self, pages: int):
        from omni_prefix_cache.interface import PrefixCacheConfig
        from omni_prefix_cache.manager import OmniPrefixCacheManager

        config = PrefixCacheConfig(num_blocks=4, block_size=4, staging_depth=pages, staging_claim_timeout_s=0)
        self.mgr = OmniPrefixCacheManager(config, _EmptyView(), eager=True)
        self.sids: dict[int, int] = {}


class StepContextAdapter(SpecAdapter):
    """``step_context`` against OmniPrefixCacheManager (eager, CPU).

    A handle is a step: ``save`` runs new_step_starts + a leftover-only
    save_outputs and binds the issued id to the handle; ``materialize`` /
    ``discard`` consume it (an unsaved handle uses an id never issued).
    Observed: whether the staging pool holds the step's holder
    (``release_step_holder`` lets it go). ``save`` of an issued id cannot be
    expressed (the manager issues fresh ids), so that illegal move is skipped.
    """

    handle_name = "step"
    max_handles = 3

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("step_context")
        unknown = sorted(set(self.spec.triggers) - {"save", "materialize", "discard"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: the manager has no call for triggers {unknown}")

    def new_system(self) -> _ManagerSystem:
        return _ManagerSystem(pages=self.max_handles + 1)

    def close(self, system: _ManagerSystem) -> None:
        system.mgr.shutdown()

    def create(self, system: _ManagerSystem, handle: int, args: Mapping[str, Any]) -> None:
        pass  # the manager issues the id at save

    def _sid(self, system: _ManagerSystem, handle: int) -> int:
        return system.sids.get(handle, 10_000 + handle)

    def fire(self, system: _ManagerSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        from types import SimpleNamespace

        mgr = system.mgr
        if trigger == "save":
            mgr.new_step_starts(SimpleNamespace(finished_req_ids=[], scheduled_new_reqs=[], num_scheduled_tokens={}))
            system.sids[handle] = mgr.save_outputs(torch.zeros(0, 4), None, num_tokens_unpadded=0, num_tokens_padded=0)
        elif trigger == "materialize":
            mgr.materialize(self._sid(system, handle), [])
        else:
            mgr.discard_step(self._sid(system, handle))

    def can_express(self, trigger: str, state: str) -> bool:
        return trigger != "save"

    def read_state(self, system: _ManagerSystem, handle: int) -> str:
        from omni_prefix_cache.steps.step_context import StepState

        sid = system.sids.get(handle)
        if sid is None:
            return "UNSAVED"
        ctx = system.mgr._step_ctxs.get(sid)
        return StepState(ctx.state).name if ctx is not None else "CONSUMED"

    def _pages_held(self, system: _ManagerSystem, handle: int) -> int:
        from omni_prefix_cache.writes.staging import StagingBufferHolder

        holder = StagingBufferHolder.for_step(self._sid(system, handle))
        return sum(holder in busy for busy in system.mgr._controller._staging_pool._busy)

    def observe(self, system: _ManagerSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        return {("pages_held", h): self._pages_held(system, h) for h in handles}

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs[("pages_held", handle)] = 0

    def model_after_move(self, ctx: MoveCtx, move: CompiledMove) -> None:
        if move.trigger == "save":  # save claims the step's page (one_holder_per_saved_step)
            ctx.model.obs[("pages_held", ctx.handle)] = 1

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def release_step_holder(ctx: MoveCtx) -> None:
            ctx.model.obs[("pages_held", ctx.handle)] = 0

        return {"release_step_holder": release_step_holder}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger}\(step \d+\): illegal from")

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def one_holder_per_saved_step(m: GeneratedMachine) -> None:
            for h in m.model.states:
                state = self.read_state(m.system, h)
                held = self._pages_held(m.system, h)
                if held != (1 if state == "SAVED" else 0):
                    raise Discrepancy(f"step {h} is {state} and holds {held} staging pages")

        return {"one_holder_per_saved_step": one_holder_per_saved_step}


# -------------------------------------------------------------- planned read


class _ReadSystem:
    """PlannedReads over a two-slot pool, plus the slot versions and values
    a reuse would bump and overwrite (what occupancy and the committer do)."""

    slots = 2

    def __init__(self) -> None:
        from omni_prefix_cache.block_pool import PrefixBlockPool
        from omni_prefix_cache.interface import PrefixCacheConfig
        from omni_prefix_cache.reads.planned_read import PlannedReads

        self.pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=1, block_size=self.slots))
        self.pool.ensure_key(HIDDEN_KEY, torch.float32, 2)
        self.reads = PlannedReads(self.pool)
        self.refs: dict[int, Any] = {}
        self.version = [0] * self.slots
        self.planned_value: dict[int, float] = {}
        self._writes = 0
        for slot in range(self.slots):
            self.overwrite(slot)

    def overwrite(self, slot: int) -> None:
        self._writes += 1
        self.pool.write(HIDDEN_KEY, torch.tensor([slot]), torch.full((1, 2), float(self._writes)))

    def value(self, slot: int) -> float:
        return float(self.pool.rows(HIDDEN_KEY, torch.tensor([slot]))[0, 0])


class PlannedReadAdapter(SpecAdapter):
    """``planned_read`` against PlannedReads (the manager's planned reads).

    A handle is one read of one slot (``handle % 2``). Every trigger is a
    ``PlannedReads.move`` on the read; an environment rule reuses a slot the
    way a new tenant's map does: the bulk ``preserve`` over every live read
    of it, then the version bump and the overwrite of the pool row.
    Observed: ``add_pending`` / ``forget_pending`` as membership of the
    pending index, ``copy_old_rows`` as the read's preserved slots.
    """

    handle_name = "read"
    max_handles = 4

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("planned_read")
        unknown = sorted(set(self.spec.triggers) - {"register", "refuse", "preserve", "fetch", "serve", "fail", "drop"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: PlannedReads has no call for triggers {unknown}")
        always_added, _ = states_after(self.spec, lambda m: "add_pending" in m.effects)
        _, maybe_forgotten = states_after(self.spec, lambda m: "forget_pending" in m.effects)
        self.live = always_added - maybe_forgotten

    @staticmethod
    def _slot(handle: int) -> int:
        return handle % _ReadSystem.slots

    def new_system(self) -> _ReadSystem:
        return _ReadSystem()

    def create(self, system: _ReadSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.reads.planned_read import PlannedRead

        slot = self._slot(handle)
        system.refs[handle] = PlannedRead(
            req_id=f"r{handle}",
            key=HIDDEN_KEY,
            slots=torch.tensor([slot]),
            planned_version=torch.tensor([system.version[slot]]),
        )
        system.planned_value[handle] = system.value(slot)

    def fire(self, system: _ReadSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        reused = {self._slot(handle)} if trigger == "preserve" else None
        system.reads.move(system.refs[handle], trigger, reused)

    def read_state(self, system: _ReadSystem, handle: int) -> str:
        from omni_prefix_cache.reads.planned_read import ReadState

        return ReadState(int(system.refs[handle].state)).name

    def observe(self, system: _ReadSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            ref = system.refs[h]
            indexed = ref in system.reads.by_key.get(HIDDEN_KEY, ())
            out[("pending", h)] = (ref in system.reads.pending, indexed)
            out[("preserved", h)] = frozenset(ref.preserved)
        return out

    # ------------------------------------------------------------ model
    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update({("pending", handle): (False, False), ("preserved", handle): frozenset()})

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def add_pending(ctx: MoveCtx) -> None:
            ctx.model.obs[("pending", ctx.handle)] = (True, True)

        def forget_pending(ctx: MoveCtx) -> None:
            ctx.model.obs[("pending", ctx.handle)] = (False, False)

        def copy_old_rows(ctx: MoveCtx) -> None:
            ctx.model.obs[("preserved", ctx.handle)] |= {self._slot(ctx.handle)}

        return {"add_pending": add_pending, "forget_pending": forget_pending, "copy_old_rows": copy_old_rows}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger} is illegal from")

    def env_rules(self) -> Sequence[EnvRule]:
        def reuse_slot(machine: GeneratedMachine, data: Any) -> None:
            system: _ReadSystem = machine.system
            # Planning runs under the state lock a reuse needs too: no reuse
            # of a slot while a read of it is being planned.
            planning = {self._slot(h) for h, s in machine.model.states.items() if s == self.spec.initial}
            free = [s for s in range(_ReadSystem.slots) if s not in planning]
            if not free:
                return
            slot = data.draw(st.sampled_from(free), label="reused slot")
            readers = [h for h in sorted(machine.model.states) if self._slot(h) == slot]
            # The bulk preserve reaches exactly the reads in the pending index.
            indexed = [h for h in readers if machine.model.obs[("pending", h)][1]]
            outcomes = [(h, *machine.model_outcome(h, "preserve", {})) for h in indexed]
            where = f"reuse of slot {slot} (live reads {indexed})"

            def call() -> None:
                system.reads.preserve(HIDDEN_KEY, torch.tensor([slot]))

            if any(o == "illegal" for _, o, _ in outcomes):
                machine.expect_refusal(where, Refusal(OmniPrefixCacheUnmatchError, "preserve is illegal from"), call)
                return
            call()
            for h, _, move in outcomes:
                assert move is not None
                machine.apply_model_move(h, move, {})
            system.version[slot] += 1
            system.overwrite(slot)
            machine.check_agree(where)

        return (EnvRule("reuse_slot", reuse_slot, lambda model: bool(model.states)),)

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def pending_iff_live(m: GeneratedMachine) -> None:
            for h in m.model.states:
                state = self.read_state(m.system, h)
                ref = m.system.refs[h]
                if (ref in m.system.reads.pending) != (state in self.live):
                    raise Discrepancy(f"read {h} is {state}; pending index membership {ref in m.system.reads.pending}")

        def copy_on_write(m: GeneratedMachine) -> None:
            for h in m.model.states:
                ref = m.system.refs[h]
                if self.read_state(m.system, h) not in self.live:
                    continue
                slot = self._slot(h)
                if m.system.version[slot] == int(ref.planned_version[0]):
                    continue
                row = ref.preserved.get(slot)
                if row is None or float(row[0]) != m.system.planned_value[h]:
                    got = None if row is None else float(row[0])
                    raise Discrepancy(
                        f"read {h}: slot {slot} was reused (version {m.system.version[slot]}) and the read holds "
                        f"{got}, not the rows it planned ({m.system.planned_value[h]})"
                    )

        return {"pending_iff_live": pending_iff_live, "copy_on_write": copy_on_write}


# ------------------------------------------------------------ copy queues

# Where a position's entry sits: the queues (STALE: still on one of them until
# its pop), the claimed list, the blocked list; None: on none.
_QUEUE_BOXES: dict[str, tuple[str, ...]] = {
    "UNQUEUED": (),
    "HIGH": ("high",),
    "LOW": ("low",),
    "CLAIMED": ("claimed",),
    "BLOCKED": ("blocked",),
    "STALE": ("high", "low"),
    "INLINE": (),
    "DONE": (),
}


class _QueueEntry:
    """What CopyQueues reads of a task: its tid and its position."""

    def __init__(self, tid: int):
        from omni_prefix_cache.specs.types.copy_queue import QueuePosition

        self.tid = tid
        self.position: Any = QueuePosition.UNQUEUED


class _QueueSystem:
    def __init__(self) -> None:
        from omni_prefix_cache.writes.copy_queues import CopyQueues

        self.queues = CopyQueues()
        self.entries: dict[int, _QueueEntry] = {}
        self.taken: set[int] = set()  # claimed or blocked work a committer took


class CopyQueueAdapter(SpecAdapter):
    """``copy_queue`` against CopyQueues (the controller's queues).

    A handle is one task's queue entry; every trigger is ``CopyQueues.fire``.
    An environment rule takes claimed or blocked work the way a committer
    does (the entry leaves its list, the position stays until the move).
    Checked: each entry sits exactly where its position says, once.
    """

    handle_name = "entry"
    max_handles = 5

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("copy_queue")
        unknown = sorted(set(self.spec.state_names) - set(_QUEUE_BOXES))
        if unknown:
            raise SpecError(f"{self.spec.origin}: the adapter does not know where {unknown} entries sit")

    def new_system(self) -> _QueueSystem:
        return _QueueSystem()

    def create(self, system: _QueueSystem, handle: int, args: Mapping[str, Any]) -> None:
        system.entries[handle] = _QueueEntry(handle)

    def fire(self, system: _QueueSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        system.queues.fire(system.entries[handle], CopyQueueTrigger(trigger))

    def read_state(self, system: _QueueSystem, handle: int) -> str:
        from omni_prefix_cache.specs.types.copy_queue import QueuePosition

        return QueuePosition(int(system.entries[handle].position)).name

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        from omni_prefix_cache.specs.composition import ProtocolViolation

        return Refusal(ProtocolViolation, rf"copy queue position \w+ has no move '{trigger}'")

    def env_rules(self) -> Sequence[EnvRule]:
        def take_work(machine: GeneratedMachine, data: Any) -> None:
            system = machine.system
            which = data.draw(st.sampled_from(["claimed", "blocked"]), label="list")
            if which == "claimed":
                tid = system.queues.take_claimed()
                if tid is not None:
                    system.taken.add(tid)
            elif system.queues.blocked:
                system.taken.add(system.queues.blocked.pop(0))

        return (EnvRule("take_work", take_work),)

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def one_position(m: GeneratedMachine) -> None:
            queues = m.system.queues
            boxes = {"high": queues.high, "low": queues.low, "claimed": queues.claimed, "blocked": queues.blocked}
            for h in m.system.entries:
                state = self.read_state(m.system, h)
                where = [name for name, box in boxes.items() for tid in box if tid == h]
                allowed = _QUEUE_BOXES[state]
                taken = h in m.system.taken and state in ("CLAIMED", "BLOCKED")
                if len(where) > 1 or (where and where[0] not in allowed) or (not where and allowed and not taken):
                    raise Discrepancy(f"entry {h} in {state} sits on {where} (expected one of {list(allowed)})")

        return {"one_position": one_position}
