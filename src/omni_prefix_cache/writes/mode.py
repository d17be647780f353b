"""How one controller runs its writes (see writes.committer for the kinds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

CommitterKind = Literal["thread", "manual", "on_demand"]


@dataclass(eq=False)
class WriteMode:
    """Shared by a controller's parts: ``eager`` (dispatch runs copy and pool
    write inline, no committer) and the ``committer`` kind. Fixed at
    construction; only upstream tests switch ``eager`` afterwards (compat).

    ``wrapped_seams``: the per-request seams (``_scatter``, ``_run_eager``)
    an upstream test replaced on this controller (compat sets it); while
    any is, each request's immediate rows are their own write, so such a
    wrapper sees one request per task. Read once per save."""

    eager: bool
    committer: CommitterKind
    wrapped_seams: set[str] = field(default_factory=set)
