"""What one simulated scheduler step decides, shared by the synthetic
scheduler (``scheduler``) and the vLLM driver's (``vllm_scheduler``): each
request's share of the step (``Scheduled``), the step (``StepPlan``), the
run's counts (``SchedulerStats``) and what the engine loop needs of a
scheduler (``SimScheduler``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from omni_prefix_cache.tools.simulate.request import NewRequestData, SchedulerOutput

__all__ = ["Scheduled", "SchedulerStats", "SimScheduler", "StepPlan"]


# The scheduler's request type: SimRequest here, the vLLM driver's DriverRequest in simulate.vllm_engine.
R = TypeVar("R")


@dataclass
class Scheduled(Generic[R]):
    """One request's share of a step."""

    req: R
    n: int  # tokens computed this step
    start: int  # first position computed this step
    new_entry: NewRequestData | None  # set when it appears in scheduled_new_reqs
    manager_hit: int  # cached rows the manager must prepend (a prefix hit of a request it does not know)
    resumed: bool = False  # event form: back after a preemption, in scheduled_cached_reqs.resumed_req_ids
    new_blocks: list[int] | None = None  # event form: blocks allocated this step (all of them when resumed)
    drafts: tuple[int, ...] = ()  # speculative decoding: the draft tokens, the step's last positions
    accepted: int = 0  # how many of them the forward accepts (the first ``accepted`` are right)

    @property
    def accepted_end(self) -> int:
        """Where the step's valid rows end (its rejected drafts' rows come after)."""
        return self.start + self.n - len(self.drafts) + self.accepted

    @property
    def sampled(self) -> int:
        """``len(sampled_token_ids[i])`` of this request's step output (its accepted drafts plus one)."""
        return self.accepted + 1


@dataclass
class StepPlan(Generic[R]):
    step: int
    entries: list[Scheduled[R]]
    output: SchedulerOutput


@dataclass
class SchedulerStats:
    arrived: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    resumes: int = 0
    resumes_with_hit: int = 0
    stream_reentries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    same_step_hits: int = 0
    live_prefix_tokens: int = 0  # prefix blocks reused by live requests (resume): not manager hits
    prefill_tokens: int = 0
    decode_tokens: int = 0
    followups: int = 0
    reused_ids: int = 0  # a second turn arriving under its finished first turn's id
    duplicates: int = 0
    empty_steps: int = 0
    max_running: int = 0
    replacements: int = 0  # event form: REPLACED controls (a newer content generation of a running request)
    rollbacks: int = 0  # event form: requests preempted because their step's outputs were discarded
    draft_steps: int = 0  # speculative decoding: decode steps that carried drafts
    drafts: int = 0  # draft tokens scheduled
    drafts_accepted: int = 0
    hits_over_rejected: int = 0  # hits whose blocks once held a rejected draft's row


class SimScheduler(Protocol):
    """What the engine loop and the progress line use: :class:`Scheduler` or the vLLM driver's ``VllmScheduler``."""

    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def alloc(self) -> Any: ...  # ``alloc.stats`` is a dataclass the result reports
    @property
    def idle(self) -> bool: ...
    @property
    def running(self) -> Sequence[Any]: ...
    @property
    def waiting(self) -> Sequence[Any]: ...
    def progress(self) -> float: ...
    def live_requests(self) -> Sequence[Any]: ...
    def abort_all(self, step: int) -> None: ...
    def schedule(self, step: int) -> StepPlan[Any]: ...
    def update(self, plan: StepPlan[Any]) -> None: ...
