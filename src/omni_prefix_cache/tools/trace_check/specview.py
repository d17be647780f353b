"""What the validator reads of the specs: every machine in ``spec/``
compiled (its move tables; the handlers are stand-ins, a replay runs no
effect), and per operation of the composition the steps of each segment
as an ordered list of items, the roles' machines and the ordering rules.
Nothing here names a machine, a state or an operation: a spec added to
``spec/`` is replayed with no code change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_prefix_cache.specs import CompiledMachine, compile_machine, load_all_specs
from omni_prefix_cache.specs.composition import Do, Fire, OperationSpec, ProtocolSpec, load_protocol
from omni_prefix_cache.specs.composition_grammar import walk_steps

# An item a trace record can be matched to: ("mv", machine, trigger),
# ("fx", effect) or ("wait", event).
Item = tuple[str, ...]


def _nothing(*_: Any) -> None:
    return None


def compiled_machines() -> dict[str, CompiledMachine]:
    """Every shipped machine spec, compiled with stand-in handlers."""
    return {
        name: compile_machine(
            spec,
            guards=dict.fromkeys(spec.guard_names, _nothing),
            effects=dict.fromkeys(spec.effect_names, _nothing),
        )
        for name, spec in load_all_specs().items()
    }


@dataclass(frozen=True)
class SegmentView:
    """One segment of an operation: its lock and its items in step order
    (``positions[item]``: where the item may stand, ascending)."""

    lock: str
    wait: str | None
    items: tuple[Item, ...]
    positions: Mapping[Item, tuple[int, ...]]


@dataclass(frozen=True)
class OrderingView:
    name: str
    operation: str
    items: tuple[Item, ...]
    meaning: str


class SpecView:
    """The specs as the replay uses them."""

    def __init__(self, protocol: ProtocolSpec | None = None, machines: dict[str, CompiledMachine] | None = None):
        self.protocol = protocol or load_protocol()
        self.machines = machines or compiled_machines()
        self.role_machine = {role: spec.name for role, spec in self.protocol.components.items()}
        self.segments: dict[str, tuple[SegmentView, ...]] = {
            name: tuple(self._segment(seg) for seg in op.segments) for name, op in self.protocol.ops.items()
        }
        self.for_each = {name: op.for_each for name, op in self.protocol.ops.items()}
        self.op_moves = {name: self._moves(op) for name, op in self.protocol.ops.items()}
        self.orderings = tuple(
            OrderingView(rule.name, rule.operation, tuple(self.item(label) for label in rule.order), rule.meaning)
            for rule in self.protocol.orderings
        )
        self.invariants = self.protocol.invariant_names

    def item(self, label: str) -> Item:
        """The item an ordering rule's label names: ``wait EVENT``,
        ``role.trigger[?]`` or an effect."""
        if label.startswith("wait "):
            return ("wait", label[5:])
        role, dot, trigger = label.rstrip("?").partition(".")
        if dot and role in self.role_machine:
            return ("mv", self.role_machine[role], trigger)
        return ("fx", label)

    def _segment(self, seg: Any) -> SegmentView:
        items: list[Item] = []
        for step in walk_steps(seg.steps):
            if isinstance(step, Fire):
                items.append(("mv", self.role_machine[step.role], step.trigger))
            elif isinstance(step, Do):
                items.append(("fx", step.effect))
        positions: dict[Item, list[int]] = {}
        for i, it in enumerate(items):
            positions.setdefault(it, []).append(i)
        return SegmentView(seg.lock, seg.wait, tuple(items), {k: tuple(v) for k, v in positions.items()})

    def _moves(self, op: OperationSpec) -> frozenset[tuple[str, str]]:
        return frozenset((self.role_machine[role], trigger) for role, trigger in op.moves)

    def describe_item(self, item: Item) -> str:
        if item[0] == "mv":
            roles = [r for r, m in self.role_machine.items() if m == item[1]]
            return f"{'/'.join(roles) or item[1]}.{item[2]}"
        if item[0] == "wait":
            return f"wait {item[1]}"
        return item[1]
