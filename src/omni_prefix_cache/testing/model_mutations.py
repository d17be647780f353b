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
    model: str = "write"  # the world that finds it: "write" (the write path) or "lifecycle"


def _requeue_claimed(data: dict[str, Any]) -> None:
    first_of = _op(data, "escalate")["segments"][0]["steps"][0]["first_of"]
    first_of.append(["position.push_head"])


def _done_before_publish(data: dict[str, Any]) -> None:
    segs = _op(data, "committer_write")["segments"]
    segs[1]["steps"].remove({"do": "publish_completed"})
    segs.append({"name": "publish_late", "lock": "controller", "steps": [{"do": "publish_completed"}]})


def _fail_never_wakes(data: dict[str, Any]) -> None:
    segs = _op(data, "fail")["segments"]
    segs[:] = [s for s in segs if {"do": "wake_failed"} not in s.get("steps", [])]
    _drop_effect(data, "wake_failed")


def _split_claim(data: dict[str, Any]) -> None:
    seg = _op(data, "committer_claim")["segments"][0]
    seg["steps"] = [{"first_of": [["position.claim"], ["position.skip"]]}]
    _op(data, "committer_claim")["segments"].append(
        {"name": "claim_copy", "lock": "task", "steps": ["task.claim_copy?"]}
    )


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


def _drop_effect(data: dict[str, Any], name: str) -> None:
    """``name`` is no longer declared, nor run by its executor."""
    data["effects"] = [e for e in data["effects"] if e["name"] != name]
    for executor in data["executors"]:
        executor["effects"] = [e for e in executor["effects"] if e != name]


def _view_without_gap_check(data: dict[str, Any]) -> None:
    steps = _op(data, "delivery_view")["segments"][0]["steps"]
    i = next(i for i, step in enumerate(steps) if isinstance(step, dict) and step.get("when") == "gap")
    steps[i : i + 1] = steps[i]["else"]  # the view and the clip, with no gap check before them


def _drop_guard(data: dict[str, Any], name: str) -> None:
    data["guards"] = [g for g in data["guards"] if g["name"] != name]


def _without_condition(trigger: str, guard: str) -> Callable[[MachineSpec], MachineSpec]:
    def patch(spec: MachineSpec) -> MachineSpec:
        data = spec_to_dict(spec)
        for move in data["transitions"]:
            if move["trigger"] == trigger:
                move["conditions"] = [g for g in move.get("conditions", []) if g != guard]
        return parse_spec(data, origin=f"{spec.origin} ({trigger} without {guard})")

    return patch


def _view_past_saved(data: dict[str, Any]) -> None:
    steps = _op(data, "delivery_view")["segments"][0]["steps"]
    steps[:] = [s for s in steps if not (isinstance(s, dict) and s.get("when") == "outside_saved")]
    _drop_guard(data, "outside_saved")


def _ack_unissued_view(data: dict[str, Any]) -> None:
    spent = _op(data, "ack_delivery")["segments"][0]["steps"][0]
    gap = spent["else"][0]
    gap["else"] = gap["else"][0]["else"]  # delivery.ack, with no not_issued check before it
    steps = _op(data, "commit_output")["segments"][0]["steps"]
    steps[:] = [s for s in steps if not (isinstance(s, dict) and s.get("when") == "not_issued")]
    _drop_guard(data, "not_issued")


def _view_without_no_gap(spec: MachineSpec) -> MachineSpec:
    data = spec_to_dict(spec)
    for move in data["transitions"]:
        if move["trigger"] == "view":
            move["conditions"] = [g for g in move["conditions"] if g != "no_gap"]
    return parse_spec(data, origin=f"{spec.origin} (view without no_gap)")


def _resume_as_extend(data: dict[str, Any]) -> None:
    steps = _op(data, "request_event")["segments"][0]["steps"][0]["else"][0]["else"]
    first_of = steps[1]["then"][0]["first_of"]
    first_of.insert(0, first_of.pop(first_of.index(["request.extend"])))


def _commit_without_filter(data: dict[str, Any]) -> None:
    steps = _op(data, "commit_output")["segments"][0]["steps"]
    steps.remove({"do": "filter_retired"})
    _drop_effect(data, "filter_retired")
    data["orderings"] = [o for o in data["orderings"] if o["operation"] != "commit_output"]


def _older_owner_events_apply(data: dict[str, Any]) -> None:
    seg = _op(data, "request_event")["segments"][0]
    seg["steps"] = seg["steps"][0]["else"]  # no ignored_event check: every event moves the tenure
    _drop_effect(data, "ignore_event")


def _discard_acks(data: dict[str, Any]) -> None:
    _op(data, "discard")["segments"][0]["steps"].append("delivery.ack?")


def _view_advances(spec: MachineSpec) -> MachineSpec:
    data = spec_to_dict(spec)
    for move in data["transitions"]:
        if move["trigger"] == "view":
            move["after"] = [*move["after"], "advance_watermark"]
    return parse_spec(data, origin=f"{spec.origin} (view acknowledges)")


def _view_without_clip(data: dict[str, Any]) -> None:
    steps = _op(data, "delivery_view")["segments"][0]["steps"]
    gap = next(step for step in steps if isinstance(step, dict) and step.get("when") == "gap")
    gap["else"].remove({"do": "clip_outputs"})
    _drop_effect(data, "clip_outputs")


def _commit_without_ack(data: dict[str, Any]) -> None:
    _op(data, "commit_output")["segments"][0]["steps"].remove({"do": "ack_live"})
    _drop_effect(data, "ack_live")
    data["orderings"] = [o for o in data["orderings"] if o["operation"] != "commit_output"]


def _never_lingers(data: dict[str, Any]) -> None:
    data["operations"] = [o for o in data["operations"] if o["name"] != "linger"]


