"""The runner's prefix-cache and checkpoint calls: what the scheduler, PD and the cache tests ask of a runner's
prefix cache (match, publish, evict, stats) and its state checkpoints (export, import).

`ModelRunner` inherits these methods; they use its requests, state, prefix cache (`lightllm.worker.transfer.prefix`
does the work) and the unsettled verify steps of `device_accept.py`.
"""

from __future__ import annotations

import torch

from lightllm.cache.device_copy import list_to_device
from lightllm.cache.prefix import PrefixMatch
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.linear_att.base import Checkpoint


class PrefixCacheCalls:
    def _flush_checkpoints(self) -> None:
        """Write the prefix-cache checkpoints published since the last call (one export for all of them) before a
        state slot or the checkpoint pool is read or written again."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def match_prefix(self, token_ids: list[int], namespace: bytes = DEFAULT_NAMESPACE) -> PrefixMatch:
        """What `add_request(token_ids, namespace=namespace)` would resume from the prefix cache; changes nothing."""
        return self.prefix_cache.match(token_ids, namespace) if self.prefix_cache is not None else PrefixMatch()

    def publish(self, handle: int, token_ids: list[int]) -> None:
        """Offer the request's committed tokens (`token_ids`, exactly `num_tokens(handle)` of them) to the prefix
        cache with a checkpoint of its state there. Only between steps, never between forward and accept."""
        self.publish_many([(handle, token_ids)])

    @torch.inference_mode()
    def publish_many(self, entries: list[tuple[int, list[int]]]) -> None:
        """`publish` for many requests (handle, token ids) at once: with MTP one pass of the head commits what
        their prefills left pending, and their checkpoints are exported together before the next forward."""
        if self.prefix_cache is None:
            return
        if self._pending is not None:
            raise RuntimeError("publish() between forward and accept: the state is not committed")
        ready = []
        for handle, token_ids in entries:
            record = self._requests[handle]
            held = None
            if self._is_unsettled(record):
                # the state holds tokens whose count the host has not read, unless a checkpoint was held at the
                # committed length (a request that reached its limit while a later step of it was launched)
                held = self._held_checkpoint(handle)
                if held is None:
                    continue
                held = (held.checkpoint, held.hidden)
            ready.append((handle, record, token_ids, held))
        self.prefix_cache.publish_many(ready)

    def evict_prefix_cache(self) -> None:
        """Drop every prefix-cache entry no running request uses (tests, memory pressure); what they spill to
        the host tier is there on return."""
        self._flush_checkpoints()
        if self.prefix_cache is not None:
            self.prefix_cache.cache.evict()
            if self.prefix_cache.host is not None:
                self.prefix_cache.host.flush()

    def prefix_cache_stats(self) -> dict[str, int] | None:
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    # state checkpoints (prefix cache, PD) -------------------------------------------------------------------
    def export_checkpoint(self, handles: list[int]) -> Checkpoint:
        self._flush_checkpoints()
        return self.state.export_checkpoint(self._state_slots(handles))

    def import_checkpoint(self, handles: list[int], checkpoint: Checkpoint) -> None:
        self._flush_checkpoints()
        self.state.import_checkpoint(self._state_slots(handles), checkpoint)

    def _state_slots(self, handles: list[int]) -> torch.Tensor:
        slots = [self._requests[h].state_slot for h in handles]
        return list_to_device(slots, torch.int32, self.device)
