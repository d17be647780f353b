"""The private names upstream's tests read or wrap, as aliases of the
components that own them. Nothing in the runtime calls them.

Most are always there (mixins of the manager, the controller and WriteTask).
One behaviour is opt-in: ``install_upstream_seams()`` makes every manager
built afterwards cut a step's immediate rows into one write per request
while upstream's tests wrap a per-request seam (``compat.registration``).
Upstream's suite (tests/test_seed_suite.py) and the vLLM plugin's alias mode
(with ``OMNI_PREFIX_CACHE_UPSTREAM_SEAMS=1``)
install it; a production manager built without it registers one write per
step and never looks for a wrapped seam.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install_upstream_seams", "uninstall_upstream_seams", "upstream_seams", "upstream_seams_installed"]


# The imports are deferred: the runtime imports this package's mixins while
# it is itself being imported, and the strategy needs the runtime built.
def install_upstream_seams() -> bool:
    """Managers built from now on serve upstream's per-request seams
    (compat's registration strategy). Idempotent; any thread, not while a
    manager is being built. Returns True if this call installed them."""
    from omni_prefix_cache.compat import registration

    return registration.install()


def uninstall_upstream_seams() -> None:
    """Managers built from now on are production ones again (those built
    before keep their strategy). Idempotent."""
    from omni_prefix_cache.compat import registration

    registration.uninstall()


def upstream_seams_installed() -> bool:
    """Whether managers built now serve upstream's per-request seams."""
    from omni_prefix_cache.compat import registration

    return registration.installed()


@contextmanager
def upstream_seams() -> Iterator[None]:
    """Upstream's seams installed for the block; uninstalled after it unless
    they were installed before it (a test module's fixture)."""
    installed_here = install_upstream_seams()
    try:
        yield
    finally:
        if installed_here:
            uninstall_upstream_seams()
