"""The model checker's broken variants: spec mutations, not code switches.

Each ``Mutation`` patches the loaded composition (``ProtocolSpec.mutated``)
and/or component machines (by machine name), and names the invariant the
check must find broken. ``load_variant`` also reads a whole replacement
protocol file (a mutation kept as a file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_prefix_cache.specs.composition import ProtocolSpec, load_protocol, parse_protocol
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, parse_spec
from omni_prefix_cache.testing.mutants import spec_to_dict, with_move, without_move


def _op(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(o for o in data["operations"] if o["name"] == name)


@dataclass(frozen=True)
class Mutation:
    """A broken variant: a patch of the protocol mapping and/or of component
    machines (by machine name), and the invariant the check must find broken."""

    meaning: str
    invariant: str
    protocol: Callable[[dict[str, Any]], None] | None = None
    machines: Mapping[str, Callable[[MachineSpec], MachineSpec]] = field(default_factory=dict)
    at_least: Mapping[str, int] = field(default_factory=dict)  # bounds the bug needs (e.g. two keys)


def _requeue_claimed(data: dict[str, Any]) -> None:
    first_of = _op(data, "escalate")["segments"][0]["steps"][0]["first_of"]
    first_of.append(["position.push_head"])


def _done_before_publish(data: dict[str, Any]) -> None:
    segs = _op(data, "committer_write")["segments"]
    segs[1]["steps"].remove({"do": "publish_completed"})
    segs.append({"lock": "controller", "steps": [{"do": "publish_completed"}]})


def _fail_never_wakes(data: dict[str, Any]) -> None:
    segs = _op(data, "fail")["segments"]
    segs[:] = [s for s in segs if {"do": "wake_failed"} not in s.get("steps", [])]
    data["effects"] = [e for e in data["effects"] if e["name"] != "wake_failed"]


def _split_claim(data: dict[str, Any]) -> None:
    seg = _op(data, "committer_claim")["segments"][0]
    seg["steps"] = [{"first_of": [["position.claim"], ["position.skip"]]}]
    _op(data, "committer_claim")["segments"].append({"lock": "task", "steps": ["task.claim_copy?"]})


def _save_without_barrier(data: dict[str, Any]) -> None:
    segs = _op(data, "save")["segments"]
    segs[:] = [s for s in segs if "wait" not in s]


def _unpin_twice(data: dict[str, Any]) -> None:
    _op(data, "committer_claim")["segments"][0]["steps"][0]["first_of"][0].append({"do": "unpin_budget"})


def _reset_keeps_committed(spec: MachineSpec) -> MachineSpec:
    move = {"trigger": "reset", "source": "COMMITTED", "dest": "COMMITTED", "meaning": "mutant: keep the old rows"}
    return with_move(without_move(spec, "reset", "COMMITTED"), move)


def _without_effect(effect: str) -> Callable[[MachineSpec], MachineSpec]:
    def patch(spec: MachineSpec) -> MachineSpec:
        data = spec_to_dict(spec)
        for move in data["transitions"]:
            move["after"] = [e for e in move["after"] if e != effect]
        return parse_spec(data, origin=f"{spec.origin} (-{effect})")

    return patch


BROKEN: dict[str, Mutation] = {
    "escalate-requeues-copying": Mutation(
        "escalate pushes a task the committer already claimed back on the high queue "
        "(copy_queue: push_head from CLAIMED; escalate: a third alternative)",
        "position_matches_task",
        _requeue_claimed,
        {
            "copy_queue": lambda s: with_move(
                s,
                {
                    "trigger": "push_head",
                    "source": "CLAIMED",
                    "dest": "HIGH",
                    "meaning": "mutant: requeue a claimed task",
                },
            )
        },
    ),
    "done-before-publish": Mutation(
        "the pool write sets done before it publishes the completion record", "done_after_record", _done_before_publish
    ),
    "fail-never-wakes": Mutation(
        "fail without its wake_failed segment (host_ready / done stay unset)", "can_settle", _fail_never_wakes
    ),
    "no-copy-on-write": Mutation(
        "slot_occupancy without preserve_pending_reads: reusing a committed slot skips a planned read's copy",
        "copy_on_write",
        machines={"slot_occupancy": _without_effect("preserve_pending_reads")},
    ),
    "spec-no-drop": Mutation(
        "slot_occupancy without the drop move: a failed write's slots stay IN_TRANSIT",
        "slot_occupancy.owner_is_live_task",
        machines={"slot_occupancy": lambda s: without_move(s, "drop", "IN_TRANSIT")},
    ),
    "split-claim": Mutation(
        "committer_claim pops the entry and claims the copy in two critical sections (double claim window)",
        "position_matches_task",
        _split_claim,
    ),
    "save-without-barrier": Mutation(
        "save maps slots without waiting for the previous step's immediate writes",
        "save_waits_previous_writes",
        _save_without_barrier,
    ),
    "stale-tenant": Mutation(
        "slot_occupancy's reset keeps a COMMITTED key: a new tenant that does not write an mm key "
        "serves the previous tenant's rows",
        "slot_occupancy.tenant_owns_all_keys",
        machines={"slot_occupancy": _reset_keeps_committed},
        at_least={"keys": 2},
    ),
    "unpin-twice": Mutation(
        "unpin_budget runs twice: at the claim (too early, the clone is still held) and after the copy",
        "staged_bytes",
        _unpin_twice,
    ),
}


def load_variant(broken: str | None) -> tuple[ProtocolSpec, str | None]:
    """The protocol a check runs: shipped, a catalogued mutation, or a file."""
    base = load_protocol()
    if broken is None:
        return base, None
    if broken in BROKEN:
        mut = BROKEN[broken]
        spec = base.mutated(mut.protocol) if mut.protocol is not None else base
        if mut.machines:
            comps = {
                role: mut.machines[m.name](m) if m.name in mut.machines else m for role, m in spec.components.items()
            }
            spec = dataclasses.replace(spec, components=comps)
        return spec, mut.invariant
    path = Path(broken)
    if path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SpecError(f"{path}: cannot read: {exc}") from exc
        return parse_protocol(data, origin=str(path), check_orderings=False), None
    raise ValueError(f"unknown broken variant {broken!r}; known: {', '.join(BROKEN)} (or a protocol .yaml file)")
