"""Runtime metrics: spec-generated move counts and time in state, the
data-path figures, the switch, and their export (snapshot, Prometheus)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import yaml

from omni_prefix_cache.interface import WriteSchedule
from omni_prefix_cache.specs import compile_machine
from omni_prefix_cache.specs.loader import SpecError, parse_spec, spec_dir
from omni_prefix_cache.telemetry import histogram
from omni_prefix_cache.telemetry.histogram import Histogram
from omni_prefix_cache.telemetry.locks import TimedLock
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.writes.write_task import WRITE_TASK_MACHINE, WriteTask
from test_manager import Req, make, quiesce


class Clock:
    """A nanosecond clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


@pytest.fixture
def clock() -> Iterator[Clock]:
    fake = Clock()
    with TELEMETRY.recording(clock=fake, cpu_clock=fake):
        yield fake


@pytest.fixture
def managers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for mgr in made:
        mgr.shutdown()


def _task() -> WriteTask:
    return WriteTask(tid=1, req_id="r", write_n=0, schedule=WriteSchedule.JOIN_NEXT_STEP, chunks=[])


def _bucket_of(summary: histogram.HistogramSummary, seconds: float) -> float:
    """The upper bound of the first bucket whose cumulative count is non-zero."""
    return next(bound for bound, n in summary.buckets if n)


def test_a_write_held_queued_for_a_known_time_lands_in_its_bucket(clock: Clock) -> None:
    task = _task()
    task.fire("enqueue")
    clock.advance(0.003)  # 3 ms QUEUED: the (2.5 ms, 10 ms] bucket
    task.fire("claim_copy")
    clock.advance(0.0002)  # 200 us COPYING: the (100 us, 250 us] bucket
    task.fire("host_ready")
    stays = TELEMETRY.time_in_state()
    queued, copying = stays[("write_task", "QUEUED")], stays[("write_task", "COPYING")]
    assert (queued.count, queued.sum) == (1, pytest.approx(0.003))
    assert _bucket_of(queued, 0.003) == 1e-2
    assert _bucket_of(copying, 0.0002) == 2.5e-4
    assert stays[("write_task", "HOST_READY")].count == 0  # still there: no stay ended
    counts = TELEMETRY.move_counts()
    assert counts[("write_task", "enqueue", "PENDING", "QUEUED")] == 1
    assert counts[("write_task", "fail", "QUEUED", "FAILED")] == 0
    summary = TELEMETRY.summary()["time_in_state_seconds"]["write_task.QUEUED"]
    assert summary["count"] == 1 and 2.5e-3 < summary["p50"] <= 1e-2


def test_a_trace_opening_or_closing_keeps_the_move_counts(clock: Clock, tmp_path: Any) -> None:
    """Counts never go backwards while metrics stay on: a trace wraps the
    machines' metrics recorders, it does not replace them."""
    from omni_prefix_cache.telemetry.trace import Trace

    key = ("write_task", "enqueue", "PENDING", "QUEUED")
    _task().fire("enqueue")
    trace = Trace(tmp_path / "moves.jsonl")
    TELEMETRY.start_trace(trace)
    try:
        assert TELEMETRY.move_counts()[key] == 1
        _task().fire("enqueue")
        assert TELEMETRY.move_counts()[key] == 2
    finally:
        TELEMETRY.stop_trace(trace)
    assert TELEMETRY.move_counts()[key] == 2
    TELEMETRY.reset()  # a reset starts fresh series
    assert TELEMETRY.move_counts()[key] == 0


def test_metrics_off_touches_no_histogram(managers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Histogram, value: float) -> None:
        raise AssertionError("a histogram was observed with metrics off")

    monkeypatch.setattr(Histogram, "observe", refuse)
    was = TELEMETRY.enabled
    TELEMETRY.disable()
    try:
        mgr, drv = make(False, metrics=False)
        managers.append(mgr)
        assert not TELEMETRY.enabled and WRITE_TASK_MACHINE.recorder is None
        for step in range(3):
            sid, want = drv.run({f"r{step}": Req([step], 0, 4)})
            drv.check(sid, want)
        quiesce(mgr)
        assert TELEMETRY.recorders() == [] and TELEMETRY.datapath is None
        assert mgr.stats_snapshot().metrics == {"enabled": False}
    finally:
        TELEMETRY.set_enabled(was)


