"""The event API beside the seed-era path: ``decode`` and ``prefill_hits``,
both paths replaying the same planned steps against fresh managers, back to
back per (scenario, mode), the first side alternating.

Seed-era side: ``new_step_starts(scheduler_output)`` + ``save_outputs`` (the
group view's slots), then ``materialize``. Event side, as a runner with the
engine helper pays it, each part timed on its own: the *adapter*
(``translate_step`` of a vLLM-shaped output, with every running request in
``scheduled_cached_reqs``, plus ``build_write_layout`` over the group view),
the *engine* calls (``new_step_starts(step)`` + ``save_outputs(...,
write_layout=)``), ``materialize``, and *delivery* (``delivery_view`` +
``commit_output`` of one consumer). Ratios are event / seed of the same run.

``decode_spec2`` and ``decode_spec4`` (when named) are ``decode`` with
speculative drafts: the event side translates the drafts
(``scheduled_spec_decode_tokens``), saves every scheduled row and
materializes with the accepted rows (``accepted_rows=``); the seed side runs
the same rows with the drafts taken as ordinary tokens (it has no
speculative mode). Their event rows beside ``decode``'s are the engine
thread's cost of speculative decoding against plain decoding; ``decode_spec2``
runs by default and is held to ``SPEC_LIMIT`` of ``decode`` (adapter + engine
calls, same mode, same run: ``spec_verdicts``).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from omni_prefix_cache.adapter import PrefixCacheSchedulerAdapter
from omni_prefix_cache.tools.bench.floors import Rig
from omni_prefix_cache.tools.bench.measure import pct, start_manager
from omni_prefix_cache.tools.bench.results import TargetVerdict
from omni_prefix_cache.tools.bench.scenarios import SCENARIOS, SPEC_SCENARIOS, Scenario, StepInput, plan_steps
from omni_prefix_cache.tools.simulate.batch import SimGroupView

EVENT_SCENARIOS = ("decode", "prefill_hits", "decode_spec2")  # the table's default
# Issue 50: the decode workload with K = 2 speculative tokens costs the engine thread
# (adapter + engine calls) at most this much of plain decoding's, per step.
SPEC_LIMIT = 1.3


@dataclass
class ApiPair:
    """One (scenario, mode): p50 microseconds per step of each path and part."""

    name: str
    mode: str
    steps: int
    seed_engine_us: float
    seed_materialize_us: float
    event_adapter_us: float
    event_engine_us: float
    event_materialize_us: float
    event_delivery_us: float

    @property
    def engine_ratio(self) -> float:
        """Event engine thread (adapter + calls) over the seed-era engine thread."""
        return (self.event_adapter_us + self.event_engine_us) / self.seed_engine_us

    @property
    def output_ratio(self) -> float:
        """Event output path (materialize + delivery) over the seed-era materialize."""
        return (self.event_materialize_us + self.event_delivery_us) / self.seed_materialize_us

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"engine_ratio": self.engine_ratio, "output_ratio": self.output_ratio}


def vllm_shaped(st: StepInput) -> SimpleNamespace:
    """``st``'s scheduler output as vLLM 0.33 shapes it: new requests, and every
    other scheduled request in ``scheduled_cached_reqs`` (no new blocks), and
    the step's drafts (``scheduled_spec_decode_tokens``)."""
    so = st.output
    new = {n.req_id for n in so.scheduled_new_reqs}
    running = [r for r in st.order if r not in new]
    cached = SimpleNamespace(
        req_ids=running,
        resumed_req_ids=set(),
        new_block_ids=[None] * len(running),
        num_computed_tokens=[st.computed[r] for r in running],
        num_output_tokens=[0] * len(running),
    )
    return SimpleNamespace(
        scheduled_new_reqs=so.scheduled_new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=so.num_scheduled_tokens,
        finished_req_ids=so.finished_req_ids,
        scheduled_spec_decode_tokens=so.scheduled_spec_decode_tokens,
    )


def _ns() -> int:
    return time.perf_counter_ns()


def _run_side(sc: Scenario, steps: list[StepInput], warmup: int, eager: bool, events: bool) -> dict[str, list[float]]:
    max_n = max(s.n for s in steps)
    view = SimGroupView(sc.block_size)
    # The event side passes the view only to the adapter: the manager gets its slots from the layout.
    mgr, _ = start_manager(sc, max_n, view, eager, None)
    rig = Rig(sc, max_n, 0)
    adapter = PrefixCacheSchedulerAdapter()
    shaped = [vllm_shaped(st) for st in steps] if events else []
    out: dict[str, list[float]] = {"adapter": [], "engine": [], "materialize": [], "delivery": []}
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i, st in enumerate(steps):
            view.set_step(st.order, st.blocks, st.computed)
            mm = rig.mm_outputs(st.n)
            hidden = rig.hidden[: st.n]
            if events:
                t0 = _ns()
                step = adapter.translate_step(shaped[i])
                t1 = _ns()
                mgr.new_step_starts(step)
                t2 = _ns()
                layout = adapter.build_write_layout(view, num_scheduled_tokens=st.output.num_scheduled_tokens)
                t3 = _ns()
                sid = mgr.save_outputs(
                    hidden, mm, num_tokens_unpadded=st.n, num_tokens_padded=st.n, write_layout=layout
                )
                t4 = _ns()
                outs = mgr.materialize(sid, st.order, accepted_rows=st.accepted)
                t5 = _ns()
                dv = mgr.delivery_view(outs, st.order, consumer="output")
                mgr.commit_output(outs, _publish, delivery=dv)
                t6 = _ns()
                times = {"adapter": t1 - t0 + t3 - t2, "engine": t2 - t1 + t4 - t3, "materialize": t5 - t4}
                times["delivery"] = t6 - t5
            else:
                t0 = _ns()
                mgr.new_step_starts(st.seed_era_output())
                sid = mgr.save_outputs(hidden, mm, num_tokens_unpadded=st.n, num_tokens_padded=st.n)
                t1 = _ns()
                mgr.materialize(sid, st.order)
                t2 = _ns()
                times = {"engine": t1 - t0, "materialize": t2 - t1}
            if i >= warmup:
                for part, ns in times.items():
                    out[part].append(ns / 1000.0)
    finally:
        if gc_was:
            gc.enable()
        mgr.shutdown()
    return out


