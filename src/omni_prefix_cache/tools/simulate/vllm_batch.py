"""vLLM's real ``InputBatch`` kept current as its GPU model runner keeps it,
and the project's group view over it (``simulate --engine vllm``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from omni_prefix_cache.tools.simulate.batch import SimGroupView
from omni_prefix_cache.tools.simulate.engine import SimConfig
from omni_prefix_cache.tools.simulate.vllm_setup import VllmOptions


class RunnerBatch:
    """A real ``InputBatch`` kept current as vLLM's GPU model runner does in ``_update_states``.

    Only the parts that decide row order, block table rows and computed
    token counts are mirrored; sampling metadata is left as ``add_request``
    sets it.
    """

    def __init__(
        self,
        cfg: SimConfig,
        opts: VllmOptions,
        v: SimpleNamespace,
        max_model_len: int,
        kv_cache_config: Any = None,
        vllm_config: Any = None,
    ) -> None:
        """One block table per KV cache group of ``kv_cache_config`` (with ``vllm_config``),
        sized as the GPU runner's ``may_reinitialize_input_batch`` sizes them; one group of
        ``cfg``'s blocks without."""
        self.v, self.opts = v, opts
        self.requests: dict[str, Any] = {}  # req id -> CachedRequestState
        sizes, widths, modes = [cfg.block_size], [cfg.num_blocks], [v.SlotMappingMode.TOKEN_TO_KV_SLOT]
        if kv_cache_config is not None:
            specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
            sizes = [s.block_size for s in specs]
            widths = [s.max_num_blocks_per_req(vllm_config, max_model_len) for s in specs]
            mamba = v.SlotMappingMode.NONE
            modes = [mamba if isinstance(s, v.MambaSpec) else v.SlotMappingMode.TOKEN_TO_KV_SLOT for s in specs]
        self.input_batch = v.InputBatch(
            max_num_reqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=cfg.token_budget,
            device=torch.device("cpu"),
            vocab_size=opts.vocab,
            block_sizes=sizes,
            max_num_blocks_per_req=widths,
            slot_mapping_modes=modes,
        )
        self.reordered = 0
        # A decode step with speculative drafts computes 1 + drafts tokens (the backends' threshold grows so).
        self.spec_tokens = cfg.spec_tokens

    def _state(self, new: Any) -> Any:
        return self.v.CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            mm_features=new.mm_features,
            sampling_params=new.sampling_params,
            generator=None,
            block_ids=tuple(list(g) for g in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
        )

    def update_states(self, so: Any) -> list[str]:
        """Apply one scheduler output; return the batch's request ids in row order."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        # An id both finished and new is an aborted request resubmitted under the same id:
        # two distinct requests (vLLM's NOTE in _update_states).
        for rid in so.finished_req_ids:
            batch.remove_request(rid)
        cached = so.scheduled_cached_reqs
        unscheduled = set(batch.req_id_to_index) - (set(so.num_scheduled_tokens) - set(cached.resumed_req_ids))
        for rid in unscheduled:
            batch.remove_request(rid)
        to_add: list[Any] = []
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                # Streaming continuation, or (Model Runner V2) a resumed request: same id, new row.
                batch.remove_request(new.req_id)
                state.block_ids = tuple(list(g) for g in new.block_ids)
                state.num_computed_tokens = new.num_computed_tokens
            else:
                state = self.requests[new.req_id] = self._state(new)
            to_add.append(state)
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            index = batch.req_id_to_index.get(rid)
            if rid in cached.resumed_req_ids:
                if index is not None or new_blocks is None:
                    raise AssertionError(f"resumed request {rid!r}: row {index}, new blocks {new_blocks}")
                state.block_ids = tuple(list(g) for g in new_blocks)
            elif new_blocks is not None:
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        if self.opts.reorder_threshold is not None and batch.req_ids:
            self.reordered += bool(
                self.v.reorder_batch_to_split_decodes_and_prefills(
                    batch, so, decode_threshold=self.opts.reorder_threshold + self.spec_tokens
                )
            )
        batch.refresh_metadata()
        return [r for r in batch.req_ids if r is not None]

    def record_sampled(self, sampled: dict[str, list[int]]) -> None:
        """The runner's bookkeeping after sampling: append each request's
        sampled tokens (with speculative decoding, its accepted drafts and the
        token after them) to its request and row."""
        batch = self.input_batch
        for rid, toks in sampled.items():
            state = self.requests.get(rid)
            if state is None:
                continue
            state.output_token_ids.extend(toks)
            index = batch.req_id_to_index.get(rid)
            if index is not None:
                end = int(batch.num_tokens_no_spec[index])
                batch.token_ids_cpu[index, end : end + len(toks)] = toks
                batch.is_token_ids[index, end : end + len(toks)] = True
                batch.num_tokens_no_spec[index] = end + len(toks)


class VllmGroupView(SimGroupView):
    """The project's group view over the real InputBatch (block table ``group_index``),
    counting calls off the engine thread."""

    def __init__(self, input_batch: Any, block_size: int, group_index: int = 0) -> None:
        import threading

        from omni_prefix_cache.group_view import FullAttentionGroupView

        self.block_size = block_size
        self.group_index = group_index
        self.input_batch = input_batch
        self._inner = FullAttentionGroupView(input_batch, block_size, group_index)
        self._engine_thread = threading.get_ident()
        self.off_thread_calls = 0

    def set_step(self, order: Any, blocks: Any, computed: Any) -> None:
        import threading

        self._engine_thread = threading.get_ident()  # the InputBatch itself is already current
