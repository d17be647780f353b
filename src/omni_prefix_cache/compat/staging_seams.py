"""The staging claim's upstream spelling that the seed suite
(tests/test_seed_suite.py) reads: ``staging_slot``, the page number a
step's rows landed in (``StepD2HClaim.page``)."""

from __future__ import annotations


class UpstreamClaimSeams:
    """Mixin of StepD2HClaim: upstream's ``staging_slot`` for ``page``."""

    page: int

    @property
    def staging_slot(self) -> int:
        """The staging page the step's rows landed in (``page``)."""
        return self.page
