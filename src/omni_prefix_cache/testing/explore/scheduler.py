"""A controlled scheduler for the runtime's own threads.

Every thread of a run is a real ``threading.Thread``, but only one of them
runs at a time: it holds the baton. At each synchronization point (a lock
acquire, a condition wait, an event wait, a thread start or join, a future's
result) the running thread declares the operation it is about to perform and
when it can proceed, and the scheduler picks which enabled thread runs next
(a *choice point* when more than one is enabled). Releases, notifies and sets
only change state: the next acquire is where another thread can observe them.

Timed waits never sleep: a timed wait is a sync point that times out only
when no thread at all can run (otherwise the run would be a deadlock). A run
ends when every thread has finished; all threads blocked is a deadlock
failure, and a failure anywhere aborts the run by unwinding every thread
with :class:`Aborted`.

The primitives here replace the ``omni_prefix_cache.device.sync`` seam's factories
for the duration of one run (see :meth:`Scheduler.factories`).
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

# Frames in these files are not "where" a sync point is: the runtime (or scenario) line that called them is.
_SKIP_NAMES = ("scheduler.py", "contextlib.py", "sync.py", "threading.py", "_base.py")


# Forced timeouts of one thread in a row (nobody else running) that count as a stall.
STALL_LIMIT = 50


class Aborted(BaseException):
    """Unwinds a controlled thread once its run is over (a failure was found).
    A BaseException so the runtime's ``except Exception`` handlers let it pass."""


class Chooser(Protocol):
    """Decides each choice point of a run."""

    def pick(self, sched: Scheduler, index: int, runnable: list[int], default: int, me_enabled: bool) -> int: ...


@dataclass
class Failure:
    """What went wrong in one run: ``kind`` is ``exception``, ``deadlock`` or ``livelock``;
    ``reason`` is how it counts (``row oracle``, ``invariant <name>`` or ``crash``)."""

    kind: str
    thread: str
    message: str
    details: str = ""
    reason: str = "crash"

    @staticmethod
    def from_exception(thread: str, exc: BaseException) -> Failure:
        text = str(exc)
        reason = "crash"
        if text.startswith("row oracle:"):
            reason = "row oracle"
        elif text.startswith("invariant "):
            reason = "invariant " + text.split()[1].rstrip(":")
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        return Failure("exception", thread, f"{type(exc).__name__}: {text}", tb, reason)


@dataclass
class _Pending:
    label: str
    enabled: Callable[[], bool]
    timed: bool


@dataclass
class _Thread:
    """The scheduler's record of one controlled thread."""

    idx: int
    name: str
    gate: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    pending: _Pending | None = None
    started: bool = False
    finished: bool = False
    steps: int = 0  # sync operations performed
    timed_out: bool = False


@dataclass
class Decision:
    index: int
    runnable: tuple[int, ...]
    default: int
    chosen: int
    preemption: bool


