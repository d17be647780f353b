"""A machine probe: what waking an idle thread once a step costs the engine
thread on this host, with no work done by the woken thread.

A threaded manager wakes its committer once a step: a save only queues
its writes, and ``new_step_starts`` kicks the committer at its end, so the
wake and the committer's pass land in the forward that follows (with no
next step, the committer wakes itself after
``PrefixCacheConfig.committer_linger_s``). On some hosts (seen on a 2-vCPU
VM: waking a thread that runs on the other vCPU) a wake alone makes the
waker's next few hundred microseconds of Python markedly slower, although
the woken thread does nothing and nothing overlaps the timed span; a forward
shorter than that window leaves the cost in the engine's next calls. The
probe measures it beside the scenarios: eager ``decode`` at one request,
alone and with a no-op thread woken after every step (outside the timed
spans), the sides alternating; where the OS lets a thread pick its CPUs, a
third side runs the waker and the woken thread on one CPU.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from omni_prefix_cache.tools.bench.measure import run_scenario
from omni_prefix_cache.tools.bench.scenarios import decode_scenario

SIDES = ("alone", "woken", "one_cpu")
THREAD_NAME = "omni-prefix-cache-bench-wake-probe"


class Sleeper:
    """A thread that waits for ``wake`` and goes back to waiting: nothing
    else. ``wakes`` counts the wakes it served (wakes that come before it
    ran again are one); ``close`` joins it."""

    def __init__(self, cpu: int | None = None) -> None:
        self.wakes = 0
        self._event = threading.Event()
        self._stopping = False
        self._cpu = cpu
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Wake the thread once (any thread)."""
        self._event.set()

    def close(self) -> None:
        """Stop and join the thread (the caller's, once)."""
        self._stopping = True
        self._event.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        if self._cpu is not None:
            os.sched_setaffinity(0, {self._cpu})  # Linux: this thread only
        event = self._event
        while True:
            event.wait()
            event.clear()
            if self._stopping:
                return
            self.wakes += 1


@dataclass(frozen=True, slots=True)
class WakeProbe:
    """Eager engine p50 (us) per side, the median over ``pairs`` runs each;
    ``one_cpu`` is None where threads cannot pick their CPUs."""

    requests: int
    iters: int
    pairs: int
    alone_us: float
    woken_us: float
    one_cpu_us: float | None

    @property
    def extra_us(self) -> float:
        """What the wake costs the engine thread per step, here."""
        return self.woken_us - self.alone_us

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON form (the report's ``wake_probe``)."""
        return asdict(self)


def _cpus() -> set[int] | None:
    getter: Callable[[int], set[int]] | None = getattr(os, "sched_getaffinity", None)
    if getter is None or not hasattr(os, "sched_setaffinity"):
        return None
    return set(getter(0))


@contextmanager
def _side(side: str, cpus: set[int] | None) -> Iterator[Sleeper | None]:
    """The side's woken thread (None alone); ``one_cpu`` pins this thread and
    it to one CPU, this thread's CPUs restored after."""
    if side == "alone":
        yield None
        return
    cpu = min(cpus) if side == "one_cpu" and cpus else None
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    sleeper = Sleeper(cpu)
    try:
        yield sleeper
    finally:
        sleeper.close()
        if cpu is not None and cpus:
            os.sched_setaffinity(0, cpus)


def probe_wake(*, requests: int = 1, iters: int = 300, warmup: int = 20, pairs: int = 3) -> WakeProbe:
    """Run the probe: ``pairs`` rounds of every side, in turn (the first side
    alternating from round to round). Raises RuntimeError if a woken side's
    thread served no wake."""
    cpus = _cpus()
    sides = [s for s in SIDES if s != "one_cpu" or (cpus is not None and len(cpus) > 1)]
    engine: dict[str, list[float]] = {s: [] for s in sides}
    sc = decode_scenario(requests, warmup=warmup, iters=iters)
    for i in range(pairs):
        order = sides if i % 2 == 0 else [*sides[1:], sides[0]]
        for side in order:
            with _side(side, cpus) as sleeper:
                result = run_scenario(sc, eager=True, warm=True, on_step=None if sleeper is None else sleeper.wake)
            # Wakes set before the thread got the GIL back coalesce, so fewer than the steps may be served.
            if sleeper is not None and sleeper.wakes == 0:
                raise RuntimeError(f"wake probe: side {side}'s thread served no wake in {warmup + iters} steps")
            engine[side].append(result.engine_us_p50)
    one_cpu = engine.get("one_cpu")
    return WakeProbe(
        requests=requests,
        iters=iters,
        pairs=pairs,
        alone_us=statistics.median(engine["alone"]),
        woken_us=statistics.median(engine["woken"]),
        one_cpu_us=statistics.median(one_cpu) if one_cpu else None,
    )


def wake_probe_lines(probe: WakeProbe | None) -> list[str]:
    """The probe's lines in the report (none without a probe)."""
    if probe is None:
        return []
    one = "" if probe.one_cpu_us is None else f", both threads on one CPU {probe.one_cpu_us:.0f} us"
    return [
        "",
        f"wake probe (eager decode x{probe.requests}, engine p50, median of {probe.pairs} runs a side): "
        f"alone {probe.alone_us:.0f} us, a no-op thread woken after every step {probe.woken_us:.0f} us "
        f"({probe.extra_us:+.0f} us){one}",
        "  a threaded manager kicks its committer at the end of new_step (the forward follows): the wake lands in the"
        " forward when it is long enough (--forward-us), else threaded engine rows carry about the difference here",
    ]
