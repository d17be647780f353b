"""Speculative decoding's two inputs, read from vLLM's objects by name.

``draft_counts`` turns a scheduler output's ``scheduled_spec_decode_tokens``
into the step's draft counts (the adapter's ``PrefixCacheStep.draft_tokens``);
``accepted_rows_of`` turns a ``ModelRunnerOutput`` into the accepted-rows
input of ``materialize``. Imports nothing heavy (no torch): the engine thread
and the output thread call them every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError

__all__ = ["accepted_rows_of", "draft_counts"]


def draft_counts(scheduled_spec_decode_tokens: Mapping[Any, Any]) -> tuple[tuple[str, int], ...]:
    """``(req_id, drafts)`` of vLLM's ``scheduled_spec_decode_tokens``
    (request id -> the draft token ids scheduled), requests with no draft
    left out. A placeholder id (-1: a draft vLLM fills in later, or one a
    grammar refused) is still a scheduled position, so it counts."""
    return tuple(
        (str(rid), len(ids)) for rid, ids in scheduled_spec_decode_tokens.items() if ids is not None and len(ids)
    )


def accepted_rows_of(model_runner_output: Any) -> dict[str, int]:
    """The accepted-rows input of ``materialize`` from a vLLM
    ``ModelRunnerOutput`` (or anything with its ``req_ids`` and
    ``sampled_token_ids``, aligned by batch row): per request,
    ``len(sampled_token_ids[i])``, the tokens its step sampled (its accepted
    drafts plus one). Raises the invalid-argument error when the two lists
    differ in length."""
    req_ids = list(getattr(model_runner_output, "req_ids", None) or ())
    sampled = list(getattr(model_runner_output, "sampled_token_ids", None) or ())
    if len(req_ids) != len(sampled):
        raise OmniPrefixCacheInvalidArgumentError(
            f"accepted_rows_of: {len(req_ids)} req_ids but {len(sampled)} sampled_token_ids rows"
        )
    return {str(rid): 0 if ids is None else len(ids) for rid, ids in zip(req_ids, sampled)}