def _materialize_keeps_drafts(data: dict[str, Any]) -> None:
    _op(data, "materialize")["segments"][1]["steps"].remove({"do": "cut_rejected"})
    _drop_effect(data, "cut_rejected")
    data["orderings"] = [o for o in data["orderings"] if "cut_rejected" not in o["order"]]


def _draft_slots_kept(data: dict[str, Any]) -> None:
    _op(data, "materialize")["segments"][0]["steps"].remove("slot.reject?")
    for o in data["orderings"]:
        if o["operation"] == "materialize":
            o["order"] = [x for x in o["order"] if x != "slot.reject?"]


def _reject_preserves(spec: MachineSpec) -> MachineSpec:
    move = {
        "trigger": "reject",
        "source": "COMMITTED",
        "dest": "REJECTED",
        "conditions": ["written_by_step"],
        "after": ["preserve_pending_reads", "bump_version"],
        "meaning": "mutant: a read planned on the rejected row keeps a copy of it",
    }
    return with_move(without_move(spec, "reject", "COMMITTED"), move)


BROKEN: dict[str, Mutation] = {
    "committer-never-lingers": Mutation(
        "without operation linger the committer wakes only when kicked: writes a save queued after the last "
        "kick wait for a next new_step that an idle engine never makes",
        "idle_writes_land",
        _never_lingers,
    ),
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
    # The request lifecycle and delivery (the lifecycle model's world).
    "view-without-gap-check": Mutation(
        "delivery_view selects and clips with no gap check (and the delivery machine's view loses no_gap): "
        "a consumer behind a discarded step is handed positions past a hole",
        "gap_raises",
        _view_without_gap_check,
        {"delivery": _view_without_no_gap},
        model="lifecycle",
    ),
    "resume-without-lookup": Mutation(
        "request_lifecycle's resume installs no lookup: a resumed request is not recovered from the lowest "
        "watermark, so a consumer behind a preemption or a discarded step loses positions",
        "resumed_hit_recovers",
        machines={"request_lifecycle": _without_effect("install_lookup")},
        model="lifecycle",
    ),
    "resume-taken-as-extend": Mutation(
        "request_event tries extend before resume: a RESUMED event is ordinary progress and installs no lookup",
        "resumed_hit_recovers",
        _resume_as_extend,
        model="lifecycle",
    ),
    "commit-without-filter": Mutation(
        "commit_output hands off without filter_retired: a retired tenure's output reaches the consumer "
        "beside the id's new owner",
        "old_owner_never_moves_current",
        _commit_without_filter,
        model="lifecycle",
    ),
    "older-owner-events-apply": Mutation(
        "request_event without the ignored_event check: a late event of an older owner retires or "
        "finishes the id's current tenure",
        "old_owner_never_moves_current",
        _older_owner_events_apply,
        model="lifecycle",
    ),
    "discard-acks": Mutation(
        "discard acknowledges its step's positions (delivery.ack? in discard): discarded rows count as delivered",
        "discard_is_not_delivery",
        _discard_acks,
        model="lifecycle",
    ),
    "view-acknowledges": Mutation(
        "the delivery machine's view advances the watermark: a view never acknowledged counts as delivered",
        "discard_is_not_delivery",
        machines={"delivery": _view_advances},
        model="lifecycle",
    ),
    "view-without-clip": Mutation(
        "delivery_view without clip_outputs: a view hands a consumer its output whole, past a retired "
        "tenure's gap (the shortest trace) or over positions it already received",
        "gap_raises",
        _view_without_clip,
        model="lifecycle",
    ),
    "view-past-saved": Mutation(
        "delivery_view without its outside_saved refusal (and the delivery machine's view without within_saved): "
        "a view of an output the caller edited to reach further is issued, and its acknowledgement moves the "
        "watermark past what the tenure saved",
        "delivered_within_saved",
        _view_past_saved,
        {"delivery": _without_condition("view", "within_saved")},
        model="lifecycle",
    ),
    "ack-unissued-view": Mutation(
        "ack_delivery and commit_output without their not_issued refusal (and the delivery machine's ack without "
        "issued_view): a view acknowledged once is acknowledged again (the shortest trace), and an edited one to "
        "where it claims, past the rows the consumer holds",
        "at_most_once_in_order",
        _ack_unissued_view,
        {"delivery": _without_condition("ack", "issued_view")},
        model="lifecycle",
    ),
    "ack-keeps-view": Mutation(
        "the delivery machine's ack without spend_view: a view acknowledged once stays as issued, and acknowledging "
        "it again hands the consumer the same positions twice",
        "at_most_once_in_order",
        machines={"delivery": _without_effect("spend_view")},
        model="lifecycle",
    ),
    "materialize-keeps-drafts": Mutation(
        "materialize without cut_rejected: a step's output keeps the rows of the speculative drafts it rejected",
        "accepted_rows_only",
        _materialize_keeps_drafts,
        model="lifecycle",
    ),
    "draft-slots-kept": Mutation(
        "materialize without slot.reject? (discard keeps it): a rejected draft's row stays COMMITTED, and a hit "
        "planned on it is served",
        "slot_occupancy.rejected_never_served",
        _draft_slots_kept,
    ),
    "reject-preserves-reads": Mutation(
        "slot_occupancy's reject from COMMITTED preserves pending reads: a read planned on the rejected row "
        "keeps a copy of it and is served",
        "slot_occupancy.rejected_never_served",
        machines={"slot_occupancy": _reject_preserves},
    ),
    "commit-without-ack": Mutation(
        "commit_output hands off and never acknowledges: the next view delivers the same positions again",
        "at_most_once_in_order",
        _commit_without_ack,
        model="lifecycle",
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
