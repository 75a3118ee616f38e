"""The runner's side of the prefix cache: what a hit restores and what a publish saves, beyond shared KV.

A hit imports the node's checkpoint into the request's state slot (`import_checkpoint` resets cursor, parity and
pending inputs) and, with MTP, restores the drafter: the head's KV of the prefix is shared like the main KV (its
pairs up to the last resumed token), and the main model's hidden state of the last resumed token becomes the
one pending hidden row, so the next forward pairs it with the first new token exactly as a cold run would.

A publish happens only between steps (never between forward and accept) and only at the request's committed
length, so the checkpoint is exported from committed state: replay folds its pending history and compact merges
its pending window into a copy, the live state is untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.cache.kv_cache import KVCache
from lightllm.cache.prefix import CheckpointPool, PrefixCache, PrefixMatch
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.cache.prefix.radix_tree import TreeNode
from lightllm.linear_att.base import Checkpoint, LinearAttState
from lightllm.worker.transfer.host_tier import RunnerHostTier

logger = logging.getLogger(__name__)

# a checkpoint exported at a request's committed length, with the MTP head's `[1, hidden]` hidden state there
HeldExport = tuple[Checkpoint, torch.Tensor | None]
# checkpoint pool size as a fraction of the KV cache's bytes when neither the fraction nor the bytes are given
DEFAULT_STATE_FRACTION = 0.1


def checkpoint_template(state: LinearAttState, device: torch.device) -> Checkpoint:
    """A one-request checkpoint (of the HOLD slot) giving the pool its shapes and dtypes."""
    return state.export_checkpoint(torch.full((1,), state.hold_slot, dtype=torch.int32, device=device))


def state_fraction(fraction: float | None) -> float:
    return DEFAULT_STATE_FRACTION if fraction is None else fraction


def pool_bytes(kv_tokens: int, kv_bytes_per_token: int, fraction: float | None, num_bytes: int | None) -> int:
    """Checkpoint pool budget: `num_bytes` when given, else `fraction` (default 0.1) of the KV cache's bytes."""
    if num_bytes is not None:
        return num_bytes
    return int(state_fraction(fraction) * kv_tokens * kv_bytes_per_token)


