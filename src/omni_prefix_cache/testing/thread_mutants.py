"""The committer thread's mutants (its timed wait, operation ``linger`` of
spec/protocol.yaml), registered into the mutant catalogue by
``register`` (the catalogue passes its own ``_register`` and
``_set``, so this module imports nothing of it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

Register = Callable[..., Callable[[Callable[[contextlib.ExitStack], None]], Callable[..., None]]]
SetAttr = Callable[[contextlib.ExitStack, Any, str, Any], None]
# The generated protocol tests step a manual committer: tests/test_committer_idle.py judges these.
OUTSIDE = "the threaded committer's timed wait: the generated tests step a manual committer"


def register(register: Register, set_attr: SetAttr) -> None:
    """Register each mutant below with the catalogue."""

    @register(
        "committer_waits_only_for_kicks",
        "the committer thread waits for a kick with no linger: an idle engine's last writes never land",
        outside=OUTSIDE,
    )
    def _waits_only_for_kicks(stack: contextlib.ExitStack) -> None:
        # The loop before operation linger: an untimed wait, so work a save queued
        # after the last kick waits for a next new_step an idle engine never makes.
        from omni_prefix_cache.writes.committer import Committer

        def await_work(self: Committer, active: bool) -> bool:
            while not self.stopping and not self._queues.has_work():
                self._wake.wait()
            return True

        set_attr(stack, Committer, "_await_work", await_work)
