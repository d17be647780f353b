"""The manager's delivery entries (upstream's names), as a mixin.

``OmniPrefixCacheManager`` inherits these; each one delegates to the
manager's ``DeliveryDesk`` (``requests.delivery``), which runs the compiled
delivery operations of spec/protocol.yaml under the manager's state lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omni_prefix_cache.interface import ReqId, StageCacheOutputs
from omni_prefix_cache.requests.delivery import DeliveryDesk
from omni_prefix_cache.steps import validation as check

__all__ = ["DeliveryFacade"]


class DeliveryFacade:
    """Per-consumer delivery on a manager: ``delivery_view``,
    ``ack_delivery`` and ``commit_output``."""

    _delivery: DeliveryDesk

    def delivery_view(
        self, outputs: StageCacheOutputs, req_ids: Sequence[ReqId], *, consumer: str
    ) -> StageCacheOutputs:
        """The positions of ``req_ids`` in ``outputs`` (a materialize result)
        that ``consumer`` has not received, without acknowledging them
        (operation delivery_view). Any thread; the caller serialises view,
        consume and ack per consumer. Raises OmniPrefixCacheDeliveryGapError
        when positions before the output's range were never delivered."""
        return self._delivery.view(outputs, check.as_req_ids("delivery_view: req_ids", req_ids), consumer)

    def ack_delivery(self, outputs: StageCacheOutputs) -> None:
        """Record that the consumer of ``outputs`` (a delivery view) took its
        rows: each request's watermark moves to the view's end, in the tenure
        the rows were saved under (operation ack_delivery). Cache reads and
        writes are never delivery. A gap, or a view the manager did not
        issue as it stands, raises before any watermark moves; a view
        already acknowledged or committed is a no-op (a retried ack)."""
        self._delivery.ack(outputs)

    def commit_output(
        self,
        outputs: StageCacheOutputs,
        handoff: Callable[[frozenset[ReqId]], None],
        *,
        delivery: StageCacheOutputs | None = None,
    ) -> frozenset[ReqId]:
        """Drop retired tenures' requests, call ``handoff(live)`` and
        acknowledge ``delivery`` (a view of ``outputs``) for the live ones,
        all under the state lock (operation commit_output). ``handoff`` only
        publishes prepared payloads: no copies, waits or manager calls.
        Returns the live request ids."""
        return self._delivery.commit(outputs, handoff, delivery)
