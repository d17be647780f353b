"""Progress line, summary table and JSON summary of a simulation run."""

from __future__ import annotations

import math
from typing import Any, TextIO

from omni_prefix_cache.tools.progress import StepProgress
from omni_prefix_cache.tools.simulate.engine import SimResult
from omni_prefix_cache.tools.simulate.scheduler import SimScheduler


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


class ProgressLine:
    """The simulation's progress line by steps, with elapsed time and ETA;
    silent when stderr is not a TTY.

    A run ends at the step cap or when every request is done, whichever
    comes first, so the fraction shown is the larger of the two estimates:
    steps over the cap, and arrival progress times the share of known
    requests that are done.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None, every_s: float = 0.1) -> None:
        self._line = StepProgress("step", stream=stream, enabled=enabled, every_s=every_s)
        self.arrival_steps = 0

    @property
    def enabled(self) -> bool:
        return self._line.enabled

    def __call__(self, step: int, total: int, sched: SimScheduler, res: SimResult) -> None:
        if not self._line.enabled:
            return
        arrived = min(1.0, step / self.arrival_steps) if self.arrival_steps > 0 else 1.0
        frac = max(step / total if total else 0.0, arrived * sched.progress())
        st = sched.stats
        detail = (
            f"running {len(sched.running)} waiting {len(sched.waiting)} hits {st.hits} "
            f"preempted {st.preemptions} mismatches {res.mismatches}"
        )
        self._line.update(step, total, detail, fraction=frac)

    def close(self) -> None:
        self._line.close()


def budget_flushes(res: SimResult) -> int:
    """The manager's budget_flushes_total; the WARNING log count for a manager without it."""
    counted = (res.manager_stats or {}).get("budget_flushes_total")
    return int(counted) if counted is not None else int(res.log_warnings.get("budget_flush", 0))


def summary(res: SimResult) -> dict[str, Any]:
    """The machine-readable summary (what ``--json`` prints)."""
    st = res.scheduler
    prompt_rows = st.get("prefill_tokens", 0) + st.get("hit_tokens", 0)
    return {
        "ok": res.ok,
        "checked_nothing": res.checked_nothing,
        "mode": res.mode,
        "api": res.config.get("api", "seed"),
        "lag": res.config.get("lag"),
        "seed": res.config.get("seed"),
        "steps": res.steps,
        "saved_steps": res.saved_steps,
        "materialized_steps": res.materialized_steps,
        "discarded_steps": res.discarded_steps,
        "tokens": res.tokens,
        "hit_tokens": st.get("hit_tokens", 0),
        "hit_rate": (st.get("hit_tokens", 0) / prompt_rows) if prompt_rows else 0.0,
        "rows_from_cache": res.rows_from_cache,
        "rows_checked": res.rows_checked,
        "engine_us_p50": percentile(res.engine_us, 50),
        "engine_us_p99": percentile(res.engine_us, 99),
        "materialize_us_p50": percentile(res.materialize_us, 50),
        "materialize_us_p99": percentile(res.materialize_us, 99),
        "mismatches": res.mismatches,
        "mismatch_details": res.mismatch_details,
        "leaks": res.leaks,
        "error": res.error,
        "view_off_thread_calls": res.view_off_thread_calls,
        "aborted_at_end": res.aborted_at_end,
        "torch_threads": res.torch_threads,
        "log_warnings": res.log_warnings,
        "budget_flushes": budget_flushes(res),
        "wall_s": round(res.wall_s, 3),
        "scheduler": st,
        "allocator": res.allocator,
        "manager_stats": res.manager_stats,
        "delivery": res.delivery,
        "config": res.config,
    } | res.extra_summary()


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _delivery_rows(res: SimResult) -> list[tuple[str, str]]:
    """The event API's rows: resumes, recoveries, replacements, delivery per consumer."""
    d, st = res.delivery, res.scheduler
    if not d:
        return []
    per = d.get("delivered", {})
    return [
        (
            "resumes (growing / shrinking hit)",
            f"{d.get('resumes_growing', 0) + d.get('resumes_shrinking', 0)} "
            f"({d.get('resumes_growing', 0)} / {d.get('resumes_shrinking', 0)})",
        ),
        (
            "discard rollbacks / recovered after a discard",
            f"{st.get('rollbacks', 0)} / {d.get('recovered_discards', 0)}",
        ),
        ("replacements (REPLACED owners)", str(st.get("replacements", 0))),
        ("positions delivered (" + " / ".join(per) + ")", " / ".join(str(v) for v in per.values())),
        (
            "views dropped unacked / outputs filtered at commit",
            f"{d.get('views_dropped', 0)} / {d.get('filtered', 0)}",
        ),
        ("finished tenures checked complete", str(d.get("finished_checked", 0))),
    ]


