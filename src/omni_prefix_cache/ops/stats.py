"""A typed snapshot of the manager's operator metrics, named in the Prometheus style.

``OmniPrefixCacheManager.stats_snapshot()`` returns a :class:`CacheStats`;
``stats()`` keeps returning a plain dict (its historical keys plus every field
here, by the same names). Counters end in ``_total`` and only grow over the
manager's life; sizes end in ``_bytes``; everything else is a gauge read at the
call. ``omni_prefix_cache.ops.metrics`` exports a snapshot to ``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """One consistent-enough read of the manager (each part under its own lock)."""

    # Prefix-cache lookups: a query is a request newly scheduled (not a live
    # one re-entering); its tokens are its prompt tokens (or, without the
    # prompt, its computed plus first-step scheduled tokens).
    prefix_queries_requests_total: int = 0
    prefix_queries_tokens_total: int = 0
    prefix_hits_requests_total: int = 0
    prefix_hits_tokens_total: int = 0
    # The step protocol.
    steps_saved_total: int = 0
    steps_materialized_total: int = 0
    steps_discarded_total: int = 0
    tokens_saved_total: int = 0
    # The write pipeline.
    rows_committed_total: int = 0  # rows x keys written into the pool
    failed_writes_total: int = 0
    budget_flushes_total: int = 0  # deferred writes forced to copy by the GPU staging budget
    # Delivery: consumers forgotten past the table's bound (requests.lifecycle.MAX_CONSUMERS).
    delivery_consumers_forgotten_total: int = 0
    # Gauges.
    live_requests: int = 0
    open_steps: int = 0  # saved, not yet materialized or discarded
    sticky_failure: bool = False
    delivery_consumers: int = 0  # consumers the request table remembers (at most MAX_CONSUMERS)
    write_queue_depth_high: int = 0
    write_queue_depth_low: int = 0
    writes_claimed: int = 0
    writes_blocked: int = 0
    completions_undrained: int = 0
    failures_undrained: int = 0
    staging_holders_step: int = 0
    staging_holders_task: int = 0
    gpu_staged_bytes: int = 0  # device clones charged to the staging budget
    pool_bytes: Mapping[str, int] = field(default_factory=dict)  # CPU slab bytes by key
    write_tasks_by_state: Mapping[str, int] = field(default_factory=dict)
    mode: str = ""  # "eager", or "<committer>:<copy engine>"
    # Runtime metrics as summaries (telemetry.registry.Telemetry.summary):
    # spec move counts, time in state and data-path histograms.
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pool_bytes_total(self) -> int:
        return sum(self.pool_bytes.values())

    @property
    def prefix_hit_rate_tokens(self) -> float | None:
        """Hit tokens over queried tokens; None before the first query."""
        if not self.prefix_queries_tokens_total:
            return None
        return self.prefix_hits_tokens_total / self.prefix_queries_tokens_total

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (mappings copied), plus ``pool_bytes_total``."""
        out = asdict(self)
        out["pool_bytes"] = dict(self.pool_bytes)
        out["write_tasks_by_state"] = dict(self.write_tasks_by_state)
        out["metrics"] = dict(self.metrics)
        out["pool_bytes_total"] = self.pool_bytes_total
        return out

    @classmethod
    def from_stats(cls, raw: Mapping[str, Any]) -> CacheStats:
        """Build from the manager's historical ``stats()`` keys (missing ones read as zero)."""
        holders = raw.get("holders") or {}
        values: dict[str, Any] = {
            "prefix_queries_requests_total": raw.get("query_requests", 0),
            "prefix_queries_tokens_total": raw.get("query_tokens", 0),
            "prefix_hits_requests_total": raw.get("hit_requests", 0),
            "prefix_hits_tokens_total": raw.get("hit_tokens", 0),
            "steps_saved_total": raw.get("steps_saved", 0),
            "steps_materialized_total": raw.get("steps_materialized", 0),
            "steps_discarded_total": raw.get("steps_discarded", 0),
            "tokens_saved_total": raw.get("tokens_saved", 0),
            "rows_committed_total": raw.get("rows_committed", 0),
            "failed_writes_total": raw.get("failed_writes", 0),
            "budget_flushes_total": raw.get("budget_flushes", 0),
            "delivery_consumers_forgotten_total": raw.get("delivery_consumers_forgotten", 0),
            "live_requests": raw.get("live_requests", 0),
            "open_steps": raw.get("open_steps", 0),
            "sticky_failure": bool(raw.get("sticky_failure", False)),
            "delivery_consumers": raw.get("delivery_consumers", 0),
            "write_queue_depth_high": raw.get("queue_hi", 0),
            "write_queue_depth_low": raw.get("queue_lo", 0),
            "writes_claimed": raw.get("claimed", 0),
            "writes_blocked": raw.get("blocked", 0),
            "completions_undrained": raw.get("completed_undrained", 0),
            "failures_undrained": raw.get("failed_undrained", 0),
            "staging_holders_step": holders.get("step", 0),
            "staging_holders_task": holders.get("task", 0),
            "gpu_staged_bytes": raw.get("staged_bytes", 0),
            "pool_bytes": dict(raw.get("pool_key_bytes") or {}),
            "write_tasks_by_state": dict(raw.get("tasks_by_state") or {}),
            "mode": str(raw.get("mode", "")),
            "metrics": dict(raw.get("metrics") or {}),
        }
        return cls(**values)


