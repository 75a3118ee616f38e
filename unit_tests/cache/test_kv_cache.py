"""KVCache / TokenAllocator: exact slot ids through alloc, extend, truncate and free."""

from __future__ import annotations

import pytest
import torch

from lightllm.cache.kv_cache import KVCache, TokenAllocator


def make_cache(capacity: int = 8, rows: int = 3, max_len: int = 6) -> KVCache:
    return KVCache(2, ((2, 3), (2, 5)), capacity, rows, max_len, torch.float32, "cpu")


def test_allocator_hands_out_in_order_and_reuses_released_slots_in_release_order():
    alloc = TokenAllocator(6)
    assert alloc.alloc(3).tolist() == [0, 1, 2]
    assert alloc.alloc(2).tolist() == [3, 4]
    alloc.free(torch.tensor([1, 3]))
    assert alloc.num_free() == 3
    assert alloc.alloc(3).tolist() == [1, 3, 5]
    with pytest.raises(RuntimeError, match="KV cache full"):
        alloc.alloc(1)


def test_rows_extend_truncate_free_exact_slots():
    kv = make_cache()
    a, b = kv.alloc_row(), kv.alloc_row()
    assert (a, b) == (0, 1)
    assert kv.extend(a, 3).tolist() == [0, 1, 2]
    assert kv.extend(b, 2).tolist() == [3, 4]
    assert kv.extend(a, 2).tolist() == [5, 6]
    assert kv.slots(a).tolist() == [0, 1, 2, 5, 6]
    assert kv.req_to_slot[a, :6].tolist() == [0, 1, 2, 5, 6, kv.hold_slot]
    kv.truncate(a, 3)  # rejected drafts 5, 6 go back
    assert kv.slots(a).tolist() == [0, 1, 2]
    assert kv.req_to_slot[a, 3:5].tolist() == [kv.hold_slot] * 2
    assert kv.num_free_tokens() == 8 - 5
    assert kv.extend(b, 3).tolist() == [5, 6, 7]
    kv.free_row(a)
    assert kv.num_free_tokens() == 3 and kv.num_free_rows() == 2
    assert kv.alloc_row() == 0
    assert kv.extend(0, 2).tolist() == [0, 1]


def test_row_longer_than_max_req_len_is_refused():
    kv = make_cache(max_len=4)
    row = kv.alloc_row()
    kv.extend(row, 4)
    with pytest.raises(RuntimeError, match="max_req_len"):
        kv.extend(row, 1)


def test_write_gather_roundtrip_and_bytes_per_token():
    kv = make_cache()
    row = kv.alloc_row()
    slots = kv.extend(row, 3)
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 5)
    kv.write(1, slots, k, v)
    gk, gv = kv.gather(1, kv.req_to_slot[row : row + 1, :3])
    assert torch.equal(gk[0], k) and torch.equal(gv[0], v)
    assert not kv.buffers[0][0].any(), "layer 0 untouched"
    assert kv.bytes_per_token() == 2 * (2 * 3 + 2 * 5) * 4


def test_slots_are_a_copy_that_later_steps_do_not_change():
    kv = make_cache()
    row = kv.alloc_row()
    kv.extend(row, 3)
    held = kv.slots(row)
    kv.truncate(row, 1)
    other = kv.alloc_row()
    assert kv.extend(other, 2).tolist() == [1, 2]
    kv.extend(row, 2)
    assert kv.slots(row).tolist() == [0, 3, 4]
    assert held.tolist() == [0, 1, 2]
