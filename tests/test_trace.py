"""The opt-in trace (docs/trace.md): recording, and ``validate`` rejecting a
hand-edited trace with the rule it breaks (one test per checked rule).

Each edit starts from a clean trace recorded by the simulation, changes one
thing, renumbers the records (else ``record_sequence`` would catch every
edit first) and expects the named rule.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.tools import cli
from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig, run_simulation
from omni_prefix_cache.tools.trace_check import TraceFile, parse_lines, read_trace, validate_trace
from omni_prefix_cache.tools.trace_check.report import format_violation
from omni_prefix_cache.writes.write_task import WRITE_TASK_MACHINE

Records = list[dict[str, Any]]


def _record(tmp: Path, name: str, **kw: Any) -> TraceFile:
    path = tmp / f"{name}.jsonl"
    cfg = SimConfig(steps=160, workload=WorkloadConfig(arrival_steps=60), trace_path=str(path), **kw)
    res = run_simulation(cfg)
    assert res.error is None and not res.mismatches
    return read_trace(path)


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> TraceFile:
    """A threaded run without lag: the committer races the engine thread."""
    return _record(tmp_path_factory.mktemp("trace"), "threaded", eager=False, lag=False)


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> TraceFile:
    return _record(tmp_path_factory.mktemp("trace"), "eager", eager=True)


def _edited(trace: TraceFile, edit: Callable[[Records], None], *, renumber: bool = True) -> TraceFile:
    records = copy.deepcopy(trace.records)
    edit(records)
    if renumber:
        for i, rec in enumerate(records, start=1):
            rec["i"] = i
    return TraceFile(trace.path, trace.header, records, closed=trace.closed)


def _rule(trace: TraceFile) -> str:
    res = validate_trace(trace)
    assert res.violation is not None, "the edited trace validated"
    format_violation(trace, res.violation)  # the report renders for every rule
    return res.violation.rule


def _find(records: Records, pred: Callable[[dict[str, Any]], bool], start: int = 0) -> int:
    return next(i for i in range(start, len(records)) if pred(records[i]))


def _is(rec: dict[str, Any], kind: str, **fields: Any) -> bool:
    return rec["k"] == kind and all(rec.get(k) == v for k, v in fields.items())


# ------------------------------------------------------------ recording


def test_clean_traces_validate(threaded: TraceFile, eager: TraceFile) -> None:
    for trace in (threaded, eager):
        res = validate_trace(trace)
        assert res.violation is None, format_violation(trace, res.violation)
        assert trace.closed and res.lost_at is None
        assert res.moves > 1000 and res.segments > 100
        assert {"write_task", "copy_queue", "staging_holder", "step_context"} <= set(res.instances)
    threads = {r.get("th", "") for r in threaded.records}
    assert any(t.startswith("omni-prefix-cache-committer") for t in threads)


def test_trace_off_leaves_no_recorder(tmp_path: Path) -> None:
    """A traced manager's shutdown closes its trace and puts the machines'
    recorders back (None with metrics off): the off path pays nothing."""
    was = TELEMETRY.enabled
    TELEMETRY.disable()
    try:
        _record(tmp_path, "once", eager=True)
        assert TELEMETRY.trace is None
        assert WRITE_TASK_MACHINE.recorder is None
    finally:
        TELEMETRY.set_enabled(was)


def test_facade_calls_record_shapes_not_tensors(eager: TraceFile) -> None:
    saves = [r for r in eager.records if _is(r, "call", f="save_outputs")]
    assert saves
    hidden = saves[0]["args"]["0"]
    assert set(hidden) == {"shape", "dtype"} and len(hidden["shape"]) == 2


def test_killed_process_trace_reads_up_to_its_last_flush(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    script = textwrap.dedent(
        f"""
        import sys
        from omni_prefix_cache.telemetry.registry import TELEMETRY
        from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig, run_simulation

        def progress(step, *args):
            if step >= 20 and TELEMETRY.trace is not None and not progress.told:
                TELEMETRY.trace.flush()
                progress.told = True
                print("flushed", flush=True)
                sys.stdin.readline()  # the parent kills us here
        progress.told = False
        run_simulation(SimConfig(steps=100000, eager=True, trace_path={str(path)!r}), progress=progress)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"flushed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    trace = read_trace(path)
    res = validate_trace(trace)
    assert res.violation is None and not trace.closed and res.moves > 0
    # A write cut mid-line (the kill's other outcome) is skipped, not an error.
    lines = path.read_text().splitlines()
    torn = parse_lines([*lines, lines[-1][: len(lines[-1]) // 2]])
    assert torn.torn and len(torn.records) == len(trace.records)


# ------------------------------------------------------------ one rule each


def test_swapped_move_breaks_move_legal(threaded: TraceFile) -> None:
    def swap(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "mv", m="write_task", tr="enqueue"))
        tid = records[i]["id"]
        j = _find(records, lambda r: _is(r, "mv", m="write_task", id=tid, tr="claim_copy"))
        records[i], records[j] = records[j], records[i]

    assert _rule(_edited(threaded, swap)) == "move_legal"


def test_dropped_move_breaks_move_legal(threaded: TraceFile) -> None:
    def drop(records: Records) -> None:
        del records[_find(records, lambda r: _is(r, "mv", m="copy_queue", tr="push"))]

    assert _rule(_edited(threaded, drop)) == "move_legal"


def test_dropped_record_without_renumbering_breaks_record_sequence(threaded: TraceFile) -> None:
    def drop(records: Records) -> None:
        del records[len(records) // 2]

    assert _rule(_edited(threaded, drop, renumber=False)) == "record_sequence"


def test_unknown_machine_breaks_move_legal(threaded: TraceFile) -> None:
    def rename(records: Records) -> None:
        records[_find(records, lambda r: r["k"] == "mv")]["m"] = "no_such_machine"

    assert _rule(_edited(threaded, rename)) == "move_legal"


def test_wrong_lock_breaks_segment_lock(threaded: TraceFile) -> None:
    def relock(records: Records) -> None:
        records[_find(records, lambda r: _is(r, "seg", op="committer_claim"))]["lock"] = "none"

    assert _rule(_edited(threaded, relock)) == "segment_lock"


def test_skipped_segment_breaks_segment_order(eager: TraceFile) -> None:
    """eager_run's copy segment (1) cut out: segment 2 follows segment 0."""

    def skip(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "seg", op="eager_run", seg=1))
        j = _find(records, lambda r: _is(r, "end", run=records[i]["run"]), i)
        del records[i : j + 1]

    assert _rule(_edited(eager, skip)) == "segment_order"


def test_move_in_another_segment_breaks_segment_steps(threaded: TraceFile) -> None:
    """committer_write's task.written moved into its controller segment."""

    def move(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "mv", m="write_task", tr="written", op="committer_write"))
        rec = records.pop(i)
        begin = max(j for j in range(i) if _is(records[j], "seg", op="committer_write", seg=1))
        end = _find(records, lambda r: _is(r, "end", run=records[begin]["run"]), begin)
        rec["run"], rec["seg"] = records[begin]["run"], 1
        records.insert(end, rec)

    assert _rule(_edited(threaded, move)) == "segment_steps"


def test_steps_out_of_order_break_step_order(threaded: TraceFile) -> None:
    """committer_copy's copy segment: unpin_budget before task.host_ready."""

    def swap(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "mv", m="write_task", tr="host_ready", op="committer_copy"))
        j = _find(records, lambda r: _is(r, "fx", name="unpin_budget", run=records[i]["run"]), i)
        records.insert(i, records.pop(j))

    assert _rule(_edited(threaded, swap)) == "step_order"