def test_a_state_added_to_a_spec_gets_its_time_in_state_series(clock: Clock) -> None:
    raw = yaml.safe_load((spec_dir() / "write_task.yaml").read_text())
    raw["states"].insert(2, {"name": "PARKED", "tags": ["waits"], "meaning": "set aside before its copy"})
    raw["transitions"] += [
        {"trigger": "park", "source": "QUEUED", "dest": "PARKED", "meaning": "set aside"},
        {"trigger": "unpark", "source": "PARKED", "dest": "QUEUED", "meaning": "back on the queue"},
        {"trigger": "fail", "source": "PARKED", "dest": "FAILED", "meaning": "failed while parked"},
    ]
    machine = compile_machine(
        parse_spec(raw, origin="write_task.yaml"),
        effects={name: (lambda task: None) for name in ("drop_device_clone", "set_host_ready", "set_done")},
    )
    recorder = machine.recorder
    assert recorder is not None
    state = machine.initial
    for trigger, seconds in (("enqueue", 0.0), ("park", 0.0), ("unpark", 0.5)):
        clock.advance(seconds)
        move = machine.move(state, trigger)
        assert move is not None
        recorder.moved(move, "instance")
        state = move.dest
    parked = TELEMETRY.time_in_state()[("write_task", "PARKED")]
    assert parked.count == 1 and parked.sum == pytest.approx(0.5)
    assert TELEMETRY.move_counts()[("write_task", "park", "QUEUED", "PARKED")] == 1
    assert "write_task.PARKED" in TELEMETRY.summary()["time_in_state_seconds"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda raw: raw["states"][4].update(tags=["waits"]), "final state cannot be tagged waits"),
        (lambda raw: raw["states"][0].update(tags=["waits"]), "no move enters it"),
        (lambda raw: raw["states"][1].update(tags=["wait"]), "unknown tags ['wait']"),
    ],
)
def test_the_loader_validates_tags(change: Any, why: str) -> None:
    raw = yaml.safe_load((spec_dir() / "write_task.yaml").read_text())
    change(raw)
    with pytest.raises(SpecError, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(raw, origin="write_task.yaml")


def test_a_prefetch_dropped_by_a_reuse_counts_as_dropped(clock: Clock, managers: list[Any]) -> None:
    """d's hit, planned at new_step_starts against a's committed rows, is
    re-planned when c reuses the block in the same step: its first
    prefetch is dropped, the re-planned one used or served late."""
    mgr, drv = make(False, metrics=True)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    assert TELEMETRY.datapath is not None
    before = TELEMETRY.datapath.counters().get("prefetch_hits_total", {})
    assert before.get("dropped", 0) == 0
    sid, want = drv.run({"c": Req([0, 3], 0, 6), "d": Req([0, 4], 4, 2, hit=4)}, finished=["a"])
    drv.check(sid, want)
    outcomes = TELEMETRY.datapath.counters()["prefetch_hits_total"]
    keys = len(want["d"])  # one prefetch per cached key of the hit
    assert outcomes["dropped"] == keys
    assert outcomes.get("used", 0) + outcomes.get("late", 0) == keys


def test_data_path_bytes_of_a_threaded_run(clock: Clock, managers: list[Any]) -> None:
    mgr, drv = make(False, metrics=True)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1], 0, 8)})
    drv.check(sid, want)
    quiesce(mgr)
    dp = TELEMETRY.datapath
    assert dp is not None
    counters = dp.counters()
    rows = sum(int(t.numel() * t.element_size()) for t in want["a"].values() if isinstance(t, torch.Tensor))
    # Every row the step produced left the device once (step or deferred
    # copy) and landed in the pool once.
    d2h = counters["d2h_bytes_total"]
    assert d2h.get("step", 0) + d2h.get("deferred", 0) == rows
    assert sum(counters["pool_write_bytes_total"].values()) == rows
    histograms = dp.histograms()
    assert histograms["pool_write_seconds"]
    counts = TELEMETRY.move_counts()
    assert counts[("step_context", "save", "UNSAVED", "SAVED")] == 1
    assert counts[("slot_occupancy", "map", "ABSENT", "IN_TRANSIT")] == 2 * 4 * len(want["a"])


