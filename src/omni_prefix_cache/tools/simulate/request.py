"""The simulated scheduler's output and request types.

``SchedulerOutput`` carries the fields the prefix cache reads from vLLM's
scheduler output, in the seed-era form and the newest upstream event form
(see ``simulate.scheduler``); ``SimRequest`` is the engine-side state of one
request (its tokens, prefix hashes, blocks and owner).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from omni_prefix_cache.adapter import PrefixCacheRequestEvent, PrefixCacheRequestOwner
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, block_hash, chain_hash, mix64
from omni_prefix_cache.tools.simulate.workload import RequestSpec


class Status(enum.Enum):
    WAITING = "waiting"  # not holding blocks: new, or preempted
    RUNNING = "running"  # holds blocks, has tokens to compute
    AWAITING_INPUT = "awaiting_input"  # holds blocks, streamed prompt: next segment not here yet
    DONE = "done"


@dataclass(frozen=True)
class NewRequestData:
    """The fields of vLLM's NewRequestData the manager reads."""

    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True)
class CachedRequestData:
    """The fields of vLLM's CachedRequestData the adapter reads: per listed
    request its computed tokens and the blocks allocated this step (all of
    them for a resumed request)."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    """The fields of vLLM's SchedulerOutput the manager and the adapter read
    (the event-form ones stay empty in the seed-era form)."""

    scheduled_new_reqs: list[NewRequestData]
    finished_req_ids: set[str]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: CachedRequestData | None = None
    prefix_cache_owners: dict[str, PrefixCacheRequestOwner] = field(default_factory=dict)
    prefix_cache_replacements: tuple[PrefixCacheRequestEvent, ...] = ()
    prefix_cache_terminal_owners: dict[str, PrefixCacheRequestOwner] = field(default_factory=dict)
    aborted_req_ids: set[str] = field(default_factory=set)
    prefix_cache_step_sequence: int | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # speculative decoding

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class SimRequest:
    """Engine-side state of one request."""

    def __init__(self, spec: RequestSpec, block_size: int, seed: int, vocab: int) -> None:
        self.spec = spec
        self.req_id = spec.req_id
        self.block_size = block_size
        self.vocab = vocab
        self.salt = chain_hash(seed + 1, spec.req_id.encode())
        self.tokens: list[int] = []
        self.hashes = PrefixHashes(sum(len(s) for s in spec.segments) + spec.max_output + 8)
        self.block_hashes: list[int] = []
        self.segments_revealed = 0
        self.computed = 0
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.num_output = 0
        self.status = Status.WAITING
        self.live = False  # the manager saw it as new and has not been told it finished
        self.emit_new = True  # next time it is scheduled it goes in scheduled_new_reqs
        self.next_segment_step: int | None = None
        self.abort_step = None if spec.abort_after is None else spec.arrival_step + spec.abort_after
        self.preempted = False
        self.aborted = False
        self.owner = PrefixCacheRequestOwner(0)  # the scheduler sets the admission id at arrival
        self.generation = 0  # content generation (a replacement bumps it)
        self.reveal_segment()

    def replace_content(self, tokens: list[int]) -> None:
        """A newer generation of the request: ``tokens`` is its whole prompt
        (revealed at once), nothing is computed or sampled yet."""
        self.tokens = []
        self.hashes = PrefixHashes(len(tokens) + self.spec.max_output + 8)
        self.block_hashes = []
        self.segments_revealed = len(self.spec.segments)
        self.next_segment_step = None
        self.num_output = 0
        self.generation += 1
        self.owner = PrefixCacheRequestOwner(self.owner.admission_id, self.generation)
        self.append_tokens(tokens)

    @property
    def pending(self) -> int:
        """Known tokens not computed yet."""
        return len(self.tokens) - self.computed

    @property
    def more_segments(self) -> bool:
        return self.segments_revealed < len(self.spec.segments)

    def reveal_segment(self) -> None:
        self.append_tokens(self.spec.segments[self.segments_revealed])
        self.segments_revealed += 1
        self.next_segment_step = None

    def append_tokens(self, toks: tuple[int, ...] | list[int]) -> None:
        self.tokens.extend(toks)
        self.hashes.extend(toks)
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(block_hash(parent, self.tokens[i * bs : (i + 1) * bs]))

    def next_token(self, position: int) -> int:
        """The token this request samples at ``position`` (a function of request and position)."""
        return mix64(self.salt ^ (position * 0x9E3779B1)) % self.vocab

    def sample(self) -> None:
        """Append the next output token."""
        self.append_tokens([self.next_token(len(self.tokens))])
        self.num_output += 1