def test_concurrent_segments_break_lock_exclusion(threaded: TraceFile) -> None:
    def overlap(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "seg", lock="controller", th=records[0]["th"]))
        other = next(r for r in records if _is(r, "seg", lock="controller") and r["th"] != records[i]["th"])
        records.insert(i + 1, {**other, "run": 10**9})

    assert _rule(_edited(threaded, overlap)) == "lock_exclusion"


def test_publish_before_release_breaks_release_publish_done(threaded: TraceFile) -> None:
    def swap(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "mv", m="staging_holder", tr="written", op="committer_write"))
        j = _find(records, lambda r: _is(r, "fx", name="publish_completed", run=records[i]["run"]), i)
        records.insert(i, records.pop(j))

    assert _rule(_edited(threaded, swap)) == "release_publish_done"


def test_claim_before_pop_breaks_claim_under_escalate_lock(threaded: TraceFile) -> None:
    def swap(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "mv", m="copy_queue", tr="claim", op="committer_claim"))
        j = _find(records, lambda r: _is(r, "mv", m="write_task", tr="claim_copy", run=records[i]["run"]), i)
        records.insert(i, records.pop(j))

    assert _rule(_edited(threaded, swap)) == "claim_under_escalate_lock"


def test_wait_after_save_breaks_save_barrier(threaded: TraceFile) -> None:
    def late(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "wait", op="save", name="done"))
        j = _find(records, lambda r: _is(r, "mv", m="step_context", tr="save", call=records[i]["call"]), i)
        records.insert(j, records.pop(i))

    assert _rule(_edited(threaded, late)) == "save_barrier"