def test_a_contended_lock_wait_is_timed(clock: Clock) -> None:
    class Contended:
        """Busy at the first try; the blocking acquire returns after 40 us."""

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if blocking:
                clock.advance(40e-6)
            return blocking

        def release(self) -> None:
            pass

    lock = TimedLock(Contended(), "state_lock")
    with lock:
        pass
    assert TELEMETRY.datapath is not None
    waits = TELEMETRY.datapath.histograms()["wait_seconds"]["state_lock"]
    assert waits.count == 1 and waits.sum == pytest.approx(40e-6)


def test_quantiles_follow_histogram_quantile() -> None:
    hist = Histogram((1.0, 2.0, 4.0))
    for value in (0.5, 1.5, 1.5, 3.0):
        hist.observe(value)
    summary = hist.summary()
    assert summary.buckets == ((1.0, 1), (2.0, 3), (4.0, 4), (float("inf"), 4))
    assert summary.quantile(0.5) == pytest.approx(1.5)  # rank 2 of 4: halfway into (1, 2]
    assert summary.quantile(1.0) == pytest.approx(4.0)
    assert Histogram().summary().quantile(0.5) is None


def test_the_collector_exports_moves_and_time_in_state_with_buckets(clock: Clock, managers: list[Any]) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    from omni_prefix_cache.ops.metrics import OmniPrefixCacheCollector

    mgr, drv = make(False, metrics=True)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    clock.advance(0.02)
    drv.check(sid, want)
    quiesce(mgr)
    registry = prometheus.CollectorRegistry()
    registry.register(OmniPrefixCacheCollector(mgr, labels={"stage": "talker"}))
    text = prometheus.generate_latest(registry).decode()
    assert 'omni_prefix_cache_spec_moves_total{dest="SAVED",machine="step_context",source="UNSAVED"' in text
    saved = (
        'omni_prefix_cache_time_in_state_seconds_bucket{le="0.025",machine="step_context",'
        'stage="talker",state="SAVED"} 1.0'
    )
    assert saved in text
    assert "omni_prefix_cache_pool_write_bytes_total{" in text
    snap = mgr.stats_snapshot().metrics
    assert snap["time_in_state_seconds"]["step_context.SAVED"]["count"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_timed_with_events(clock: Clock) -> None:  # pragma: no cover - CUDA only
    from omni_prefix_cache.device.copy_engine import CudaCopyEngine

    engine = CudaCopyEngine()
    src = torch.ones((1024, 256), device="cuda")
    dst = engine.host_empty(src.shape, src.dtype)
    event = engine.launch(None, [(dst, src)])
    assert event is not None
    event.synchronize()
    assert TELEMETRY.datapath is not None
    lanes = TELEMETRY.datapath.histograms()["device_copy_seconds"]
    assert lanes["copy"].count == 1 and lanes["copy"].sum > 0


def test_simulate_metrics_out_draws_the_report(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")  # the dev extra installs it (the plots extra)
    from omni_prefix_cache.tools.cli import main

    out = tmp_path / "report.png"
    assert main(["simulate", "--steps", "40", "--quiet", "--metrics-out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(out) as img:
        assert img.mode == "P"  # drawn as a palette PNG, the size the docs can keep


def test_metrics_report_throughput_is_bytes_over_the_measured_copy_time(clock: Clock) -> None:
    """The report's throughput: per step, the bytes the step moved over the
    seconds its copies and pool writes were measured to take (thread CPU
    time here; the copy lane's CUDA events once any were timed); a window
    sums both over its steps; a step that moved nothing has none."""
    from omni_prefix_cache.tools.simulate.metrics_report import StepSampler, throughput

    dp = TELEMETRY.datapath
    assert dp is not None
    sampler = StepSampler()
    # (D2H bytes, D2H ns, pool bytes, pool ns) per step; step 2 moves nothing.
    steps = [(4_000_000, 2_000_000, 1_000_000, 4_000_000), (0, 0, 0, 0), (3_000_000, 1_000_000, 2_000_000, 1_000_000)]
    for i, (d_bytes, d_ns, p_bytes, p_ns) in enumerate(steps, 1):
        if d_bytes:
            dp.copied("step", d_bytes, 0, d_ns)
            dp.pool_written("committer", p_bytes, 10, 10 + p_ns)
        sampler(i, len(steps), None, None)
    d2h_s, name = sampler.d2h_clock()
    assert name == "thread CPU time" and d2h_s == pytest.approx([0.002, 0.002, 0.003])
    assert throughput(sampler.d2h, d2h_s) == [pytest.approx(2000.0), None, pytest.approx(3000.0)]  # MB/s
    assert throughput(sampler.pool, sampler.pool_s) == [pytest.approx(250.0), None, pytest.approx(2000.0)]
    assert throughput(sampler.d2h, d2h_s, window=2)[2] == pytest.approx(3000.0)  # steps 2-3
    assert throughput(sampler.pool, sampler.pool_s, window=3)[2] == pytest.approx(3_000_000 / 0.005 / 1e6)
    dp.observe("device_copy_seconds", "copy", 0.0005)  # a CUDA copy timed by events
    sampler(4, 4, None, None)
    d2h_s, name = sampler.d2h_clock()
    assert name == "CUDA events" and d2h_s[-1] == pytest.approx(0.0005)


def test_simulate_metrics_out_without_matplotlib_says_so(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from omni_prefix_cache.tools.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "report.png"
    assert main(["simulate", "--steps", "40", "--quiet", "--metrics-out", str(out)]) == 2
    assert "pip install 'omni-prefix-cache[plots]'" in capsys.readouterr().err
    assert not out.exists()
    assert main(["simulate", "--steps", "20", "--quiet"]) == 0  # without --metrics-out it still runs


def _event_path_moves(tmp_path: Any, traced: bool) -> dict[tuple[str, str, str, str], int]:
    """The request_lifecycle and delivery moves counted over a few steps of
    the event API, each kind of usual decode event among them; ``traced``:
    with a trace open (its recorder needs every event's moves one by one),
    else metrics alone (a step's extends counted in one add)."""
    from omni_prefix_cache import OmniPrefixCacheManager, PrefixCacheConfig
    from test_request_lifecycle import BS, Engine, K

    trace = str(tmp_path / "events.jsonl") if traced else None
    with TELEMETRY.recording():
        eng = Engine()
        eng.m.shutdown()
        config = PrefixCacheConfig(num_blocks=32, block_size=BS, metrics=True, trace_path=trace)
        eng.m = OmniPrefixCacheManager(config, eager=True)
        try:
            eng.blocks = {"a": [1, 2], "b": [3, 4]}
            first = eng.step([eng.ev("a", K.STARTED), eng.ev("b", K.STARTED, owner=None)], {"a": (0, 4), "b": (0, 4)})
            out = eng.m.materialize(first, ["a", "b"])
            eng.m.ack_delivery(eng.m.delivery_view(out, ["a", "b"], consumer="talker"))
            # Extends that move: the owner's, an owner-less tenure's owner-less one.
            eng.step([eng.ev("a", K.EXTENDED), eng.ev("b", K.EXTENDED, owner=None)], {"a": (4, 5), "b": (4, 5)})
            # Ones that move nothing: owner-less on an owned tenure, a lookup not complete.
            eng.step(
                [eng.ev("a", K.EXTENDED, owner=None), eng.ev("b", K.EXTENDED, owner=None, lookup_complete=False)],
                {"a": (5, 6), "b": (5, 6)},
            )
            eng.step([eng.ev("a", K.EXTENDED), eng.ev("b", K.EXTENDED, owner=None)], {"a": (6, 7)})
            assert (TELEMETRY.trace is not None) == traced
            counts = TELEMETRY.move_counts()
        finally:
            eng.m.shutdown()
    return {key: n for key, n in counts.items() if key[0] in ("request_lifecycle", "delivery") and n}


def test_a_steps_plain_extends_count_as_the_operation_run_event_by_event_would(tmp_path: Any) -> None:
    """With metrics alone a step's usual decode events are not run through
    request_event: their extend self-loops are counted in one add. The
    counts must be what the operation, run per event (a trace open), counts."""
    alone, traced = _event_path_moves(tmp_path, False), _event_path_moves(tmp_path, True)
    assert alone == traced
    assert alone[("request_lifecycle", "extend", "RUNNING", "RUNNING")] == 4
    assert alone[("delivery", "view", "OPEN", "OPEN")] == alone[("delivery", "ack", "OPEN", "OPEN")] == 2
