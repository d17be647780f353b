"""How one controller runs its writes (see writes.committer for the kinds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CommitterKind = Literal["thread", "manual", "on_demand"]


@dataclass(eq=False)
class WriteMode:
    """Shared by a controller's parts: ``eager`` (dispatch runs copy and pool
    write inline, no committer) and the ``committer`` kind. Fixed at
    construction (compat's ``_eager`` setter aside)."""

    eager: bool
    committer: CommitterKind