def test_save_before_previous_writes_breaks_save_waits_previous_writes(threaded: TraceFile) -> None:
    """A save's step.save moved to just after the previous save bound the
    holder of a write this save waited for: that write is not done there."""

    def early(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "wait", op="save", name="done") and bool(r["ids"]))
        waited = records[i]["ids"]
        bind = _find(records, lambda r: _is(r, "mv", m="staging_holder", tr="bind", id=["task", waited[-1]]))
        j = _find(records, lambda r: _is(r, "mv", m="step_context", tr="save", call=records[i]["call"]), i)
        records.insert(bind + 1, records.pop(j))

    assert _rule(_edited(threaded, early)) == "save_waits_previous_writes"


def test_unlisted_pair_breaks_position_matches_task(eager: TraceFile) -> None:
    def drop(records: Records) -> None:
        del records[_find(records, lambda r: _is(r, "mv", m="copy_queue", tr="inline"))]

    assert _rule(_edited(eager, drop)) == "position_matches_task"


def test_done_before_record_breaks_done_after_record(threaded: TraceFile) -> None:
    def drop(records: Records) -> None:
        del records[_find(records, lambda r: _is(r, "fx", name="publish_completed"))]

    assert _rule(_edited(threaded, drop)) == "done_after_record"


def test_bind_to_free_page_breaks_task_views_step_page(threaded: TraceFile) -> None:
    def rebind(records: Records) -> None:
        records[_find(records, lambda r: _is(r, "mv", m="staging_holder", tr="bind"))]["x"] = 999

    assert _rule(_edited(threaded, rebind)) == "task_views_step_page"


def test_call_after_failure_returning_breaks_failure_is_sticky(threaded: TraceFile) -> None:
    def fail_one(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "ret", f="save_outputs"))
        records[i]["err"] = ["OmniPrefixCacheWriteFailedError", "write failed (edited)"]

    assert _rule(_edited(threaded, fail_one)) == "failure_is_sticky"


def test_deferred_push_high_breaks_queue_by_priority(threaded: TraceFile) -> None:
    def low(records: Records) -> None:
        rec = records[_find(records, lambda r: _is(r, "mv", m="copy_queue", tr="push"))]
        rec["tr"], rec["d"] = "push_low", "LOW"

    assert _rule(_edited(threaded, low)) == "queue_by_priority"


def test_task_left_open_breaks_settled_at_shutdown(threaded: TraceFile) -> None:
    def straggler(records: Records) -> None:
        move = next(r for r in records if _is(r, "mv", m="write_task", tr="enqueue"))
        records.insert(len(records) - 1, {**move, "id": 10**9})

    assert _rule(_edited(threaded, straggler)) == "settled_at_shutdown"


# ------------------------------------------------------------ the command