def _publish(live: frozenset[str]) -> None:
    """The bench's handoff: nothing to publish."""


def run_api_pair(sc: Scenario, *, eager: bool, index: int, iters: int | None = None) -> ApiPair:
    """Both paths over the same planned steps; the side run first alternates with ``index``."""
    iters = sc.iters if iters is None else iters
    steps = plan_steps(sc, sc.warmup + iters, 0)
    sides: dict[bool, dict[str, list[float]]] = {}
    for events in (False, True) if index % 2 == 0 else (True, False):
        sides[events] = _run_side(sc, steps, sc.warmup, eager, events)
    seed, ev = sides[False], sides[True]
    return ApiPair(
        name=sc.name,
        mode="eager" if eager else "threaded",
        steps=len(seed["engine"]),
        seed_engine_us=pct(seed["engine"], 50),
        seed_materialize_us=pct(seed["materialize"], 50),
        event_adapter_us=pct(ev["adapter"], 50),
        event_engine_us=pct(ev["engine"], 50),
        event_materialize_us=pct(ev["materialize"], 50),
        event_delivery_us=pct(ev["delivery"], 50),
    )


def run_event_api(names: list[str] | None, modes: tuple[str, ...], iters: int | None = None) -> list[ApiPair]:
    """The event-API pairs of the chosen scenarios (``decode``, ``prefill_hits``,
    ``decode_spec2`` and ``decode_spec4`` among them; by default
    ``EVENT_SCENARIOS``) and modes."""
    chosen = [n for n in (names or EVENT_SCENARIOS) if n in EVENT_SCENARIOS or n in SPEC_SCENARIOS]
    runs = [(SCENARIOS[n](), mode) for n in chosen for mode in modes]
    return [run_api_pair(sc, eager=mode == "eager", index=i, iters=iters) for i, (sc, mode) in enumerate(runs)]


def spec_verdicts(pairs: list[ApiPair]) -> list[TargetVerdict]:
    """``decode_spec2``'s event engine thread (adapter + calls) over ``decode``'s,
    per mode where both ran, against ``SPEC_LIMIT``."""
    by = {(p.name, p.mode): p for p in pairs}
    out = []
    for mode in dict.fromkeys(p.mode for p in pairs):
        spec, plain = by.get(("decode_spec2", mode)), by.get(("decode", mode))
        if spec is None or plain is None:
            continue
        ours, base = spec.event_adapter_us + spec.event_engine_us, plain.event_adapter_us + plain.event_engine_us
        value = ours / base
        context = f"decode_spec2 {ours:.0f} us, decode {base:.0f} us (adapter + engine calls)"
        out.append(
            TargetVerdict(
                f"spec K=2 / plain {mode}",
                f"<= {SPEC_LIMIT:g}x (event engine us/step)",
                value,
                SPEC_LIMIT,
                value <= SPEC_LIMIT,
                context,
            )
        )
    return out


def format_event_api(pairs: list[ApiPair]) -> str:
    """The side-by-side table (p50 us per step)."""
    if not pairs:
        return ""
    head = (
        f"{'event API vs seed-era (p50 us/step)':38} {'seed eng':>9} {'adapter':>8} {'ev eng':>8} {'eng x':>6} "
        f"{'seed mat':>9} {'ev mat':>8} {'deliver':>8} {'out x':>6}"
    )
    lines = [head]
    for p in pairs:
        lines.append(
            f"{p.name + ' ' + p.mode:38} {p.seed_engine_us:9.1f} {p.event_adapter_us:8.1f} {p.event_engine_us:8.1f} "
            f"{p.engine_ratio:6.2f} {p.seed_materialize_us:9.1f} {p.event_materialize_us:8.1f} "
            f"{p.event_delivery_us:8.1f} {p.output_ratio:6.2f}"
        )
    lines.append(
        "eng x = (adapter + event engine calls) / seed-era engine calls; "
        "out x = (event materialize + delivery view + commit) / seed-era materialize"
    )
    for v in spec_verdicts(pairs):
        verdict = "met" if v.met else "MISSED"
        lines.append(f"{v.name:<38} {v.value:6.2f} (target {v.describe}): {verdict}; {v.context}")
    return "\n".join(lines)
