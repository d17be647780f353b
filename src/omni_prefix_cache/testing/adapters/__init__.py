"""Adapters that play the specs against the real runtime objects, one
module per spec:

- ``WriteTaskAdapter``: ``write_task`` on ``omni_prefix_cache.writes.write_task.WriteTask``.
- ``StagingHolderAdapter``: ``staging_holder`` on ``StagingBufferPool``.
- ``SlotOccupancyAdapter``: ``slot_occupancy`` on ``SlotOccupancy``.
- ``StepContextAdapter``: ``step_context`` on ``OmniPrefixCacheManager``.
- ``PlannedReadAdapter``: ``planned_read`` on ``PlannedReads``.
- ``CopyQueueAdapter``: ``copy_queue`` on ``CopyQueues``.
- ``RequestLifecycleAdapter``: ``request_lifecycle`` on a ``Tenure`` in a ``RequestTable``.
- ``DeliveryAdapter``: ``delivery`` on a ``Tenure``'s consumer watermarks.
- ``HostTierAdapter``: ``host_tier`` on ``HostTier``.

Each maps a trigger to the runtime call(s) that fire it (several APIs per
trigger where the runtime has them, drawn at random), reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime.
"""

from __future__ import annotations

from omni_prefix_cache.testing.adapters.copy_queue import CopyQueueAdapter as CopyQueueAdapter
from omni_prefix_cache.testing.adapters.delivery import DeliveryAdapter as DeliveryAdapter
from omni_prefix_cache.testing.adapters.host_tier import HostTierAdapter as HostTierAdapter
from omni_prefix_cache.testing.adapters.planned_read import PlannedReadAdapter as PlannedReadAdapter
from omni_prefix_cache.testing.adapters.request_lifecycle import RequestLifecycleAdapter as RequestLifecycleAdapter
from omni_prefix_cache.testing.adapters.slot_occupancy import SlotOccupancyAdapter as SlotOccupancyAdapter
from omni_prefix_cache.testing.adapters.staging_holder import StagingHolderAdapter as StagingHolderAdapter
from omni_prefix_cache.testing.adapters.step_context import StepContextAdapter as StepContextAdapter
from omni_prefix_cache.testing.adapters.write_task import WriteTaskAdapter as WriteTaskAdapter
