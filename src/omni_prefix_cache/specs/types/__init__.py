# Generated from spec/*.yaml by `make typed-specs`; do not edit.
"""Typed state enums and trigger names generated from the specs (one module per spec)."""

from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger, CopyQueueTriggerName, QueuePosition
from omni_prefix_cache.specs.types.delivery import DeliveryState, DeliveryTrigger, DeliveryTriggerName
from omni_prefix_cache.specs.types.host_tier import HostTierTrigger, HostTierTriggerName, TierState
from omni_prefix_cache.specs.types.planned_read import PlannedReadTrigger, PlannedReadTriggerName, ReadState
from omni_prefix_cache.specs.types.request_lifecycle import (
    RequestLifecycleTrigger,
    RequestLifecycleTriggerName,
    RequestState,
)
from omni_prefix_cache.specs.types.slot_occupancy import SlotOccupancyTrigger, SlotOccupancyTriggerName, SlotState
from omni_prefix_cache.specs.types.staging_holder import HolderState, StagingHolderTrigger, StagingHolderTriggerName
from omni_prefix_cache.specs.types.step_context import StepContextTrigger, StepContextTriggerName, StepState
from omni_prefix_cache.specs.types.write_task import TaskState, WriteTaskTrigger, WriteTaskTriggerName

__all__ = [
    "CopyQueueTrigger",
    "CopyQueueTriggerName",
    "DeliveryState",
    "DeliveryTrigger",
    "DeliveryTriggerName",
    "HolderState",
    "HostTierTrigger",
    "HostTierTriggerName",
    "PlannedReadTrigger",
    "PlannedReadTriggerName",
    "QueuePosition",
    "ReadState",
    "RequestLifecycleTrigger",
    "RequestLifecycleTriggerName",
    "RequestState",
    "SlotOccupancyTrigger",
    "SlotOccupancyTriggerName",
    "SlotState",
    "StagingHolderTrigger",
    "StagingHolderTriggerName",
    "StepContextTrigger",
    "StepContextTriggerName",
    "StepState",
    "TaskState",
    "TierState",
    "WriteTaskTrigger",
    "WriteTaskTriggerName",
]
