"""Replay a trace against the specs (docs/trace.md, "What validate checks").

One pass over the records, in file order (the order the process appended
them; a segment's begin and end are appended under its lock):

- ``move_legal``: every move starts from the state the replay holds for its
  instance (a machine's initial state when first seen), its machine has
  that trigger there, and it lands where the spec says; a row move (slot
  occupancy) the same for every row it names.
- ``segment_lock``: a segment ran under the lock the spec gives it.
- ``segment_order``: an operation's segments run in the spec's order for
  each instance (a run may start late: the pool writer runs a batch's
  pool-write segment itself; a run may stop early: an item that failed).
- ``segment_steps`` / ``step_order``: every move and effect recorded inside
  a segment is one of that segment's steps, per instance in step order.
- ``lock_exclusion``: two threads never run segments under the same lock
  (``task``: the same task's lock) at once.
- each ordering rule of the composition, per operation instance;
- the system invariants of ``rules.Invariants`` that a trace can judge.

The first violation stops the replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_prefix_cache.tools.trace_check.reader import TraceFile
from omni_prefix_cache.tools.trace_check.rules import Invariants, Stop, Violation, inst_key
from omni_prefix_cache.tools.trace_check.specview import Item, SpecView

# Locks two threads may not hold at once (``none`` excludes nothing; a
# ``task`` segment excludes other segments of its own tasks).
_TASK_LOCK = "task"
_NO_LOCK = "none"


@dataclass
class _Open:
    """A segment execution between its begin and end records."""

    op: str
    seg: int
    lock: str
    thread: str
    ids: list[Any]
    cursor: dict[Any, int] = field(default_factory=dict)


@dataclass
class Result:
    """What a replay found."""

    records: int = 0
    moves: int = 0
    rows: int = 0
    segments: int = 0
    instances: dict[str, int] = field(default_factory=dict)
    violation: Violation | None = None
    lost_at: int | None = None  # index of a ``lost`` record: validated up to there
    torn: bool = False
    closed: bool = False
    judged: tuple[str, ...] = ()
    not_judged: tuple[str, ...] = ()
    seconds: float = 0.0


def _key(iid: Any) -> Any:
    return tuple(_key(x) for x in iid) if isinstance(iid, list) else iid


class Replay:
    """Replays one trace; ``run`` returns its ``Result``."""

    def __init__(self, view: SpecView | None = None) -> None:
        self.view = view or SpecView()
        self.state: dict[tuple[str, Any], int] = {}
        self.names = {name: tuple(s.name for s in m.State) for name, m in self.view.machines.items()}
        self.slots: dict[str, np.ndarray] = {}
        self.num_slots = 0
        self.open: dict[int, _Open] = {}
        self.held: dict[tuple[str, Any], dict[str, int]] = {}
        self.last_seg: dict[tuple[str, Any], int] = {}
        self.run_no: dict[tuple[str, Any], int] = {}
        self.order_seen: dict[tuple[Any, ...], dict[int, int]] = {}
        self.invariants = Invariants(self)
        # (operation, item) -> the ordering rules naming it: (rule number, rule, place in its order).
        self._rules: dict[tuple[str, Item], list[tuple[int, Any, int]]] = {}
        for n, rule in enumerate(self.view.orderings):
            for k, item in enumerate(rule.items):
                self._rules.setdefault((rule.operation, item), []).append((n, rule, k))
        self.index = 0
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "mv": self._move,
            "rows": self._rows,
            "seg": self._begin,
            "end": self._end,
            "fx": self._effect,
            "wait": self._wait,
            "call": self.invariants.on_call,
            "ret": self.invariants.on_ret,
            "close": self.invariants.on_close,
        }

    # -------------------------------------------------------- driver

    def run(self, trace: TraceFile) -> Result:
        start = time.perf_counter()
        res = Result(torn=trace.torn, closed=trace.closed)
        config = trace.header.get("config") or {}
        self.num_slots = int(config.get("num_blocks", 0)) * int(config.get("block_size", 0))
        handlers = self._handlers
        records = trace.records
        try:
            for i, rec in enumerate(records):
                self.index = i
                kind = rec["k"]
                if rec.get("i", i + 1) != i + 1:
                    raise self.fail(
                        "record_sequence",
                        f"record {i + 1} of the file is numbered {rec.get('i')}: records were dropped, "
                        "reordered or edited (every record carries its place, i)",
                    )
                if kind == "lost":
                    res.lost_at = i
                    break
                handler = handlers.get(kind)
                if handler is not None:
                    handler(rec)
        except Stop as stop:
            res.violation = stop.violation
        res.records = self.index + 1 if records else 0
        res.moves = self.invariants.moves
        res.rows = self.invariants.row_moves
        res.segments = self.invariants.segments
        counts: dict[str, int] = {}
        for machine, _ in self.state:
            counts[machine] = counts.get(machine, 0) + 1
        res.instances = dict(sorted(counts.items()))
        res.judged, res.not_judged = self.invariants.coverage()
        res.seconds = time.perf_counter() - start
        return res

    def fail(self, rule: str, message: str, about: list[tuple[str, Any]] | None = None) -> Stop:
        return Stop(Violation(rule, message, self.index, about or []))

    # -------------------------------------------------------- moves

    def _move(self, rec: dict[str, Any]) -> None:
        name = rec["m"]
        machine = self.view.machines.get(name)
        iid = _key(rec["id"])
        about = [(name, iid)]
        if machine is None:
            raise self.fail("move_legal", f"machine {name!r} is not in spec/ ({sorted(self.view.machines)})", about)
        names = self.names[name]
        cur = self.state.get((name, iid), int(machine.initial))
        trigger = rec["tr"]
        if rec["s"] != names[cur]:
            raise self.fail(
                "move_legal",
                f"{name} {rec['id']}: {trigger} recorded from {rec['s']}, but the replay holds {names[cur]}",
                about,
            )
        move = machine.move(cur, trigger)
        if move is None:
            raise self.fail("move_legal", f"{name} {rec['id']}: spec {name} has no {trigger} from {rec['s']}", about)
        if move.dest.name != rec["d"]:
            raise self.fail(
                "move_legal",
                f"{name} {rec['id']}: {trigger} from {rec['s']} goes to {move.dest.name} in the spec, "
                f"the trace says {rec['d']}",
                about,
            )
        self.state[(name, iid)] = int(move.dest)
        self._in_segment(rec, ("mv", name, trigger), [iid], about)
        self.invariants.on_move(rec, name, iid, cur, int(move.dest), move)

    def _rows(self, rec: dict[str, Any]) -> None:
        name = rec["m"]
        machine = self.view.machines.get(name)
        about = [(name, rec.get("key"))]
        if machine is None:
            raise self.fail("move_legal", f"machine {name!r} is not in spec/", about)
        src, trigger = int(machine.State[rec["s"]]), rec["tr"]
        move = machine.move(src, trigger)
        if move is None or move.dest.name != rec["d"]:
            raise self.fail(
                "move_legal",
                f"{name} key {rec.get('key')!r}: spec {name} has no {trigger} {rec['s']} -> {rec['d']}",
                about,
            )
        ranges = rec.get("slots")
        if ranges is not None:
            arr = self._slot_array(str(rec.get("key")), max(s + n for s, n in ranges) if ranges else 0, machine)
            idx = np.concatenate([np.arange(s, s + n) for s, n in ranges]) if ranges else np.zeros(0, np.int64)
            cur = arr[idx]
            bad = idx[cur != src]
            if bad.size:
                got = machine.State(int(arr[bad[0]])).name
                raise self.fail(
                    "move_legal",
                    f"{name} key {rec.get('key')!r}: {trigger} recorded from {rec['s']} on slots "
                    f"{bad[:8].tolist()}, but the replay holds {got} there",
                    about,
                )
            arr[idx] = int(move.dest)
        self._in_segment(rec, ("mv", name, trigger), [], about)
        self.invariants.on_rows(rec, move)

    def _slot_array(self, key: str, need: int, machine: Any) -> np.ndarray:
        arr = self.slots.get(key)
        if arr is None or arr.size < need:
            size = max(need, self.num_slots, 0 if arr is None else arr.size * 2)
            grown = np.full(size, int(machine.initial), dtype=np.int8)
            if arr is not None:
                grown[: arr.size] = arr
            arr = self.slots[key] = grown
        return arr

    # -------------------------------------------------------- segments

    def _begin(self, rec: dict[str, Any]) -> None:
        op, seg, lock, thread = rec["op"], rec["seg"], rec["lock"], rec["th"]
        segs = self.view.segments.get(op)
        ids = [_key(i) for i in rec["ids"]] if isinstance(rec["ids"], list) else [_key(rec["ids"])]
        insts = [k for k in (inst_key(i, self.view.for_each.get(op)) for i in ids) if k is not None]
        about = [(self.view.for_each.get(op) or op, k) for k in insts]
        if segs is None or not 0 <= seg < len(segs):
            raise self.fail("segment_order", f"operation {op!r} has no segment {seg} in the composition", about)
        if segs[seg].lock != lock:
            raise self.fail(
                "segment_lock", f"{op} segment {seg} ran under lock {lock!r}; the spec says {segs[seg].lock!r}", about
            )
        self.invariants.segments += 1
        for k in insts:
            prev = self.last_seg.get((op, k))
            if prev is None or seg <= prev:
                self.run_no[(op, k)] = self.run_no.get((op, k), 0) + 1
            elif seg != prev + 1 and any(s.items for s in segs[prev + 1 : seg]):
                raise self.fail(
                    "segment_order",
                    f"{op} for {k}: segment {seg} [{lock}] ran after segment {prev}, "
                    f"skipping {[f'{i} [{s.lock}]' for i, s in enumerate(segs) if prev < i < seg]}",
                    about,
                )
            self.last_seg[(op, k)] = seg
        if lock != _NO_LOCK:
            for holder in [(lock, None)] if lock != _TASK_LOCK else [(lock, k) for k in insts]:
                others = [t for t, n in self.held.get(holder, {}).items() if n and t != thread]
                if others:
                    raise self.fail(
                        "lock_exclusion",
                        f"{op} segment {seg} took lock {lock}{'' if holder[1] is None else ' of ' + str(holder[1])} "
                        f"on {thread} while {others[0]} held it",
                        about,
                    )
                counts = self.held.setdefault(holder, {})
                counts[thread] = counts.get(thread, 0) + 1
        self.open[rec["run"]] = _Open(op, seg, lock, thread, insts)

    def _end(self, rec: dict[str, Any]) -> None:
        seg = self.open.pop(rec["run"], None)
        if seg is None:
            return
        if seg.lock != _NO_LOCK:
            for holder in [(seg.lock, None)] if seg.lock != _TASK_LOCK else [(seg.lock, k) for k in seg.ids]:
                counts = self.held.get(holder)
                if counts and counts.get(seg.thread):
                    counts[seg.thread] -= 1
        self.invariants.on_segment_end(rec, seg.op, seg.ids, seg.thread)

    def open_elsewhere(self, inst: Any, thread: str) -> bool:
        """True if another thread is inside a segment that moves ``inst``."""
        return any(o.thread != thread and inst in o.ids for o in self.open.values())

    def _in_segment(self, rec: dict[str, Any], item: Item, iids: list[Any], about: list[tuple[str, Any]]) -> None:
        """Step membership and order inside the recording segment, then the
        ordering rules of its operation."""
        op = rec.get("op")
        if op is None:
            return
        run = rec.get("run")
        for_each = self.view.for_each.get(op)
        insts = [inst_key(i, for_each) for i in iids] if iids else [None]
        # The named ordering rules first: where one covers a step order it names it.
        self._orderings(rec, op, item, insts, about)
        if run is not None:
            opened = self.open.get(run)
            if opened is not None:
                view = self.view.segments[op][opened.seg]
                where = view.positions.get(item)
                if where is None:
                    raise self.fail(
                        "segment_steps",
                        f"{self.view.describe_item(item)} ran inside {op} segment {opened.seg} [{view.lock}], "
                        f"whose steps are {[self.view.describe_item(i) for i in view.items]}",
                        about,
                    )
                for k in insts:
                    at = opened.cursor.get(k, 0)
                    nxt = next((p for p in where if p >= at), None)
                    if nxt is None:
                        raise self.fail(
                            "step_order",
                            f"{self.view.describe_item(item)} ran in {op} segment {opened.seg} for {k} after "
                            f"{self.view.describe_item(view.items[at - 1])}; the spec orders it before",
                            about,
                        )
                    opened.cursor[k] = nxt + 1

    def _orderings(self, rec: dict[str, Any], op: str, item: Item, insts: list[Any], about: list[Any]) -> None:
        for n, rule, k in self._rules.get((op, item), ()):
            for inst in insts:
                if self.view.for_each.get(op) is not None:
                    if inst is None:
                        continue
                    group: tuple[Any, ...] = (n, inst, self.run_no.get((op, inst), 0))
                else:
                    group = (n, rec.get("call"))
                seen = self.order_seen.setdefault(group, {})
                later = [j for j in seen if j > k]
                if later:
                    raise self.fail(
                        rule.name,
                        f"{op}{'' if inst is None else ' for ' + str(inst)}: "
                        f"{self.view.describe_item(item)} came after {self.view.describe_item(rule.items[max(later)])} "
                        f"({rule.meaning})",
                        about,
                    )
                seen.setdefault(k, self.index)

    # -------------------------------------------------------- effects, waits

    def _effect(self, rec: dict[str, Any]) -> None:
        ids = rec.get("ids")
        iids = [_key(i) for i in ids] if isinstance(ids, list) else ([] if ids is None else [_key(ids)])
        for_each = self.view.for_each.get(rec.get("op", ""))
        about = [(for_each or "op", inst_key(i, for_each)) for i in iids]
        self._in_segment(rec, ("fx", rec["name"]), iids, about)
        self.invariants.on_effect(rec, iids)

    def _wait(self, rec: dict[str, Any]) -> None:
        op = rec.get("op")
        if op is not None and self.view.for_each.get(op) is None:
            self._orderings(rec, op, ("wait", rec["name"]), [None], [])
