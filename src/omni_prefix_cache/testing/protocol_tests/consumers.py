"""The protocol tests' consumers: delivery_view, ack_delivery and
commit_output on the real manager, judged by the tenure oracle.

Two consumers take every materialized output: the talker when it is
materialized, the client later, from its inbox, in its own order. Each turn
is a view, then an acknowledgement, a commit of the view, nothing (a view
never acknowledged), a forged acknowledgement past the watermark, an
acknowledgement of the view edited to reach past what was saved, or a
commit of the view twice; or a view of the output edited to reach past what
was saved; or the consumer skips the output (every hostile one must be
refused and move nothing). ``Desk.take`` predicts each request's view from
the oracle (the output's expected range and the consumer's watermark), runs
the call and records every breach under the invariant it breaks, in
``errors`` (the checkers of ``checks.ProtocolChecks`` assert they are empty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import event

from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, StageCacheOutputs
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.requests.delivery import OmniPrefixCacheDeliveryGapError
from omni_prefix_cache.testing.protocol_tests.lifecycle import OracleTenure, TenureOracle

# What a consumer does with an output.
ACTIONS = ("ack", "ack", "commit", "drop", "skip", "forge", "edit", "recommit", "overreach")

DELIVERY_INVARIANTS = (
    "delivered_within_saved",
    "at_most_once_in_order",
    "gap_raises",
    "old_owner_never_moves_current",
    "discard_is_not_delivery",
    "resumed_hit_recovers",
)


@dataclass(eq=False)
class Output:
    """A materialized output, the oracle tenure of each of its requests and
    the range ``[start, end)`` the oracle expects it to hold per request."""

    sid: int
    outs: StageCacheOutputs
    tenures: dict[str, OracleTenure]
    expected: dict[str, tuple[int, int]]


Marks = dict[int, dict[str, int]]


def marks(tenures: Iterable[OracleTenure]) -> Marks:
    """Every runtime watermark of ``tenures``, by tenure."""
    return {id(t): dict(t.runtime.delivered_upto) for t in tenures if t.runtime is not None}


class Desk:
    """The consumers' calls and their judgement (see the module docstring)."""

    def __init__(self, mgr: OmniPrefixCacheManager, oracle: TenureOracle, errors: dict[str, list[str]]) -> None:
        self.mgr = mgr
        self.every = oracle.every  # every tenure the oracle opened
        self.consumers = oracle.consumers  # every consumer that asked for a view
        self.errors = errors
        self.inbox: list[Output] = []  # the client's, oldest first

    def _err(self, invariant: str, message: str) -> None:
        self.errors[invariant].append(message)

    def unmoved(self, before: Marks, invariant: str, what: str) -> None:
        """No runtime watermark moved since ``before``."""
        after = marks(self.every)
        for t in self.every:
            if t.runtime is not None and after.get(id(t), {}) != before.get(id(t), {}):
                self._err(invariant, f"{what} moved {t}'s watermarks {before.get(id(t))} -> {after.get(id(t))}")

    def agree(self, out: Output, what: str) -> None:
        """Every runtime watermark is the oracle's: one of ``out``'s tenures
        otherwise breaks at-most-once-in-order, any other tenure (a current
        one under a retired one's output) the old-owner rule."""
        mine = {id(t) for t in out.tenures.values()}
        for t in self.every:
            if t.runtime is None:
                continue
            got = {c: w for c, w in t.runtime.delivered_upto.items() if w}
            want = {c: w for c, w in t.wm.items() if w}
            if got != want:
                inv = "at_most_once_in_order" if id(t) in mine else "old_owner_never_moves_current"
                self._err(inv, f"after {what}: {t} has runtime watermarks {got}, the oracle {want}")
                t.wm = dict(got)  # report once

    # ------------------------------------------------------------ one turn

    def take(self, out: Output, consumer: str, action: str) -> None:
        """``consumer``'s turn on ``out`` (see the module docstring)."""
        if action == "skip":
            return
        rids = list(out.expected)
        what = f"step {out.sid} {consumer}"
        if action == "overreach":
            self._overreaching_view(out, rids[0], consumer, what)
            return

        def gap(rid: str) -> bool:
            # A retired tenure's view has no gap to raise: across one it selects nothing.
            start, end = out.expected[rid]
            seen = out.tenures[rid].wm.get(consumer, 0)
            return start > seen and end > seen and not out.tenures[rid].retired

        if any(gap(r) for r in rids):
            event("a delivery view crossed a gap")
            self._refused_view(out, rids, consumer, gap, what)
            rids = [r for r in rids if not gap(r)]
            if not rids:
                return
        before = marks(self.every)
        self.consumers.add(consumer)
        try:
            view = self.mgr.delivery_view(out.outs, rids, consumer=consumer)
        except OmniPrefixCacheDeliveryGapError as exc:
            self._err("gap_raises", f"{what}: delivery_view of {rids} raised with no gap: {exc}")
            return
        for rid in rids:
            tenure = out.tenures[rid]
            if tenure.retired:
                event(f"a retired tenure's output: {action}")
            elif out.expected[rid][0] < tenure.wm.get(consumer, 0) < out.expected[rid][1]:
                event("a view clipped below the watermark")
            self._check_view(out, view, rid, consumer, what)
        self.unmoved(before, "discard_is_not_delivery", f"{what}: delivery_view (never an acknowledgement)")
        if action == "ack":
            self.mgr.ack_delivery(view)
            self._acked(out, view, rids, consumer)
        elif action == "commit":
            self._commit(out, view, rids, consumer, what)
        elif action == "forge":
            self._forged_ack(out, view, rids, consumer, what)
        elif action == "edit":
            self._edited_ack(out, view, rids, consumer, what)
        elif action == "recommit":
            self._commit(out, view, rids, consumer, what)
            self._second_commit(out, view, what)
        else:  # drop: the view is never acknowledged
            self.unmoved(before, "discard_is_not_delivery", f"{what}: a view never acknowledged")
        self.agree(out, f"{what} {action}")

    def _refused_view(self, out: Output, rids: list[str], consumer: str, gap: Any, what: str) -> None:
        before = marks(self.every)
        self.consumers.add(consumer)  # seen before the view's first request is checked
        try:
            self.mgr.delivery_view(out.outs, rids, consumer=consumer)
        except OmniPrefixCacheDeliveryGapError:
            pass
        else:
            bad = [r for r in rids if gap(r)]
            self._err("gap_raises", f"{what}: delivery_view crossed a gap for {bad} ({[out.tenures[r] for r in bad]})")
        self.unmoved(before, "gap_raises", f"{what}: a refused delivery_view")

    def _check_view(self, out: Output, view: StageCacheOutputs, rid: str, consumer: str, what: str) -> None:
        start, end = out.expected[rid]
        seen = out.tenures[rid].wm.get(consumer, 0)
        want = (min(end, max(start, seen)), end)
        if out.tenures[rid].retired and start > seen and end > seen:
            want = (end, end)  # a retired tenure's gap: the view selects nothing
        got = view.token_ranges.get(rid)
        if got is None or got != want:
            if got is not None and got[0] < seen and got[1] > got[0]:
                self._err("at_most_once_in_order", f"{what}: view of {rid} {got} re-delivers below watermark {seen}")
            else:
                self._err("at_most_once_in_order", f"{what}: view of {rid} is {got}, expected {want}")
            return
        hidden, full = view.hidden_states, out.outs.hidden_states
        if hidden is not None and full is not None:
            rows = full[rid][want[0] - start :]
            if hidden[rid].shape != rows.shape or not torch.equal(hidden[rid], rows):
                self._err("at_most_once_in_order", f"{what}: view of {rid} does not hold positions {want}")

    def _acked(self, out: Output, view: StageCacheOutputs, rids: Iterable[str], consumer: str) -> None:
        for rid in rids:
            tenure = out.tenures[rid]
            start, end = view.token_ranges[rid]
            # Only a range that continues the watermark moves it (a retired
            # tenure's empty view past its gap does not).
            if end > tenure.wm.get(consumer, 0) and start <= tenure.wm.get(consumer, 0):
                tenure.wm[consumer] = end

    def _commit(self, out: Output, view: StageCacheOutputs, rids: list[str], consumer: str, what: str) -> None:
        handed: list[frozenset[str]] = []
        live = self.mgr.commit_output(out.outs, handed.append, delivery=view)
        want = frozenset(r for r in out.expected if not out.tenures[r].retired)
        if handed != [live]:
            self._err("old_owner_never_moves_current", f"{what}: commit handed off {handed}, returned {set(live)}")
        stale = sorted(live - want)
        if stale:
            self._err("old_owner_never_moves_current", f"{what}: commit handed off retired tenures {stale}")
        if want - live:
            self._err("at_most_once_in_order", f"{what}: commit dropped live requests {sorted(want - live)}")
        self._acked(out, view, [r for r in rids if r in want], consumer)

    def _forged_ack(self, out: Output, view: StageCacheOutputs, rids: list[str], consumer: str, what: str) -> None:
        """An acknowledgement whose range starts past the watermark (a view
        the manager never made): it must raise and move nothing (of a retired
        tenure it need not raise, and still moves nothing)."""
        rid = rids[0]
        seen = out.tenures[rid].wm.get(consumer, 0)
        forged = dataclasses.replace(view, token_ranges={rid: (seen + 1, seen + 3)})
        before = marks(self.every)
        try:
            self.mgr.ack_delivery(forged)
        except OmniPrefixCacheDeliveryGapError:
            pass
        except OmniPrefixCacheInvalidArgumentError as exc:  # refused as a view never issued (checked after the gap)
            if not out.tenures[rid].retired:
                self._err("gap_raises", f"{what}: an acknowledgement past the watermark {seen} was no gap: {exc}")
        else:
            if not out.tenures[rid].retired:
                self._err(
                    "gap_raises", f"{what}: an acknowledgement of [{seen + 1}, {seen + 3}) past {seen} did not raise"
                )
        self.unmoved(before, "gap_raises", f"{what}: a refused acknowledgement")

    def _edited_ack(self, out: Output, view: StageCacheOutputs, rids: list[str], consumer: str, what: str) -> None:
        """The issued view, edited in place to reach 5 positions past its
        end (past what was saved): refused, nothing moves; the view as
        issued is then acknowledged."""
        rid = rids[0]
        start, end = view.token_ranges[rid]
        view.token_ranges[rid] = (start, end + 5)
        before = marks(self.every)
        try:
            self.mgr.ack_delivery(view)
        except OmniPrefixCacheInvalidArgumentError:
            pass
        else:
            self._err(
                "delivered_within_saved", f"{what}: an edited view [{start}, {end + 5}) of {rid} was acknowledged"
            )
            self.unmoved(before, "delivered_within_saved", f"{what}: an edited view's acknowledgement")
            return
        self.unmoved(before, "delivered_within_saved", f"{what}: a refused edited view")
        view.token_ranges[rid] = (start, end)
        self.mgr.ack_delivery(view)
        self._acked(out, view, rids, consumer)

    def _second_commit(self, out: Output, view: StageCacheOutputs, what: str) -> None:
        """The same view committed again: a no-op that hands off nothing
        (the handoff gets an empty set) and returns an empty set."""
        handed: list[frozenset[str]] = []
        before = marks(self.every)
        live = self.mgr.commit_output(out.outs, handed.append, delivery=view)
        if live or any(handed):
            self._err("at_most_once_in_order", f"{what}: a second commit of one view handed off {live} {handed}")
        self.unmoved(before, "at_most_once_in_order", f"{what}: a second commit")

    def _overreaching_view(self, out: Output, rid: str, consumer: str, what: str) -> None:
        """A view of the output with ``rid``'s range edited to end 5 past
        what its tenure saved: refused, nothing moves and no consumer is added."""
        start, end = out.outs.token_ranges[rid]
        bound = out.tenures[rid].bound()
        edited = dataclasses.replace(out.outs, token_ranges={**out.outs.token_ranges, rid: (start, bound + 5)})
        before = marks(self.every)
        self.consumers.add(consumer)  # a refused view still registers its consumer
        try:
            self.mgr.delivery_view(edited, [rid], consumer=consumer)
        except (OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheDeliveryGapError):
            pass  # refused (past what was saved: the refusal comes before the gap check)
        else:
            self._err("delivered_within_saved", f"{what}: a view of {rid} reaching {bound + 5} past {bound} was issued")
        self.unmoved(before, "delivered_within_saved", f"{what}: a view past what was saved")

    # ------------------------------------------------------------ checks

    def within_saved(self) -> None:
        """delivered_within_saved over every tenure the oracle opened."""
        for t in self.every:
            if t.runtime is None:
                continue
            for consumer, mark in t.runtime.delivered_upto.items():
                assert mark <= t.bound(), (
                    f"{t}: consumer {consumer} delivered up to {mark}, past what was saved ({t.saved}) "
                    f"or served ({t.served})"
                )
