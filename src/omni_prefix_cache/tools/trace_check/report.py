"""The validator's report: the rule broken, the records around the
violation, and the shortest excerpt that shows it (the records of the
instances it involves, up to it)."""

from __future__ import annotations

import json
from typing import Any

from omni_prefix_cache.tools.trace_check.reader import TraceFile
from omni_prefix_cache.tools.trace_check.replay import Result
from omni_prefix_cache.tools.trace_check.rules import Violation
from omni_prefix_cache.tools.trace_check.specview import SpecView

AROUND = 4  # records shown before and after the violation
EXCERPT = 16  # most records of the excerpt


def _ids(rec: dict[str, Any]) -> list[Any]:
    ids = rec.get("ids")
    return ids if isinstance(ids, list) else [] if ids is None else [ids]


def _instance_machines() -> tuple[frozenset[str], frozenset[str]]:
    """Machines whose instances are named by the instance of a ``for_each``
    operation (a task names its task, its queue position, its holder), and
    the ``for_each`` roles."""
    view = SpecView()
    roles = frozenset(r for r in view.for_each.values() if r)
    return frozenset(m for op, moves in view.op_moves.items() if view.for_each.get(op) for m, _ in moves), roles


def _touches(rec: dict[str, Any], about: list[tuple[str, Any]], linked: tuple[frozenset[str], frozenset[str]]) -> bool:
    machines, roles = linked
    rid = rec.get("id")
    rid = tuple(rid) if isinstance(rid, list) else rid
    for what, iid in about:
        if what == "call":
            if rec.get("call") == iid:
                return True
            continue
        if rec.get("m") == what and (rid == iid or rec.get("key") == iid):
            return True
        # The same instance under the other roles of its operation.
        key = iid[1] if isinstance(iid, tuple) and len(iid) == 2 else iid
        owner = rid[1] if isinstance(rid, tuple) and len(rid) == 2 and rid[0] in roles else rid
        if (what in machines or what in roles) and rec.get("m") in machines and owner == key:
            return True
        if key in _ids(rec) and rec["k"] in ("seg", "end", "fx", "wait"):
            return True
    return False


def describe(rec: dict[str, Any]) -> str:
    """One record on one line: index, thread, context, then what it says."""
    kind = rec["k"]
    where = rec.get("op", "")
    if "seg" in rec and rec.get("run"):
        where += f"[{rec['seg']}]"
    head = f"#{rec.get('i', '?'):<6} {rec.get('th', ''):<28} {where:<20}"
    if kind == "mv":
        body = f"{rec['m']} {json.dumps(rec['id'])}: {rec['tr']} {rec['s']} -> {rec['d']}"
        if "x" in rec:
            body += f" ({rec['x']})"
    elif kind == "rows":
        body = f"{rec['m']} key {rec.get('key')!r} x{rec.get('n')}: {rec['tr']} {rec['s']} -> {rec['d']}"
    elif kind == "seg":
        body = f"begin [{rec['lock']}] for {json.dumps(rec['ids'])}"
    elif kind == "end":
        body = f"end for {json.dumps(rec['ids'])}"
    elif kind in ("fx", "wait"):
        body = f"{'effect' if kind == 'fx' else 'wait'} {rec['name']} for {json.dumps(rec.get('ids'))}"
    elif kind == "call":
        body = f"call {rec['f']}"
    elif kind == "ret":
        body = f"return {rec['f']}" + (f" raised {rec['err'][0]}: {rec['err'][1]}" if rec.get("err") else "")
    else:
        body = json.dumps(rec)
    return f"{head} {body}"


def excerpt(trace: TraceFile, violation: Violation) -> list[dict[str, Any]]:
    """The records (up to the violating one) of the instances it involves."""
    upto = trace.records[: violation.index + 1]
    linked = _instance_machines()
    out = [r for r in upto if _touches(r, violation.about, linked)]
    if not out or out[-1] is not upto[-1]:
        out.append(upto[-1])
    return out[-EXCERPT:]


def format_violation(trace: TraceFile, violation: Violation) -> str:
    i = violation.index
    rec = trace.records[i]
    lines = [
        f"{trace.path}: rule {violation.rule} broken at record #{rec.get('i', i)} (line {i + 2})",
        f"  {violation.message}",
        "",
        "records around it:",
    ]
    for j in range(max(0, i - AROUND), min(len(trace.records), i + AROUND + 1)):
        mark = ">" if j == i else " "
        lines.append(f" {mark} {describe(trace.records[j])}")
    lines += ["", "shortest excerpt (the records of what it involves, up to it):"]
    lines += [f"   {describe(r)}" for r in excerpt(trace, violation)]
    return "\n".join(lines)


def summary(trace: TraceFile, res: Result) -> dict[str, Any]:
    """The machine-readable result (``validate --json``)."""
    out: dict[str, Any] = {
        "trace": trace.path,
        "ok": res.violation is None and res.lost_at is None,
        "records": res.records,
        "moves": res.moves,
        "row_moves": res.rows,
        "segments": res.segments,
        "instances": res.instances,
        "torn_last_line": res.torn,
        "closed": res.closed,
        "lost_at": res.lost_at,
        "judged_invariants": list(res.judged),
        "not_judged_invariants": list(res.not_judged),
        "seconds": round(res.seconds, 4),
    }
    v = res.violation
    if v is not None:
        out["violation"] = {
            "rule": v.rule,
            "message": v.message,
            "record": trace.records[v.index].get("i", v.index),
            "excerpt": [describe(r) for r in excerpt(trace, v)],
        }
    return out