def create_prefix_cache(
    state: LinearAttState,
    kv: KVCache,
    drafter,
    hidden_size: int,
    dtype: torch.dtype,
    kv_bytes_per_token: int,
    fraction: float | None,
    num_bytes: int | None,
) -> RunnerPrefixCache | None:
    """The runner's prefix cache with a pool sized by `pool_bytes` (never more checkpoints than KV tokens);
    None when the budget holds no checkpoint."""
    template = checkpoint_template(state, kv.device)
    mtp_hidden = hidden_size if drafter is not None else 0
    per_checkpoint = CheckpointPool.bytes_per_slot(template, mtp_hidden, dtype)
    budget = pool_bytes(kv.capacity, kv_bytes_per_token, fraction, num_bytes)
    num_slots = min(budget // per_checkpoint, kv.capacity)
    if num_slots == 0:
        logger.warning("prefix cache off: %d bytes hold no %d-byte checkpoint", budget, per_checkpoint)
        return None
    logger.info("prefix cache: %d checkpoints of %.2f MiB", num_slots, per_checkpoint / 2**20)
    return RunnerPrefixCache(state, kv, num_slots, drafter, hidden_size, dtype)


class RunnerPrefixCache:
    """Wraps `PrefixCache` with the runner's state and MTP drafter."""

    def __init__(
        self,
        state: LinearAttState,
        kv: KVCache,
        num_slots: int,
        drafter=None,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
    ):
        template = checkpoint_template(state, kv.device)
        pool = CheckpointPool(template, num_slots, hidden_size if drafter is not None else 0, hidden_dtype)
        self.cache = PrefixCache(pool, kv, drafter.kv if drafter is not None else None)
        self.state = state
        self.drafter = drafter
        self.device = pool.device
        # the host tier behind this cache (`attach_host`), or None
        self.host: RunnerHostTier | None = None
        # new checkpoints not exported yet: (pool slot, its node, the request's state slot, with MTP the `[1, hidden]`
        # hidden state of its last token), written by `flush`
        self._unwritten: list[tuple[int, TreeNode, int, torch.Tensor | None]] = []

    def attach_host(self, host: RunnerHostTier) -> None:
        """Back this cache with the host tier: new checkpoints are copied there (when the arena says so: other
        replicas share it), dropped ones spill there (when missing), and a request resumes from it when it holds
        a longer prefix than the device."""
        self.host = host
        self.cache.on_drop = self._spill

    @property
    def pool(self) -> CheckpointPool:
        return self.cache.pool

    def match(self, token_ids: Sequence[int], namespace: bytes = DEFAULT_NAMESPACE) -> PrefixMatch:
        """A lookup for a new request for `token_ids` in `namespace`: at most all but the last token (it needs
        logits). A longer host-tier entry wins; its tokens count as pinned (they take fresh KV slots)."""
        match = self.cache.match(token_ids[:-1], namespace) if len(token_ids) > 1 else PrefixMatch()
        host = self.host_match(token_ids, namespace, match.num_tokens)
        if host:
            return PrefixMatch(num_tokens=host, num_pinned=host, num_matched=match.num_matched)
        return match

    def host_match(self, token_ids: Sequence[int], namespace: bytes, longer_than: int | None = None) -> int:
        """The length of the host-tier entry in `namespace` a new request for `token_ids` would resume from: one
        longer than the device's hit (0: none)."""
        if self.host is None or len(token_ids) < 2:
            return 0
        if longer_than is None:
            longer_than = self.cache.match(token_ids[:-1], namespace).num_tokens
        return self.host.match_len(list(token_ids), longer_than, namespace)

    def resume(self, handle: int, req, token_ids: Sequence[int], host_tokens: int | None = None) -> None:
        """Start the new request `handle` from the deepest checkpoint on its tokens' path in its namespace
        (`req.namespace`), or from the host tier when it holds a longer prefix (a miss leaves it empty).
        `host_tokens`: the host entry's length chosen on rank 0 for every tensor-parallel rank (0: none); None: the
        longest."""
        namespace = req.namespace
        if self.host is not None and host_tokens != 0 and len(token_ids) > 1:
            device = self.cache.match(token_ids[:-1], namespace).num_tokens
            if self.host.resume(req, list(token_ids), device, host_tokens):
                self.cache.stats.num_queried_tokens += len(token_ids)
                return
        hit = self.cache.resume(handle, token_ids[:-1], len(token_ids), namespace) if len(token_ids) > 1 else None
        if hit is None:
            return
        self.state.import_checkpoint(self._slots(req), hit.checkpoint)
        req.num_tokens = hit.num_tokens
        if self.drafter is not None:
            req.mtp_len = hit.num_tokens - 1
            req.mtp_hidden, req.mtp_next_ids = [(hit.hidden.clone(), 0, 1)], []

    def publish_many(self, entries: list[tuple[int, object, Sequence[int], HeldExport | None]]) -> None:
        """Offer each request's committed tokens to the cache: entries (handle, request, token ids, held), see
        `_publish`. With MTP the head first commits every request's pending pairs (the head's KV must hold the pair
        of every published token; prefill chunks leave them pending) in one pass. A publish that fails
        is logged and costs the cache its entry only."""
        if self.drafter is not None:
            ready = [(handle, req) for handle, req, token_ids, _ in entries if _publishable(req, token_ids)]
            if ready:
                self.drafter.commit_known_pairs(*map(list, zip(*ready)))
        for handle, req, token_ids, held in entries:
            try:
                self._publish(handle, req, token_ids, held)
            except Exception:
                # the cache loses this entry; the request and the other publishes are unharmed
                logger.exception("prefix-cache publish of request %d failed", handle)

    def _publish(self, handle: int, req, token_ids: Sequence[int], held: HeldExport | None) -> None:
        """Offer the request's committed tokens `token_ids` (exactly its committed length) to the cache (and a
        new checkpoint to the host tier); with MTP the head's KV holds their pairs already (`publish_many`).
        `held`: the checkpoint (and MTP hidden state) at that length, taken before a later step moved the
        request's state on; by default it is exported with the step's other checkpoints (`flush`), or now when
        the host tier writes it through."""
        if not _publishable(req, token_ids):
            return
        if held is None and (self.host is None or not self.host.write_through):
            # exported with the other publishes before the state or the pool is next read or written (`flush`):
            # one export and one pool write for all the checkpoints of a step instead of one each
            node = self.cache.publish(handle, token_ids, None, req.namespace)
            if node is not None:
                hidden = self._last_hidden(req) if self.drafter is not None else None
                self._unwritten.append((node.checkpoint, node, req.state_slot, hidden))
            return
        node = self.cache.publish(
            handle, token_ids, (lambda: held) if held is not None else (lambda: self._export(req)), req.namespace
        )
        if node is not None and self.host is not None and self.host.write_through:
            self.host.save(node)

    def flush(self) -> None:
        """Export and store the checkpoints published since the last flush, in one batch. The runner calls it
        before anything reads or writes a state slot or the pool (a forward, a new request, an export), so the
        MTP hidden rows they name are still those of the step that published. A checkpoint evicted meanwhile is
        left out (its pool slot may belong to a later one of the batch)."""
        entries = [
            (slot, state_slot, hidden) for slot, node, state_slot, hidden in self._unwritten if node.checkpoint == slot
        ]
        self._unwritten = []
        if not entries:
            return
        slots, state_slots, hidden = zip(*entries)
        ckpt = self.state.export_checkpoint(to_device(np.asarray(state_slots, dtype=np.int32), self.device))
        rows = torch.cat(hidden) if self.drafter is not None else None
        self.pool.write_many(to_device(np.asarray(slots, dtype=np.int64), self.device), ckpt, rows)

    def _spill(self, node: TreeNode) -> bool:
        """A dropped node's state to the host tier, unless its checkpoint was never written (published and dropped
        before the next `flush`: its pool slot holds nothing of it)."""
        if any(unwritten is node for _, unwritten, *_ in self._unwritten):
            return False
        return self.host.save(node)

    def release(self, handle: int) -> None:
        self.cache.release(handle)

    def _export(self, req) -> HeldExport:
        ckpt = self.state.export_checkpoint(self._slots(req))
        return ckpt, self._last_hidden(req) if self.drafter is not None else None

    @staticmethod
    def _last_hidden(req) -> torch.Tensor:
        """`[1, hidden]`: the main model's hidden state of the request's last committed token (a view)."""
        if req.mtp_hidden:
            source, start, count = req.mtp_hidden[-1]
            row = start + count - 1
        else:
            source, row = req.mtp_last_hidden
        return source[row : row + 1]

    def _slots(self, req) -> torch.Tensor:
        # a fill, not a copy from host memory: no wait for the device
        return torch.full((1,), req.state_slot, dtype=torch.int32, device=self.device)

    def stats(self) -> dict[str, int]:
        s, pool = self.cache.stats, self.pool
        return {
            "num_queried_tokens": s.num_queried_tokens,
            "num_hit_tokens": s.num_hit_tokens,
            "num_checkpoints_stored": s.num_checkpoints_stored,
            "num_checkpoints_evicted": s.num_checkpoints_evicted,
            "num_checkpoints": self.cache.num_checkpoints(),
            "checkpoint_bytes": self.cache.num_checkpoints() * pool.bytes_per_checkpoint,
            "checkpoint_capacity_bytes": pool.num_bytes,
            "bytes_per_checkpoint": pool.bytes_per_checkpoint,
            "num_cached_tokens": self.cache.tree.num_tokens,
            **(self.host.stats() if self.host is not None else {}),
        }


def _publishable(req, token_ids: Sequence[int]) -> bool:
    """Only a request's committed tokens, all of them, are published."""
    return bool(token_ids) and len(token_ids) == req.num_tokens