def test_validate_exit_statuses(threaded: TraceFile, tmp_path: Path) -> None:
    def write(records: Records, name: str) -> Path:
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(r) for r in [threaded.header, *records]) + "\n")
        return path

    assert cli.main(["validate", str(write(threaded.records, "ok.jsonl"))]) == cli.EXIT_OK
    swapped = _edited(threaded, lambda rs: rs.reverse())
    assert cli.main(["validate", str(write(swapped.records, "bad.jsonl"))]) == cli.EXIT_FAILED
    lost = [*threaded.records[:50], {"k": "lost", "i": 51, "n": 7}]
    assert cli.main(["validate", str(write(lost, "lost.jsonl"))]) == cli.EXIT_ERROR
    assert cli.main(["validate", str(write([], "empty.jsonl"))]) == cli.EXIT_NOTHING_CHECKED
    assert cli.main(["validate", str(tmp_path / "missing.jsonl")]) == cli.EXIT_USAGE
    (tmp_path / "junk.jsonl").write_text("not json\n")
    assert cli.main(["validate", str(tmp_path / "junk.jsonl")]) == cli.EXIT_ERROR


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> TraceFile:
    """gpu-check's device-fault scenario (fake lanes): a write fails, the
    failure turns sticky, shutdown fails what is left."""
    from omni_prefix_cache.tools import gpu_check

    check = gpu_check.check_device_fault(gpu_check.fake_backend(0.0))
    assert check.ok, check.numbers
    return read_trace(check.numbers["trace"]["path"])


def test_failed_run_trace_validates(faulted: TraceFile) -> None:
    res = validate_trace(faulted)
    assert res.violation is None, format_violation(faulted, res.violation)
    assert any(_is(r, "fx", name="publish_failed") for r in faulted.records)
    assert any(r.get("err", [""])[0] == "OmniPrefixCacheWriteFailedError" for r in faulted.records)


def test_wake_before_record_breaks_failure_record_before_wakes(faulted: TraceFile) -> None:
    """fail's wake segment moved ahead of its publish_failed."""

    def early(records: Records) -> None:
        i = _find(records, lambda r: _is(r, "fx", name="publish_failed", op="fail"))
        begin = _find(records, lambda r: _is(r, "seg", op="fail", seg=2, ids=records[i]["ids"]), i)
        end = _find(records, lambda r: _is(r, "end", run=records[begin]["run"]), begin)
        block = records[begin : end + 1]
        del records[begin : end + 1]
        records[i:i] = block

    assert _rule(_edited(faulted, early)) == "failure_record_before_wakes"


def test_wake_without_record_breaks_done_after_record(faulted: TraceFile) -> None:
    def drop(records: Records) -> None:
        del records[_find(records, lambda r: _is(r, "fx", name="publish_failed"))]

    assert _rule(_edited(faulted, drop)) == "done_after_record"


def test_full_ring_drops_and_says_so(tmp_path: Path) -> None:
    """A ring that fills drops new records, counts them and writes a lost
    record; validate checks up to it and reports the trace incomplete."""
    from omni_prefix_cache.telemetry.trace import Trace

    path = tmp_path / "small.jsonl"
    trace = Trace(path, capacity=4, interval_s=3600.0)
    try:
        for n in range(10):
            trace.call("register_policy", "", {"n": n}, -1)
    finally:
        trace.close()
    parsed = read_trace(path)
    kinds = [r["k"] for r in parsed.records]
    assert kinds == ["call"] * 4 + ["lost", "close"]
    assert parsed.records[4]["n"] == 6
    assert validate_trace(parsed).lost_at == 4


def test_mutant_column_catches_a_skipped_save_barrier() -> None:
    """``make mutants``' trace column: a recorded run of the mutant that
    skips the save barrier fails validation by the invariant it breaks."""
    from omni_prefix_cache.testing.trace_mutants import trace_verdict

    assert trace_verdict("save_skips_previous_write_barrier").startswith("caught by save_waits_previous_writes")


def test_failing_pool_write_trace_validates(tmp_path: Path) -> None:
    """A simulation whose pool write of one immediate write fails: the
    failure record, the sticky failure and shutdown's fails all conform."""
    from omni_prefix_cache.testing.trace_mutants import failing_manager

    path = tmp_path / "failing.jsonl"
    res = run_simulation(
        SimConfig(steps=160, workload=WorkloadConfig(arrival_steps=80), eager=False, trace_path=str(path)),
        manager_factory=failing_manager,
    )
    assert res.error is not None and "write failed" in res.error
    trace = read_trace(path)
    checked = validate_trace(trace)
    assert checked.violation is None, format_violation(trace, checked.violation)
    assert any(_is(r, "fx", name="publish_failed") for r in trace.records)
    raised = [r for r in trace.records if r["k"] == "ret" and r.get("err")]
    assert raised and raised[0]["err"][0] == "OmniPrefixCacheWriteFailedError"


