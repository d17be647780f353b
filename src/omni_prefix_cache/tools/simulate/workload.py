"""Synthetic serving traces: who arrives when, with which prompt, and how it ends.

A trace is a pure function of its :class:`WorkloadConfig` and seed. It mixes
the request shapes a prefix cache has to survive: shared system prompts,
identical prompts arriving in the same step, streamed prompts that arrive in
segments (the request re-enters the new-request list for each segment),
aborts, and two-turn conversations whose second turn repeats the first turn's
prompt and answer. Output tokens are not part of the trace: the engine derives
them deterministically from the request and position as it samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of a synthetic trace."""

    arrival_steps: int = 500  # requests arrive during steps [0, arrival_steps)
    arrivals_per_step: float = 0.45  # mean (Bernoulli per sub-slot, up to 3 per step)
    vocab: int = 32000
    num_system_prompts: int = 4
    system_len: tuple[int, int] = (40, 200)
    user_len: tuple[int, int] = (4, 180)
    output_len: tuple[int, int] = (1, 40)
    p_system: float = 0.85  # prompt starts with one of the shared system prompts
    p_duplicate: float = 0.10  # an identical prompt arrives in the same step
    p_stream: float = 0.12  # prompt arrives in 2-3 segments
    p_abort: float = 0.08  # aborted some steps after arrival
    p_followup: float = 0.20  # a second turn arrives after the first finishes
    p_reuse_id: float = 0.3  # of those, the share that reuses the first turn's request id
    segment_gap: tuple[int, int] = (1, 6)  # steps between a segment finishing and the next arriving
    abort_after: tuple[int, int] = (1, 30)
    followup_delay: tuple[int, int] = (0, 8)


@dataclass(frozen=True)
class FollowupSpec:
    """Second turn: parent's prompt + parent's answer + ``extra`` tokens."""

    delay: int
    extra: tuple[int, ...]
    max_output: int
    reuse_id: bool = False  # arrive under the first turn's (finished) request id


@dataclass(frozen=True)
class RequestSpec:
    """One request of the trace. ``segments`` concatenate to the prompt."""

    req_id: str
    arrival_step: int
    segments: tuple[tuple[int, ...], ...]
    max_output: int
    segment_gap: int = 0
    abort_after: int | None = None
    followup: FollowupSpec | None = None
    duplicate_of: str | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return tuple(t for seg in self.segments for t in seg)


def _split(tokens: list[int], rng: random.Random) -> tuple[tuple[int, ...], ...]:
    if len(tokens) < 4:
        return (tuple(tokens),)
    parts = rng.randint(2, 3)
    cuts = sorted(rng.sample(range(1, len(tokens)), min(parts - 1, len(tokens) - 1)))
    bounds = [0, *cuts, len(tokens)]
    return tuple(tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a)


def generate_trace(cfg: WorkloadConfig, seed: int) -> list[RequestSpec]:
    """All first-turn requests of the trace, ordered by arrival step."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(cfg.vocab) for _ in range(n)]

    systems = [toks(rng.randint(*cfg.system_len)) for _ in range(cfg.num_system_prompts)]
    out: list[RequestSpec] = []
    n = 0
    for step in range(cfg.arrival_steps):
        arrivals = sum(rng.random() < cfg.arrivals_per_step / 3 for _ in range(3))
        for _ in range(arrivals):
            prompt = (rng.choice(systems) if rng.random() < cfg.p_system else []) + toks(rng.randint(*cfg.user_len))
            stream = rng.random() < cfg.p_stream
            segments = _split(prompt, rng) if stream else (tuple(prompt),)
            followup = None
            if rng.random() < cfg.p_followup:
                followup = FollowupSpec(
                    delay=rng.randint(*cfg.followup_delay),
                    extra=tuple(toks(rng.randint(*cfg.user_len))),
                    max_output=rng.randint(*cfg.output_len),
                    reuse_id=rng.random() < cfg.p_reuse_id,
                )
            spec = RequestSpec(
                req_id=f"r{n}",
                arrival_step=step,
                segments=segments,
                max_output=rng.randint(*cfg.output_len),
                segment_gap=rng.randint(*cfg.segment_gap) if len(segments) > 1 else 0,
                abort_after=rng.randint(*cfg.abort_after) if rng.random() < cfg.p_abort else None,
                followup=followup,
            )
            out.append(spec)
            n += 1
            if rng.random() < cfg.p_duplicate:
                out.append(
                    RequestSpec(
                        req_id=f"r{n}",
                        arrival_step=step,
                        segments=(spec.prompt,),
                        max_output=rng.randint(*cfg.output_len),
                        duplicate_of=spec.req_id,
                    )
                )
                n += 1
    return out
