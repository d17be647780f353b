"""Runtime metrics under concurrent observers (telemetry.shards): every
observation counted exactly once whatever thread made it, a thread's
figures kept after it exits, a read racing observers never going
backwards, and no lock taken per observation.

Threads are lined up with Barriers and Events, never sleeps: the racing
read loops until the observers say they are done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from omni_prefix_cache.telemetry.datapath import DataPath
from omni_prefix_cache.telemetry.histogram import Counter, Histogram, HistogramSummary
from omni_prefix_cache.telemetry.moves import MoveRecorder
from omni_prefix_cache.telemetry.shards import Shards

THREADS = 4
EACH = 5_000
# One stay per (go, back) pair, each 1 us of a per-thread clock.
LABELS = [("go", "IDLE", "BUSY"), ("back", "BUSY", "IDLE"), ("poke", "BUSY", "BUSY")]
GO, BACK, POKE = (SimpleNamespace(index=i) for i in range(3))


class ThreadClock:
    """Nanoseconds that advance 1 us per read, separately on each thread
    (so a stay's length does not depend on how the threads interleave)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> int:
        now = getattr(self._local, "now", 0) + 1_000
        self._local.now = now
        return now


def _recorder() -> MoveRecorder:
    return MoveRecorder("toy", LABELS, {1: "BUSY"}, ThreadClock())


def _run_together(work: Callable[[int], None], n: int = THREADS) -> None:
    """``work(i)`` on ``n`` threads released at once; re-raises the first failure."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"observer-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _observe_histogram(hist: Histogram, i: int) -> None:
    # Thread i observes EACH values: i+1 us, and once 20 s (overflow).
    for _ in range(EACH - 1):
        hist.observe((i + 1) * 1e-6)
    hist.observe(20.0)


def test_concurrent_observers_total_exactly() -> None:
    hist, counter = Histogram(), Counter()

    def work(i: int) -> None:
        _observe_histogram(hist, i)
        for _ in range(EACH):
            counter.add(i + 1)

    _run_together(work)
    got = hist.summary()
    assert got.count == THREADS * EACH
    assert got.sum == pytest.approx(sum((i + 1) * 1e-6 * (EACH - 1) + 20.0 for i in range(THREADS)))
    by_bound = dict(got.buckets)
    # 1 us lands in le=1e-6, 2 us in le=2.5e-6, 3 and 4 us in le=1e-5.
    assert by_bound[1e-6] == EACH - 1
    assert by_bound[2.5e-6] == 2 * (EACH - 1)
    assert by_bound[10.0] == THREADS * (EACH - 1)
    assert by_bound[float("inf")] == THREADS * EACH
    assert counter.value == EACH * sum(i + 1 for i in range(THREADS))


def test_concurrent_moves_count_and_time_every_stay() -> None:
    rec = _recorder()

    def work(i: int) -> None:
        for n in range(EACH):
            key = (i, n)
            rec.moved(GO, key)
            rec.moved(POKE, key)  # a self-loop keeps the stay
            rec.moved(BACK, key)
        rec.counted(POKE, 7)
        rec.moved_batch([(i, "a"), (i, "b"), (i, "c")], [GO, None, GO])
        rec.moved_batch([(i, "a"), (i, "c")], [BACK, BACK])

    _run_together(work)
    counts = rec.move_counts()
    assert counts[("go", "IDLE", "BUSY")] == THREADS * (EACH + 2)
    assert counts[("back", "BUSY", "IDLE")] == THREADS * (EACH + 2)
    assert counts[("poke", "BUSY", "BUSY")] == THREADS * (EACH + 7)
    busy = rec.state_summaries()["BUSY"]
    assert busy.count == THREADS * (EACH + 2)
    # Each moved stay: go at t, poke (no clock read), back at t + 1 us. A
    # batch reads the clock once: its two stays take 1 us each as well.
    assert busy.sum == pytest.approx(busy.count * 1e-6)
    assert dict(busy.buckets)[1e-6] == busy.count
    assert rec.open_stays == 0


def test_concurrent_data_path_records_total_exactly() -> None:
    dp = DataPath()

    def work(i: int) -> None:
        for _ in range(EACH):
            dp.pool_written("shared", 100, 0, 2_000)
            dp.copied("step", 10, 0, 1_000)
            dp.waited(f"wait{i}", 0, 3_000)
            dp.add("prefetch_hits_total", "used", 1)

    _run_together(work)
    counters, hists = dp.counters(), dp.histograms()
    assert counters["pool_write_bytes_total"] == {"shared": 100 * THREADS * EACH}
    assert counters["d2h_bytes_total"] == {"step": 10 * THREADS * EACH}
    assert counters["prefetch_hits_total"] == {"used": THREADS * EACH}
    assert hists["pool_write_seconds"]["shared"].count == THREADS * EACH
    assert hists["d2h_seconds"]["step"].sum == pytest.approx(THREADS * EACH * 1e-6)
    assert sorted(hists["wait_seconds"]) == [f"wait{i}" for i in range(THREADS)]
    assert all(h.count == EACH for h in hists["wait_seconds"].values())


class FakeEvent:
    """A CUDA timing event's surface: done or not, and ms since a start."""

    def __init__(self, ms: float = 0.0) -> None:
        self.done, self.ms = False, ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms


def test_cuda_copies_resolve_once_when_complete_whatever_thread_queued_them() -> None:
    """``device_copy`` queues without a lock; a read observes each copy
    once its end event completed, and keeps the rest for a later read."""
    dp = DataPath()
    ends = [[FakeEvent(ms=2.0) for _ in range(EACH)] for _ in range(THREADS)]
    _run_together(lambda i: [dp.device_copy("copy", FakeEvent(), end) for end in ends[i]])
    for end in ends[0]:
        end.done = True
    assert dp.histograms()["device_copy_seconds"]["copy"].count == EACH
    for group in ends[1:]:
        for end in group:
            end.done = True
    got = dp.histograms()["device_copy_seconds"]["copy"]
    assert got.count == THREADS * EACH and got.sum == pytest.approx(THREADS * EACH * 2e-3)
    assert dp.histograms()["device_copy_seconds"]["copy"].count == THREADS * EACH  # none twice


def test_a_thread_that_exits_keeps_its_counts() -> None:
    """Each of many short-lived threads observes and exits before the next
    starts (so later ones may reuse an ident); every figure stays."""
    hist, counter, rec = Histogram(), Counter(), _recorder()
    for i in range(20):

        def work(i: int = i) -> None:
            hist.observe(1e-3)
            counter.add(i)
            rec.moved(GO, i)
            rec.moved(BACK, i)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert not t.is_alive()
    assert hist.summary().count == 20
    assert counter.value == sum(range(20))
    assert rec.move_counts()[("back", "BUSY", "IDLE")] == 20
    assert rec.state_summaries()["BUSY"].count == 20


def _assert_never_less(before: HistogramSummary, after: HistogramSummary) -> None:
    assert after.count >= before.count
    for (bound, n), (_, m) in zip(before.buckets, after.buckets):
        assert m >= n, f"bucket le={bound} went from {n} to {m}"


def test_a_read_racing_observers_never_goes_backwards() -> None:
    hist, counter, rec = Histogram(), Counter(), _recorder()
    start = threading.Barrier(THREADS + 1)
    done = [threading.Event() for _ in range(THREADS)]

    def observe(i: int) -> None:
        start.wait()
        for n in range(EACH):
            hist.observe(n * 1e-6)
            counter.add(1)
            rec.moved(GO, (i, n))
            rec.moved(BACK, (i, n))
        done[i].set()

    threads = [threading.Thread(target=observe, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    start.wait()
    last_hist, last_value, last_moves = hist.summary(), counter.value, rec.move_counts()
    last_busy = rec.state_summaries()["BUSY"]
    reads = 0
    while not all(e.is_set() for e in done):
        now_hist, now_value, now_moves = hist.summary(), counter.value, rec.move_counts()
        now_busy = rec.state_summaries()["BUSY"]
        _assert_never_less(last_hist, now_hist)
        assert now_value >= last_value
        assert all(now_moves[k] >= last_moves[k] for k in now_moves)
        _assert_never_less(last_busy, now_busy)
        last_hist, last_value, last_moves, last_busy = now_hist, now_value, now_moves, now_busy
        reads += 1
    for t in threads:
        t.join()
    assert reads > 0
    # Once the observers are done, a read is exact again.
    assert hist.summary().count == counter.value == THREADS * EACH
    assert rec.move_counts()[("go", "IDLE", "BUSY")] == THREADS * EACH


class CountingLock:
    """A lock that counts how often it is taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> bool:
        self._lock.acquire()
        self.taken += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.fixture
def counted_locks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CountingLock]]:
    """Every lock ``Shards`` builds in the test, counting its acquisitions."""
    made: list[CountingLock] = []

    def build() -> CountingLock:
        made.append(CountingLock())
        return made[-1]

    with monkeypatch.context() as patch:
        patch.setattr(
            "omni_prefix_cache.telemetry.shards.threading", SimpleNamespace(Lock=build, local=threading.local)
        )
        yield made


def test_observing_takes_no_lock_after_a_threads_first(counted_locks: list[CountingLock]) -> None:
    hist, counter, rec = Histogram(), Counter(), _recorder()
    assert len(counted_locks) == 3
    for n in range(100):
        hist.observe(1e-4)
        counter.add(2)
        rec.moved(GO, n)
        rec.moved(BACK, n)
    # One registration each (this thread's first figure), none per observation.
    assert [lock.taken for lock in counted_locks] == [1, 1, 1]
    hist.summary()
    assert counted_locks[0].taken == 2  # a read takes it once, to copy the rows


def test_each_thread_writes_a_row_of_its_own() -> None:
    shards = Shards(2)
    mine: dict[int, list[float]] = {}

    def work(i: int) -> None:
        try:
            row = shards.local.row
        except AttributeError:
            row = shards.register()
        assert shards.local.row is row and shards.rows[threading.get_ident()] is row
        mine[i] = row
        for _ in range(EACH):
            row[0] += 1
            row[1] += i

    _run_together(work)
    assert len({id(row) for row in mine.values()}) == THREADS
    assert all(mine[i] == [EACH, EACH * i] for i in range(THREADS))
    assert shards.totals() == [THREADS * EACH, EACH * sum(range(THREADS))]
    assert Shards(3).totals() == [0, 0, 0]


def test_a_thread_with_a_reused_ident_adds_into_that_idents_row() -> None:
    """A thread starting with an ident an exited one had finds no cached
    row (its thread-local is fresh) and takes the ident's row, so the rows
    stay as many as threads alive at once."""
    shards = Shards(1)
    row = shards.register()
    row[0] += 3
    del shards.local.row  # what a new thread with this ident sees
    assert shards.register() is row
    assert len(shards.rows) == 1 and shards.totals() == [3]


def test_shards_refuse_a_zero_width() -> None:
    with pytest.raises(ValueError, match="width of at least 1"):
        Shards(0)