def _draft_rows(res: SimResult) -> list[tuple[str, str]]:
    """Speculative decoding's rows (``--spec-tokens``), when a step drafted."""
    st = res.scheduler
    if not st.get("draft_steps"):
        return []
    drafts, accepted = st.get("drafts", 0), st.get("drafts_accepted", 0)
    return [
        (
            "speculative steps / drafts (accepted / rejected)",
            f"{st['draft_steps']} / {drafts} ({accepted} / {drafts - accepted})",
        ),
        ("hits on blocks a rejected draft held", str(st.get("hits_over_rejected", 0))),
    ]


def format_table(res: SimResult) -> str:
    """Human summary: the headline numbers, then the verdict."""
    s = summary(res)
    st = res.scheduler
    leaks = res.leaks
    ctrl_mode = (res.manager_stats or {}).get("mode")
    mode = f"{s['mode']} (materialize {'lagged one step on a thread' if s['lag'] else 'inline'})"
    api = "event API (adapter, write layouts, 2 consumers)" if s["api"] == "events" else "seed-era scheduler output"
    rows: list[tuple[str, str]] = [
        ("mode", mode + (f"; committer {ctrl_mode}" if ctrl_mode else "")),
        ("api", api),
        ("seed / wall time / torch threads", f"{s['seed']} / {s['wall_s']:.1f} s / {res.torch_threads}"),
        (
            "steps (saved / materialized / discarded)",
            f"{s['steps']} ({res.saved_steps} / {res.materialized_steps} / {res.discarded_steps})",
        ),
        (
            "requests (arrived / finished / aborted / rejected)",
            f"{st.get('arrived', 0)} / {st.get('finished', 0)} / {st.get('aborted', 0)} / {st.get('rejected', 0)}",
        ),
        (
            "tokens computed (prefill / decode)",
            f"{s['tokens']} ({st.get('prefill_tokens', 0)} / {st.get('decode_tokens', 0)})",
        ),
        (
            "prefix hits (requests / tokens / rate)",
            f"{st.get('hits', 0)} / {s['hit_tokens']} / {100.0 * s['hit_rate']:.1f}%",
        ),
        ("same-step hits", str(st.get("same_step_hits", 0))),
        ("rows served from cache", str(s["rows_from_cache"])),
        (
            "preemptions (resumed / with prefix)",
            f"{st.get('preemptions', 0)} ({st.get('resumes', 0)} / {st.get('resumes_with_hit', 0)})",
        ),
        ("streaming re-entries", str(st.get("stream_reentries", 0))),
        (
            "two-turn follow-ups (reusing the id) / duplicates",
            f"{st.get('followups', 0)} ({st.get('reused_ids', 0)}) / {st.get('duplicates', 0)}",
        ),
        ("blocks evicted (hash dropped)", str(res.allocator.get("evicted_hashes", 0))),
        ("deferred budget flushes", str(budget_flushes(res))),
        ("engine us/step p50 / p99", f"{_fmt(s['engine_us_p50'])} / {_fmt(s['engine_us_p99'])}"),
        ("materialize us p50 / p99", f"{_fmt(s['materialize_us_p50'])} / {_fmt(s['materialize_us_p99'])}"),
        *_delivery_rows(res),
        *_draft_rows(res),
        *res.extra_rows(),
        ("rows checked", str(s["rows_checked"])),
        ("mismatches", str(s["mismatches"])),
        (
            "leaked holders / bytes / tasks / steps",
            " / ".join(_fmt(leaks.get(k)) for k in ("holders", "staged_bytes", "tasks", "step_contexts")),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for d in res.mismatch_details:
        lines.append(f"  mismatch: {d}")
    if res.error:
        lines.append(f"error: {res.error}")
    if res.ok:
        lines.append("result: OK")
    elif res.checked_nothing and res.error is None and res.mismatches == 0 and not res.leaked:
        lines.append("result: NOTHING CHECKED (no materialized row was compared; nothing can be said OK)")
    else:
        lines.append("result: FAILED")
    return "\n".join(lines)