# The manager's counters (historical ``stats()`` keys), kept under its state lock.
MANAGER_COUNTERS: tuple[str, ...] = (
    "query_requests",
    "query_tokens",
    "hit_requests",
    "hit_tokens",
    "steps_saved",
    "steps_materialized",
    "steps_discarded",
    "tokens_saved",
    "rows_committed",
    "failed_writes",
)

STAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CacheStats))

# One line per field: the metric's HELP text and the stats documentation.
FIELD_HELP: dict[str, str] = {
    "prefix_queries_requests_total": "New requests looked up in the prefix cache",
    "prefix_queries_tokens_total": "Prompt tokens of the new requests looked up",
    "prefix_hits_requests_total": "New requests that arrived with a prefix hit",
    "prefix_hits_tokens_total": "Prompt tokens served from the prefix cache",
    "steps_saved_total": "Steps saved (save_outputs)",
    "steps_materialized_total": "Steps materialized",
    "steps_discarded_total": "Steps discarded",
    "tokens_saved_total": "Tokens saved over all steps",
    "rows_committed_total": "Rows written into the CPU pool (rows x keys)",
    "failed_writes_total": "Pool writes that failed (each makes the manager sticky-failed)",
    "budget_flushes_total": "Deferred writes forced to copy because the GPU staging budget was full",
    "delivery_consumers_forgotten_total": "Delivery consumers forgotten (least recently seen) past the bound of 64",
    "live_requests": "Requests the manager tracks as live",
    "open_steps": "Saved steps not yet materialized or discarded",
    "sticky_failure": "1 once a write failed: every later facade call raises",
    "delivery_consumers": "Delivery consumers the manager remembers (a recovered hit waits for each)",
    "write_queue_depth_high": "Write tasks on the high-priority copy queue",
    "write_queue_depth_low": "Write tasks on the low-priority copy queue",
    "writes_claimed": "Write tasks claimed by the committer",
    "writes_blocked": "Write tasks waiting for an earlier write to the same slots",
    "completions_undrained": "Finished writes not yet drained by the engine thread",
    "failures_undrained": "Failed writes not yet drained by the engine thread",
    "staging_holders_step": "Staging-page holds by steps",
    "staging_holders_task": "Staging-page holds by write tasks",
    "gpu_staged_bytes": "Bytes of device clones charged to the GPU staging budget",
    "pool_bytes": "Bytes of the CPU pool slab, by key",
    "write_tasks_by_state": "Write tasks by lifecycle state",
    "mode": "Committer mode: eager, or <committer>:<copy engine>",
    "metrics": "Runtime metrics (move counts, time in state, data path) as count, sum, p50, p99",
}