def test_shutdown_discards_an_open_step_by_the_spec(tmp_path: Path) -> None:
    """A step saved and never consumed: shutdown discards it through the
    step_context machine (found by validate: the holder was released but
    the step stayed SAVED, breaking settled_at_shutdown)."""
    from types import SimpleNamespace

    import torch

    from omni_prefix_cache.interface import PrefixCacheConfig
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.tools.simulate.batch import SimGroupView

    path = tmp_path / "open_step.jsonl"
    view = SimGroupView(4)
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_capacity_tokens=64, trace_path=str(path))
    mgr = OmniPrefixCacheManager(cfg, view, eager=True)
    view.set_step(["a"], {"a": [0, 1, 2]}, {"a": 0})
    req = SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=([0, 1, 2],))
    mgr.new_step_starts(
        SimpleNamespace(scheduled_new_reqs=[req], finished_req_ids=set(), num_scheduled_tokens={"a": 6})
    )
    mgr.save_outputs(torch.zeros(6, 8), {}, num_tokens_unpadded=6, num_tokens_padded=6)
    mgr.shutdown()
    trace = read_trace(path)
    res = validate_trace(trace)
    assert res.violation is None, format_violation(trace, res.violation)
    assert any(_is(r, "mv", m="step_context", tr="discard", op="shutdown") for r in trace.records)


def test_a_new_spec_machine_is_traced_and_replayed_with_no_code(tmp_path: Path) -> None:
    """A machine the trace and the validator never heard of (as the request
    lifecycle's will be): its moves are recorded through its compiled
    machine's recorder and replayed from its spec alone."""
    from omni_prefix_cache.specs import compile_machine, parse_spec
    from omni_prefix_cache.telemetry.trace import Trace
    from omni_prefix_cache.tools.trace_check import Replay
    from omni_prefix_cache.tools.trace_check.specview import SpecView, compiled_machines

    spec = parse_spec(
        {
            "name": "toy_delivery",
            "enum": "ToyState",
            "description": "a position of one consumer",
            "states": [
                {"name": "OPEN", "initial": True, "meaning": "not sent"},
                {"name": "SENT", "meaning": "sent, not acknowledged"},
                {"name": "DONE", "final": True, "meaning": "acknowledged"},
            ],
            "transitions": [
                {"trigger": "send", "source": "OPEN", "dest": "SENT", "meaning": "delivered"},
                {"trigger": "ack", "source": "SENT", "dest": "DONE", "meaning": "acknowledged"},
            ],
        }
    )
    toy = compile_machine(spec)
    path = tmp_path / "toy.jsonl"
    trace = Trace(path)
    TELEMETRY.start_trace(trace)
    try:
        assert toy.recorder is not None
        for trigger in ("send", "ack"):
            move = toy.move(toy.initial if trigger == "send" else toy.State["SENT"], trigger)
            toy.recorder.moved(move, ("owner-1", "talker"))
    finally:
        TELEMETRY.stop_trace(trace)
    view = SpecView(machines={**compiled_machines(), "toy_delivery": toy})
    recorded = read_trace(path)
    assert [r["tr"] for r in recorded.records if r["k"] == "mv"] == ["send", "ack"]
    assert Replay(view).run(recorded).violation is None
    twice = _edited(recorded, lambda rs: rs.insert(1, copy.deepcopy(rs[0])))  # one send repeated
    res = Replay(view).run(twice)
    assert res.violation is not None and res.violation.rule == "move_legal"


def _first_ack(records: Records) -> int:
    return _find(
        records,
        lambda r: _is(r, "mv", m="delivery", tr="ack") and isinstance(r.get("x"), list) and r["x"][1] > r["x"][0],
    )


def test_a_repeated_delivery_breaks_at_most_once_in_order(threaded: TraceFile) -> None:
    def repeat(records: Records) -> None:
        i = _first_ack(records)
        records.insert(i + 1, copy.deepcopy(records[i]))  # the same acknowledgement twice

    assert _rule(_edited(threaded, repeat)) == "at_most_once_in_order"


def test_an_acknowledgement_past_the_watermark_breaks_gap_raises(threaded: TraceFile) -> None:
    def skip(records: Records) -> None:
        i = _first_ack(records)
        start, end = records[i]["x"]
        records[i]["x"] = [start + 1, end + 1]

    assert _rule(_edited(threaded, skip)) == "gap_raises"
