"""A save's registration strategy: how its step's immediate rows are cut into writes.

The runtime's strategy is ``one_step_write``: one JOIN_NEXT_STEP write holding
every request's immediate rows, its requests kept as state arrays on the task.
The strategy is chosen once, when a write ledger is built (``strategy_for``),
never per save: a factory installed then (``install_factory``) builds the
ledger's own, else the ledger gets ``one_step_write``. The one factory the
package installs is compat's (``omni_prefix_cache.compat.install_upstream_seams``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from omni_prefix_cache.interface import ReqId

if TYPE_CHECKING:
    from omni_prefix_cache.controller import OmniPrefixCacheController

# The writes of one step's immediate rows: per write, its requests (in step
# order) and their row counts; the writes' rows follow each other in step order.
Units = list[tuple[Sequence[ReqId], Sequence[int]]]


class RegistrationStrategy(Protocol):
    """Cuts a step's scheduled requests (``req_order``, their row counts
    ``sizes``) into its immediate writes. Called once per save, state lock
    held; must keep step order and cover every request exactly once."""

    def __call__(self, req_order: Sequence[ReqId], sizes: Sequence[int]) -> Units: ...


# Builds the strategy of a ledger over ``controller``'s writes.
StrategyFactory = Callable[["OmniPrefixCacheController"], RegistrationStrategy]


def one_step_write(req_order: Sequence[ReqId], sizes: Sequence[int]) -> Units:
    """The runtime's strategy: every request's rows in one write."""
    return [(req_order, sizes)]


class _Installed:
    """The factory ledgers built from now on use (None: ``one_step_write``)."""

    factory: StrategyFactory | None = None


def install_factory(factory: StrategyFactory | None) -> StrategyFactory | None:
    """Ledgers built from now on get ``factory(controller)`` as their
    strategy (None: ``one_step_write`` again); ledgers built before keep
    theirs. Returns the factory it replaced. Any thread; not for a hot path."""
    previous, _Installed.factory = _Installed.factory, factory
    return previous


def installed_factory() -> StrategyFactory | None:
    """The factory ``strategy_for`` uses now (None: none installed)."""
    return _Installed.factory


def strategy_for(controller: OmniPrefixCacheController) -> RegistrationStrategy:
    """The strategy of a ledger built now over ``controller``'s writes."""
    factory = _Installed.factory
    return one_step_write if factory is None else factory(controller)
