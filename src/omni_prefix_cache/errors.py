"""The library's error classes, in a module that imports nothing heavy.

``interface`` re-exports every one of them (upstream's import path), and
``adapter`` raises them without pulling in torch. All are
``OmniPrefixCacheUnmatchError``: a contract break, never a cache miss.
"""

from __future__ import annotations


class OmniPrefixCacheUnmatchError(RuntimeError):
    """A contract, configuration or KV-occupancy break. Never a miss.

    Raised for hits on absent slots, step ids consumed twice or never saved,
    steps larger than a staging page, failed writes, and every other broken
    rule; the message names the request, key, slots or step involved.
    """


class OmniPrefixCacheInvalidArgumentError(OmniPrefixCacheUnmatchError, ValueError):
    """A facade call was given a bad value (a negative count, a misaligned
    hit, a tensor with the wrong shape, dtype or device, ...).

    Raised before the call changes anything: the manager is exactly as it
    was, so the caller may fix the input and call again.
    """


class OmniPrefixCacheAcceptedRowsError(OmniPrefixCacheInvalidArgumentError):
    """Speculative decoding: the accepted rows given to ``materialize`` (or
    ``discard_step``) do not fit the step: a request the step scheduled
    drafts for has none (materialize), a count is past the request's drafts
    plus one, or a request is not in the step. The message names the step
    and the requests. Raised before the step is consumed: materialize it
    again with the counts, or discard it."""


class OmniPrefixCacheInvalidTypeError(OmniPrefixCacheInvalidArgumentError, TypeError):
    """A facade call was given a value of the wrong type (a float or bool
    where a count or step id belongs, a ``str`` where a list of request ids
    belongs, ...). Raised before the call changes anything."""


class OmniPrefixCacheWriteFailedError(OmniPrefixCacheUnmatchError):
    """A write of cached rows to the CPU pool failed. Sticky: rows behind
    block hashes vLLM already published never landed, so every later
    serving entry raises this error again.

    ``tid``, ``req_id``, ``keys`` and ``slots`` name the first failed write
    (None where unknown); ``req_ids`` every request whose rows it held (a
    step's write holds all of the step's requests, ``req_id`` the first);
    the underlying exception is ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        tid: int | None = None,
        req_id: str | None = None,
        keys: tuple[str, ...] = (),
        slots: tuple[int, ...] = (),
        req_ids: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.tid = tid
        self.req_id = req_id
        self.req_ids = req_ids if req_ids or req_id is None else (req_id,)
        self.keys = keys
        self.slots = slots

    def again(self) -> OmniPrefixCacheWriteFailedError:
        """A fresh error with the same details and cause, to raise from a
        later entry (one exception object is never raised on two threads)."""
        err = OmniPrefixCacheWriteFailedError(
            str(self), tid=self.tid, req_id=self.req_id, keys=self.keys, slots=self.slots, req_ids=self.req_ids
        )
        err.__cause__ = self.__cause__
        return err


class OmniPrefixCacheShutdownError(OmniPrefixCacheUnmatchError):
    """The manager was shut down before or during the call."""


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """A save waited for a free staging page and timed out."""


class OmniPrefixCacheJoinTimeoutError(OmniPrefixCacheUnmatchError):
    """A join (the save barrier, a budget flush, a hit read of rows not yet
    in the pool) waited ``staging_claim_timeout_s`` for a write that neither
    finished nor failed. The message names the task, its state and the
    writes in flight; nothing was registered by the call that joined."""
