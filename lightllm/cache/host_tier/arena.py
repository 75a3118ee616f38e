"""The host tier's shared memory: one file in /dev/shm, mapped by every process of a server.

Layout: a header page (magic, geometry, the LRU clock), a fixed table of entry records (`ENTRY`, one per entry
slot), then the data region of `num_blocks` blocks of `block_bytes`. Table and data are numpy views of the mapping,
so a write to them is a write to shared memory. `locked()` takes an exclusive `flock` on the file: it serializes
table updates between processes (and threads: a thread lock besides it), and the kernel drops it when its holder
dies, so a killed process never leaves the arena locked. Bulk copies of entry data happen outside the lock (see
`tier.py` for the protocol that keeps them safe).

The server that creates the arena unlinks it at shutdown; engine processes attach by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np

from lightllm.cache.host_tier.key import DIGEST_BYTES

SHM_DIR = "/dev/shm"
MAGIC = 0x4C4C4D484F535431  # "LLMHOST1"
HEADER_BYTES = 4096
# shards (tensor-parallel ranks) one entry can have
MAX_SHARDS = 8
LAYOUT_BYTES = 16

# entry states
FREE, WRITING, READY = 0, 1, 2

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("max_entries", "<u8"),
        ("block_bytes", "<u8"),
        ("num_blocks", "<u8"),
        ("clock", "<u8"),
        # 1: engines copy every new checkpoint here (replicas share them); 0: only what their devices drop
        ("write_through", "<u8"),
    ]
)
ENTRY = np.dtype(
    [
        ("state", "<u8"),
        # bumped whenever the record is (re)claimed or freed: a reader that saw another generation saw another entry
        ("generation", "<u8"),
        ("shard_mask", "<u8"),
        ("num_shards", "<u8"),
        ("num_tokens", "<i8"),
        ("digest", "u1", (DIGEST_BYTES,)),
        ("layout", "u1", (LAYOUT_BYTES,)),
        ("first_block", "<i8"),
        ("num_blocks", "<i8"),
        # bytes of one shard's section (every shard's is the same size)
        ("shard_bytes", "<i8"),
        ("last_access", "<u8"),
        # readers lease an entry between lookup and copy: it is not evicted before this time (time.time())
        ("lease_until", "<f8"),
        # pid of each shard's writer (0: none yet); a WRITING entry is reclaimed only when all of them are dead
        ("writer_pids", "<i8", (MAX_SHARDS,)),
    ]
)


def shm_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"host tier name must be a plain file name, got {name!r}")
    return os.path.join(SHM_DIR, name)


class HostArena:
    """A mapped arena; `create` makes the file, `attach` maps an existing one."""

    def __init__(self, name: str, fd: int, owner: bool):
        self.name, self._fd, self.owner = name, fd, owner
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size)
        self.header = np.ndarray((), dtype=HEADER, buffer=self._map)
        if int(self.header["magic"]) != MAGIC:
            raise ValueError(f"{shm_path(name)} is not a host tier arena")
        self.max_entries = int(self.header["max_entries"])
        self.block_bytes = int(self.header["block_bytes"])
        self.num_blocks = int(self.header["num_blocks"])
        self.write_through = bool(self.header["write_through"])
        self.entries = np.ndarray((self.max_entries,), dtype=ENTRY, buffer=self._map, offset=HEADER_BYTES)
        data_offset = _data_offset(self.max_entries)
        self.data = np.ndarray(
            (self.num_blocks * self.block_bytes,), dtype=np.uint8, buffer=self._map, offset=data_offset
        )
        self._thread_lock = threading.Lock()

    @classmethod
    def create(
        cls, name: str, num_bytes: int, block_bytes: int = 1 << 20, max_entries: int = 4096, write_through: bool = True
    ) -> HostArena:
        """A new arena of about `num_bytes` of data (whole blocks); the file is sparse until written.
        `write_through`: engines copy each new checkpoint at once (several replicas share the arena), or only
        the ones their device cache drops (a single replica: its own device holds the rest)."""
        num_blocks = num_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"host tier of {num_bytes} bytes holds no {block_bytes}-byte block")
        fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _data_offset(max_entries) + num_blocks * block_bytes)
            with mmap.mmap(fd, HEADER_BYTES) as m:
                header = np.ndarray((), dtype=HEADER, buffer=m)
                header["max_entries"], header["block_bytes"], header["num_blocks"] = (
                    max_entries,
                    block_bytes,
                    num_blocks,
                )
                header["write_through"] = write_through
                header["magic"] = MAGIC
                del header
            return cls(name, fd, owner=True)
        except BaseException:
            os.close(fd)
            os.unlink(shm_path(name))
            raise

    @classmethod
    def attach(cls, name: str) -> HostArena:
        fd = os.open(shm_path(name), os.O_RDWR)
        try:
            return cls(name, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def tick(self) -> int:
        """The next LRU time stamp (call under the lock)."""
        self.header["clock"] += 1
        return int(self.header["clock"])

    def region(self, first_block: int, num_bytes: int, offset: int = 0) -> np.ndarray:
        start = first_block * self.block_bytes + offset
        return self.data[start : start + num_bytes]

    def unlink(self) -> None:
        """Remove the file (mappings stay valid until closed); the creator calls it at shutdown."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(self.name))


def _data_offset(max_entries: int) -> int:
    table_end = HEADER_BYTES + max_entries * ENTRY.itemsize
    return -(-table_end // mmap.PAGESIZE) * mmap.PAGESIZE
