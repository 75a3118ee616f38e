"""The runner's side of the host tier: a prefix-cache node's state out to shared host memory, and back into a
fresh request of any replica.

An entry's section (one per tensor-parallel rank) is what prefill/decode disaggregation moves for a request,
taken from a tree node instead of a live request: the KV of the prefix (main and, with MTP, the head's pairs), the
node's canonical checkpoint (conv window and SSM, mode-independent) and with MTP the main model's hidden state
at its last token. It is laid out as a `RequestState` whose blobs lie in the section (a msgpack descriptor, then
the tensors), so a hit goes through `import_request` like a decode node's transfer and a replica of any state
mode resumes it. After the import the MTP hidden state is made pending, as a device prefix-cache hit leaves it:
the next forward pairs it with the first new token, as a cold run would.

Entries are written when the device prefix cache drops a checkpoint (spill on eviction; a no-op when the entry
is there already) and, when the arena is shared by several replicas (`write_through`), as soon as it stores one
(`save` after a publish), so that the others find it. On CUDA the copy runs behind the steps (`SectionWriter`): an
entry becomes visible to lookups once its copy has landed, a step or two after its `save`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct

import msgspec
import torch

from lightllm.cache.device_copy import to_device
from lightllm.cache.host_tier import HostArena, HostTier, Ticket
from lightllm.cache.host_tier.tier import aligned
from lightllm.cache.payload import RequestState, TensorBlob
from lightllm.cache.prefix import TreeNode
from lightllm.worker.transfer.request_state import import_request, request_state_of
from lightllm.worker.transfer.section_writer import SectionWriter

logger = logging.getLogger(__name__)

_DESC_LEN = struct.Struct("<I")


def layout_digest(runner) -> bytes:
    """Which checkpoint this runner serves and what a section's tensors look like on it, minus the token count:
    replicas that agree on it can read each other's entries (state modes may differ: checkpoints are canonical)."""
    ckpt, config = runner.prefix_cache.pool, runner.config
    parts = [
        (os.path.realpath(config.model_dir), config.load_format, config.quantization),
        config.tp_size,
        [(tuple(b.shape[2:]), str(b.dtype), b.shape[0]) for b in runner.kv.buffers],
        [(tuple(t.shape[:1] + t.shape[2:]), str(t.dtype)) for t in (ckpt.conv, ckpt.ssm)],
        None if runner.drafter is None else [(tuple(b.shape[2:]), str(b.dtype)) for b in runner.drafter.kv.buffers],
        None if ckpt.hidden is None else (ckpt.hidden.shape[1], str(ckpt.hidden.dtype)),
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def section_layout(tensors: list[torch.Tensor], state: RequestState) -> tuple[bytes, list[int], int]:
    """The descriptor, each tensor's byte offset in the section's data, and the section's size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = aligned(end + t.numel() * t.element_size())
    _fill_offsets(state, iter(offsets))
    desc = msgspec.msgpack.encode(state)
    return desc, offsets, _data_start(len(desc)) + end


def _fill_offsets(state: RequestState, offsets) -> None:
    """Point the state's blobs, in export order, at successive `offsets`."""
    blobs = [*state.kv, state.conv, state.ssm, *state.mtp_kv]
    if state.mtp_hidden is not None:
        blobs.append(state.mtp_hidden)
    for blob in blobs:
        blob.offset = next(offsets)


def _data_start(desc_len: int) -> int:
    return aligned(_DESC_LEN.size + desc_len)


def _decode_section(section: torch.Tensor) -> tuple[RequestState | None, int, str | None]:
    """A section's descriptor, where its data starts, and what is wrong with it (None: nothing)."""
    (desc_len,) = _DESC_LEN.unpack(section[: _DESC_LEN.size].numpy().tobytes())
    data_start = _data_start(desc_len)
    if data_start > len(section):
        return None, 0, f"a descriptor of {desc_len} bytes in a {len(section)}-byte section"
    try:
        state = msgspec.msgpack.decode(section[_DESC_LEN.size : _DESC_LEN.size + desc_len].numpy(), type=RequestState)
    except msgspec.DecodeError as exc:
        return None, 0, f"undecodable descriptor ({exc})"
    return state, data_start, None


def _blob(t: torch.Tensor) -> TensorBlob:
    return TensorBlob(str(t.dtype).removeprefix("torch."), list(t.shape), b"")


class RunnerHostTier:
    """One rank's handle: `save` a node's state, `match_len` and `resume` a new request from an entry."""

    def __init__(self, runner, arena_name: str, background: bool | None = None):
        """`background`: entries are copied out by a worker thread (see `SectionWriter`); default on CUDA."""
        self.runner = runner
        arena = HostArena.attach(arena_name)
        self.tier = HostTier(arena, layout_digest(runner), runner.config.tp_size, runner.config.tp_rank)
        background = runner.device.type == "cuda" if background is None else background
        self.writer = SectionWriter(self.tier, background)
        self.write_through = arena.write_through
        self.num_hit_tokens = 0
        # entries found but not imported (a descriptor that does not fit this runner)
        self.num_refused = 0
        # entries not written because the writer's copies were behind
        self.num_skipped = 0
        self._warned_size = False
        # where a hit's entry is copied before it is checked and imported (pinned on CUDA, kept between hits:
        # pinning memory costs more than the copy)
        self._staging = torch.empty(0, dtype=torch.uint8)

    # writing ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def save(self, node: TreeNode) -> bool:
        """Copy the node's prefix state into the tier unless it holds it already; False when it did not (there,
        or no room, or the writer's copies were behind). A node without a checkpoint has nothing to resume from.
        In the background mode the copy may still be running on return (`flush` waits for it)."""
        cache = self.runner.prefix_cache.cache
        tokens, namespace = cache.tree.path_tokens(node), cache.tree.namespace(node)
        if node.checkpoint is None or len(tokens) == 0:
            return False
        tensors, state = self._node_state(node)
        desc, offsets, nbytes = section_layout(tensors, state)
        if self._never_fits(len(tokens), nbytes):
            return False
        if not self.writer.has_room(nbytes, sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)):
            # the copies out are behind (a burst of evictions): the step loop must not wait for them
            self.num_skipped += 1
            return False
        # claimed by the writer (on its worker in the background mode): nothing is copied when the tier holds the
        # entry already, another writer is at it, or no room can be made
        return self.writer.write(
            lambda: self.tier.begin_write(tokens, nbytes, namespace),
            _DESC_LEN.pack(len(desc)) + desc,
            _data_start(len(desc)),
            tensors,
            offsets,
        )

    def flush(self) -> None:
        """Wait until every entry `save` started is in the tier (committed, or lost if its record was taken)."""
        self.writer.flush()

    def _node_state(self, node: TreeNode) -> tuple[list[torch.Tensor], RequestState]:
        """The node's prefix as tensors in export order and the `RequestState` describing them (blobs without
        bytes)."""
        runner, cache = self.runner, self.runner.prefix_cache.cache
        values = cache.tree.path_values(node)
        n = len(values)
        slots = to_device(values[:, 0], runner.device)
        tensors = [buf[:, slots] for buf in runner.kv.buffers]
        ckpt, hidden = cache.pool.read(node.checkpoint)
        tensors += [ckpt.conv, ckpt.ssm]
        mtp_len = None
        if runner.drafter is not None:
            mtp_slots = to_device(values[1:, 1], runner.device)
            tensors += [buf[:, mtp_slots] for buf in runner.drafter.kv.buffers]
            tensors.append(hidden)
            mtp_len = n - 1
        state = request_state_of([_blob(t) for t in tensors], n, len(runner.kv.buffers), mtp_len)
        return tensors, state

    # reading ---------------------------------------------------------------------------------------------
    def match_len(self, prefix: list[int], longer_than: int, namespace: bytes) -> int:
        """The length of the entry in `namespace` a new request for `prefix` would resume from (at most all but
        its last token), longer than `longer_than` (0: none); leases it."""
        ticket = self._lookup(prefix, longer_than, None, namespace)
        return 0 if ticket is None else ticket.num_tokens

    def _lookup(self, prefix: list[int], longer_than: int, num_tokens: int | None, namespace: bytes) -> Ticket | None:
        """With `num_tokens`, only an entry of exactly that length (rank 0 chose it for every rank)."""
        if len(prefix) < 2:
            return None
        tokens = prefix[:-1]
        if num_tokens is None:
            return self.tier.lookup(tokens, longer_than, namespace)
        if num_tokens <= longer_than or num_tokens > len(tokens):
            return None
        return self.tier.lookup(tokens[:num_tokens], num_tokens - 1, namespace)

    def resume(self, req, prefix: list[int], longer_than: int, num_tokens: int | None = None) -> bool:
        """Start the fresh request `req` from the longest entry of its namespace for `prefix` longer than
        `longer_than` (or the one of `num_tokens` tokens); False, with nothing imported, on a miss or when the entry
        changed while it was copied out."""
        ticket = self._lookup(prefix, longer_than, num_tokens, req.namespace)
        if ticket is None:
            return False
        section = self.tier.section(ticket)
        # a private copy first, checked after: the entry may be evicted once its lease ends, and a torn copy must
        # never reach the state (torch's copy runs on the intra-op threads, numpy's on one)
        local = self._staging_of(len(section))
        local.copy_(torch.from_numpy(section))
        if not self.tier.valid(ticket):
            return False
        state, data_start, problem = _decode_section(local)
        if problem is None:
            problem = self._problem(state, ticket, len(local) - data_start)
        if problem is not None:
            return self._refuse(ticket, problem)
        import_request(self.runner, req, state, local[data_start:])
        if self.runner.drafter is not None:
            # pending, as a device hit leaves it: the next forward pairs it with the first new token
            hidden, _ = req.mtp_last_hidden
            req.mtp_hidden, req.mtp_next_ids, req.mtp_last_hidden = [(hidden, 0, 1)], [], None
        self.num_hit_tokens += state.num_tokens
        return True

    def _never_fits(self, num_tokens: int, shard_bytes: int) -> bool:
        """Whether an entry this large can never be stored (the tier is smaller than one); said once."""
        arena = self.tier.arena
        if self.tier.num_shards * shard_bytes <= arena.capacity_bytes:
            return False
        if self._warned_size:
            return True
        self._warned_size = True
        logger.warning(
            "the host tier (%.1f MiB) cannot hold the state of a %d-token prefix (%.1f MiB): raise --host_tier_gb "
            "(and the size of /dev/shm)",
            arena.capacity_bytes / 2**20,
            num_tokens,
            self.tier.num_shards * shard_bytes / 2**20,
        )
        return True

    def _refuse(self, ticket: Ticket, problem: str) -> bool:
        """Nothing was imported: the request resumes from the device cache instead."""
        logger.warning("host tier entry of %d tokens refused: %s", ticket.num_tokens, problem)
        self.num_refused += 1
        return False

    def _problem(self, state: RequestState, ticket: Ticket, region_bytes: int) -> str | None:
        """Why `state` (an entry's descriptor) cannot be imported into this runner, or None."""
        if state.num_tokens != ticket.num_tokens:
            return f"describes {state.num_tokens} tokens"
        if len(state.kv) != len(self.runner.kv.buffers) or (state.mtp_hidden is None) != (self.runner.drafter is None):
            return "another set of tensors than this runner's"
        blobs = [*state.kv, state.conv, state.ssm, *state.mtp_kv] + ([state.mtp_hidden] if state.mtp_hidden else [])
        for blob in blobs:
            if not isinstance(getattr(torch, blob.dtype, None), torch.dtype):
                return f"unknown dtype {blob.dtype!r}"
            if blob.offset is None or blob.offset < 0 or blob.offset + blob.nbytes > region_bytes:
                return f"a tensor outside the entry ({blob.offset} + {blob.nbytes} > {region_bytes} bytes)"
        return None

    def _staging_of(self, num_bytes: int) -> torch.Tensor:
        """`num_bytes` of the staging buffer, grown (to a power of two) when too small. The imports copy from it
        synchronously, so the next hit may overwrite it."""
        if self._staging.numel() < num_bytes:
            size = 1 << max(num_bytes - 1, 1).bit_length()
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=self.runner.device.type == "cuda")
        return self._staging[:num_bytes]

    def stats(self) -> dict[str, int]:
        s = self.tier.stats
        return {
            "host_hit_tokens": self.num_hit_tokens,
            "host_entries_written": s.num_writes,
            "host_entries_evicted": s.num_evicted,
            "host_bytes_written": s.num_written_bytes,
            "host_entries_refused": self.num_refused,
            "host_entries_skipped": self.num_skipped,
        }