def _where() -> str:
    """``function:line`` of the innermost runtime frame (outside this package and the seam)."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith(_SKIP_NAMES):
            return f"{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Scheduler:
    """One run's scheduler. ``chooser`` decides choice points; ``check`` (if set)
    runs at every sync point and raises AssertionError on a broken invariant."""

    def __init__(self, chooser: Chooser, *, max_steps: int = 20_000) -> None:
        self.chooser = chooser
        self.max_steps = max_steps
        self.threads: list[_Thread] = []
        self._by_ident: dict[int, _Thread] = {}
        self._meta = threading.Lock()  # real: guards finishing bookkeeping during an abort
        self.aborting = False
        self.failure: Failure | None = None
        self.finished = threading.Event()
        self.steps = 0
        self.decisions: list[Decision] = []
        self.preemptions = 0
        self.check: Callable[[], None] | None = None
        self.fingerprint: Callable[[], Any] | None = None
        self.log: list[tuple[int, str, str]] = []  # (thread idx, thread name, op) of recent sync points
        self._stall_thread: _Thread | None = None
        self._stalled = 0
        self.states: set[Any] | None = None  # signatures seen at choice points, when collected
        self.last_sig: Any = None

    # ------------------------------------------------------------ threads

    def current(self) -> _Thread | None:
        return self._by_ident.get(threading.get_ident())

    def new_thread(self, name: str) -> _Thread:
        t = _Thread(len(self.threads), name)
        self.threads.append(t)
        return t

    def launch(self, t: _Thread, body: Callable[[], None]) -> None:
        """Start ``t``'s real thread; it waits for the baton before ``body``."""

        def run() -> None:
            self._by_ident[threading.get_ident()] = t
            t.gate.acquire()
            try:
                if not self.aborting:
                    t.pending = None
                    t.steps += 1
                    body()
            except Aborted:
                pass
            except BaseException as exc:
                self.fail(Failure.from_exception(t.name, exc))
            finally:
                self._exit(t)

        t.pending = _Pending("start", lambda: True, False)
        t.started = True
        threading.Thread(target=run, name=f"explore-{t.name}", daemon=True).start()

    def start_root(self, name: str, body: Callable[[], None]) -> None:
        """Start the first thread of a run from the (uncontrolled) caller and give it the baton."""
        t = self.new_thread(name)
        self.launch(t, body)
        t.gate.release()

    def _exit(self, t: _Thread) -> None:
        with self._meta:
            t.finished = True
            t.pending = None
            if all(x.finished for x in self.threads if x.started):
                self.finished.set()
                return
            if self.aborting:
                return
        nxt = self._next(t, exiting=True)
        if nxt is not None:
            nxt.gate.release()

    # ------------------------------------------------------------ scheduling

    def point(self, op: str, enabled: Callable[[], bool], *, timed: bool = False) -> bool:
        """A sync point of the calling thread: block (logically) until ``enabled()``
        and the scheduler picks this thread. False if a timed wait timed out."""
        me = self.current()
        if me is None:
            return True  # not a controlled thread (only setup outside a run)
        if self.aborting:
            raise Aborted
        me.pending = _Pending(f"{op}@{_where()}", enabled, timed)
        me.timed_out = False
        nxt = self._next(me)
        if nxt is None:  # a failure was recorded
            raise Aborted
        if nxt is not me:
            nxt.gate.release()
            me.gate.acquire()
            if self.aborting:
                raise Aborted
        me.pending = None
        me.steps += 1
        return not me.timed_out

    def _next(self, me: _Thread, *, exiting: bool = False) -> _Thread | None:
        """Pick the thread to run after ``me``'s sync point (or exit); None after a failure."""
        self.steps += 1
        if self.check is not None:
            try:
                self.check()
            except AssertionError as exc:
                self.fail(Failure.from_exception(me.name, exc))
                return None
        if self.steps > self.max_steps:
            self.fail(Failure("livelock", me.name, f"no end after {self.max_steps} sync points", self._table()))
            return None
        live = [t for t in self.threads if t.started and not t.finished]
        runnable = [t for t in live if t.pending is not None and t.pending.enabled()]
        if not runnable:
            timed = [t for t in live if t.pending is not None and t.pending.timed]
            if timed:
                t = timed[0]
                # Only timeouts move the run on: fine once (the runtime reports its timeout),
                # but a thread that keeps re-waiting while nobody else runs is stuck for good.
                self._stalled = self._stalled + 1 if self._stall_thread is t else 1
                self._stall_thread = t
                if self._stalled > STALL_LIMIT:
                    self.fail(
                        Failure(
                            "stall",
                            t.name,
                            f"stall: {t.name} timed out {STALL_LIMIT} times in a row with no other thread able to "
                            f"run (at {t.pending.label if t.pending else '?'}): a wait only a timeout ends",
                            self._table(),
                            reason="invariant no_stall",
                        )
                    )
                    return None
                t.timed_out = True
                return self._logged(t)
            blocked = "every live thread is blocked" if not exiting else "threads left blocked"
            self.fail(
                Failure("deadlock", me.name, f"deadlock: {blocked}", self._table(), reason="invariant no_deadlock")
            )
            return None
        me_enabled = not exiting and me in runnable
        default = me if me_enabled else runnable[0]
        if len(runnable) == 1:
            return self._logged(default)
        ids = [t.idx for t in runnable]
        if self.states is not None:
            self.last_sig = self.signature()
            self.states.add(self.last_sig)
        chosen = self.chooser.pick(self, len(self.decisions), ids, default.idx, me_enabled)
        preempt = me_enabled and chosen != me.idx
        self.preemptions += preempt
        self.decisions.append(Decision(len(self.decisions), tuple(ids), default.idx, chosen, preempt))
        return self._logged(self.threads[chosen])

    def _logged(self, t: _Thread) -> _Thread:
        if t is not self._stall_thread:
            self._stall_thread = None
        if t.pending is not None:
            self.log.append((t.idx, t.name, t.pending.label))
            if len(self.log) > 64:
                del self.log[:32]
        return t

    def signature(self) -> Any:
        """The state at a choice point: each thread's progress and pending
        operation, plus the scenario's fingerprint of the shared state."""
        threads = tuple(
            (t.idx, t.finished, t.steps, t.pending.label if t.pending is not None else None) for t in self.threads
        )
        return threads, (self.fingerprint() if self.fingerprint is not None else None)

    def _table(self) -> str:
        rows = []
        for t in self.threads:
            if t.started and not t.finished:
                rows.append(f"  T{t.idx} {t.name}: blocked on {t.pending.label if t.pending else '?'}")
        return "\n".join(rows)

    def fail(self, failure: Failure) -> None:
        """Record the run's first failure and unwind every thread."""
        with self._meta:
            if self.failure is None:
                self.failure = failure
            self.aborting = True
            waiting = [t for t in self.threads if t.started and not t.finished]
        for t in waiting:
            t.gate.release()

    def trace(self, last: int = 24) -> str:
        return "\n".join(f"  T{i} {name:28s} {op}" for i, name, op in self.log[-last:])

    # ------------------------------------------------------------ seam

    def factories(self) -> dict[str, Any]:
        """Factories for ``omni_prefix_cache.device.sync.installed``."""
        sched = self
        return {
            "Lock": lambda: CLock(sched),
            "RLock": lambda: CRLock(sched),
            "Condition": lambda lock=None: CCondition(sched, lock),
            "Event": lambda: CEvent(sched),
            "Thread": lambda *a, **kw: CThread(sched, *a, **kw),
            "Executor": lambda max_workers=None, thread_name_prefix="": CExecutor(sched, thread_name_prefix),
        }


