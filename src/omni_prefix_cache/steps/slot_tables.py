"""Slot occupancy's tables and the rows one vectorised move works on.

``KeySlots`` are one pool key's tensors (what ``get_slot_status`` returns),
``KeyArrays`` their numpy views, ``SlotGroup`` the rows of one move that
share a source state; ``check_tables`` checks the spec's owner invariants
over them. Pure data and a check; the moves are ``slot_occupancy``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, TensorName, Tid
from omni_prefix_cache.steps.slot_tags import OWNED, rows_tagged
from omni_prefix_cache.steps.validation import listed

__all__ = ["NO_OWNER", "KeyArrays", "KeySlots", "SlotGroup", "check_tables"]

NO_OWNER = -1


class SlotGroup(NamedTuple):
    """The rows of one vectorised move that share a source state; ``owners``
    per row (map's new owner, commit/drop's writer) or 0-d, one for all;
    ``tenancy``: the rejecting save's tenancy (reject), else -1."""

    key: TensorName
    slots: np.ndarray  # int64 KV slot ids
    owners: np.ndarray  # int64 tids, same length as slots, or 0-d (one for all)
    tenancy: int = -1


@dataclass(eq=False)
class KeySlots:
    """The occupancy tables of one pool key (what ``get_slot_status`` returns)."""

    state: torch.Tensor  # int8 SlotState per slot
    tids: torch.Tensor  # int64 owner tid per slot, -1 when not IN_TRANSIT
    slot_version: torch.Tensor  # int64, +1 per reuse of a committed slot
    writer: torch.Tensor  # int64 tenancy (save) that last mapped the slot, -1 when none


class KeyArrays(NamedTuple):
    """Numpy views of one key's tables (the moves write through them)."""

    state: np.ndarray
    tids: np.ndarray
    slot_version: np.ndarray
    writer: np.ndarray


def check_tables(tables: Mapping[TensorName, KeySlots], live_tids: set[Tid] | None) -> None:
    """Raise OmniPrefixCacheUnmatchError naming the key and slots that break
    ``owner_iff_in_transit``, or ``owner_is_live_task`` given ``live_tids``."""
    for key, table in tables.items():
        in_transit = rows_tagged(table.state, OWNED)
        owned = table.tids != NO_OWNER
        bad = (in_transit != owned).nonzero().flatten()
        if bad.numel():
            raise OmniPrefixCacheUnmatchError(
                f"slot occupancy {key!r}: owner_iff_in_transit broken at slots {listed(bad)}"
            )
        if live_tids is not None and bool(in_transit.any()):
            dead = sorted(set(table.tids[in_transit].tolist()) - set(live_tids))
            if dead:
                raise OmniPrefixCacheUnmatchError(
                    f"slot occupancy {key!r}: owner_is_live_task broken: owners {listed(dead)} are not live"
                )
