"""``CopyQueueAdapter``: plays ``copy_queue`` on ``omni_prefix_cache.writes.copy_queues.CopyQueues``.

Maps each trigger to the runtime call(s) that fire it, reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime (see ``testing.stateful``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    EnvRule,
    GeneratedMachine,
    Outcome,
    Refusal,
    SpecAdapter,
)

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