# ---------------------------------------------------------------- primitives


class CLock:
    """A lock whose acquire is a sync point; release only changes state."""

    def __init__(self, sched: Scheduler) -> None:
        self._s = sched
        self.owner: object = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        s = self._s
        me = s.current()
        if me is None:  # uncontrolled caller: only valid when free
            if self.owner is not None:
                raise RuntimeError("explore: an uncontrolled thread met a held lock")
            self.owner = "uncontrolled"
            return True
        if not blocking:
            s.point("try-acquire", lambda: True)
            if self.owner is not None:
                return False
        elif not s.point("acquire", lambda: self.owner is None, timed=timeout is not None and timeout >= 0):
            return False
        self.owner = me
        return True

    def release(self) -> None:
        if self._s.aborting:
            return
        if self.owner is None:
            raise RuntimeError("release unlocked lock")
        self.owner = None

    def locked(self) -> bool:
        return self.owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class CRLock(CLock):
    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self._s.current()
        if me is not None and self.owner is me:
            self.depth += 1
            return True
        ok = super().acquire(blocking, timeout)
        if ok:
            self.depth = 1
        return ok

    def release(self) -> None:
        if self._s.aborting:
            return
        self.depth -= 1
        if self.depth == 0:
            super().release()


class _Waiter:
    __slots__ = ("notified",)

    def __init__(self) -> None:
        self.notified = False


class CCondition:
    def __init__(self, sched: Scheduler, lock: Any = None) -> None:
        self._s = sched
        # threading.Condition() defaults to a reentrant lock; so does this one.
        self._lock: CLock = lock if lock is not None else CRLock(sched)
        self._waiters: list[_Waiter] = []

    def acquire(self, *args: Any) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        s = self._s
        if s.aborting:
            raise Aborted
        w = _Waiter()
        self._waiters.append(w)
        # An RLock's depth is saved with its owner: another thread takes it meanwhile.
        owner, depth = self._lock.owner, getattr(self._lock, "depth", 0)
        self._lock.owner = None
        ok = s.point("cond-wait", lambda: w.notified, timed=timeout is not None)
        if not ok and w in self._waiters:
            self._waiters.remove(w)
        s.point("cond-reacquire", lambda: self._lock.owner is None)
        self._lock.owner = owner
        if isinstance(self._lock, CRLock):
            self._lock.depth = depth
        return ok

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        result = predicate()
        while not result:
            if not self.wait(timeout):
                return predicate()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        if self._s.aborting:
            return
        woken, self._waiters = self._waiters[:n], self._waiters[n:]
        for w in woken:
            w.notified = True

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class CEvent:
    def __init__(self, sched: Scheduler) -> None:
        self._s = sched
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        self._s.point("event-wait", lambda: self._flag, timed=timeout is not None)
        return self._flag


class CThread:
    """``threading.Thread``'s API on a controlled thread."""

    def __init__(
        self,
        sched: Scheduler,
        group: Any = None,
        target: Callable[..., Any] | None = None,
        name: str | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        daemon: bool | None = None,
    ) -> None:
        self._s = sched
        self._target, self._args, self._kwargs = target, args, kwargs or {}
        self._t = sched.new_thread(name or f"thread-{len(sched.threads)}")
        self.name = self._t.name
        self.daemon = bool(daemon)

    def run(self) -> None:
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        self._s.launch(self._t, self.run)
        self._s.point(f"start {self.name}", lambda: True)

    def join(self, timeout: float | None = None) -> None:
        t = self._t
        if not t.finished:
            self._s.point(f"join {self.name}", lambda: t.finished, timed=timeout is not None)

    def is_alive(self) -> bool:
        return self._t.started and not self._t.finished


class CFuture(Future[Any]):
    """A future whose ``result`` / ``exception`` wait is a sync point."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__()
        self._s = sched

    def _await(self, timeout: float | None) -> None:
        if not self.done():
            self._s.point("future-result", self.done, timed=timeout is not None)

    def result(self, timeout: float | None = None) -> Any:
        self._await(timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._await(timeout)
        return super().exception(0)


class CExecutor:
    """The prefetch executor: each submitted call runs on its own controlled
    thread (an over-approximation of a bounded pool: more overlap, never less)."""

    def __init__(self, sched: Scheduler, prefix: str) -> None:
        self._s = sched
        self._prefix = prefix or "executor"
        self._futures: list[CFuture] = []
        self._threads: list[CThread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> CFuture:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        fut = CFuture(self._s)

        def work() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                value = fn(*args, **kwargs)
            except Aborted:
                raise
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        self._futures.append(fut)
        thread = CThread(self._s, target=work, name=f"{self._prefix}_{len(self._threads)}")
        self._threads.append(thread)
        thread.start()
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            for fut in self._futures:
                fut.cancel()
        if wait:
            for thread in self._threads:
                thread.join()
