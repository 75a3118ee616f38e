"""The folder of stored responses: shared by stores on one folder (as the HTTP processes of a server share it),
bounded in bytes with the least recently written removed first, no id that is not this server's read as a path, and
a temporary folder removed with its store."""

from __future__ import annotations

import os
import random
import time

import pytest

from lightllm.server.http.response_store import ResponseStore, StoredResponse, new_response_id


def _record(size: int, rng: random.Random) -> StoredResponse:
    text = "".join(rng.choice("abcdefgh") for _ in range(size))
    response = {"id": new_response_id(), "object": "response", "output": [{"type": "message", "content": text}]}
    return StoredResponse(response, [{"type": "message", "role": "user", "content": text[::-1], "id": "msg_1"}])


def test_two_stores_on_one_folder_see_each_others_responses(tmp_path):
    rng = random.Random(7)
    a, b = ResponseStore(str(tmp_path), 2**20), ResponseStore(str(tmp_path), 2**20)
    record = _record(300, rng)
    assert a.put(record)
    read = b.get(record.response["id"])
    assert read == record and read.conversation() == [*record.input, *record.response["output"]]
    # the twin: an id nobody stored
    assert b.get(new_response_id()) is None
    assert b.delete(record.response["id"]) and a.get(record.response["id"]) is None
    assert not a.delete(record.response["id"])


def test_the_folder_stays_within_its_bound_dropping_the_oldest(tmp_path):
    rng = random.Random(11)
    bound = 64 * 1024
    stores = [ResponseStore(str(tmp_path), bound) for _ in range(2)]
    written = []
    for i in range(120):
        record = _record(rng.randrange(500, 3000), rng)
        assert stores[i % 2].put(record)
        written.append(record.response["id"])
        # distinct write times, so that "oldest" is well defined
        path = tmp_path / f"{written[-1]}.json"
        os.utime(path, ns=(time.time_ns(), 10**18 + i * 10**6))
    # each store rescans once it wrote an eighth of the bound: the folder may exceed it by what the two stores
    # wrote since their last scans (each less than an eighth plus one record)
    assert stores[0].num_bytes() <= bound + 2 * (bound // 8 + 7000)
    present = [stores[0].get(i) is not None for i in written]
    # what is left is a suffix of the writes: the newest kept, every older one before the first kept gone
    first_kept = present.index(True)
    assert all(present[first_kept:]) and not any(present[:first_kept]) and first_kept > 0


def test_a_response_larger_than_the_whole_store_is_not_kept(tmp_path):
    store = ResponseStore(str(tmp_path), 4096)
    big = _record(5000, random.Random(3))
    assert not store.put(big) and store.get(big.response["id"]) is None
    small = _record(100, random.Random(4))
    assert store.put(small) and store.get(small.response["id"]) == small


@pytest.mark.parametrize("response_id", ["../x", "resp_" + "0" * 31 + "/", "resp_" + "A" * 32, "", "resp_x.json"])
def test_ids_that_are_not_this_servers_are_never_paths(tmp_path, response_id):
    outside = tmp_path / "x.json"
    outside.write_text('{"response": {}, "input": []}')
    store = ResponseStore(str(tmp_path / "store"), 2**20)
    assert store.get(response_id) is None and not store.delete(response_id)
    assert outside.exists()
    with pytest.raises(ValueError, match="not a response id"):
        store.put(StoredResponse({"id": response_id}, []))


def test_a_temporary_folder_goes_with_its_store_and_a_given_one_stays(tmp_path):
    own = ResponseStore(None, 2**20)
    record = _record(10, random.Random(1))
    assert own.put(record) and own.directory.is_dir()
    # conversations on disk: readable by the server's user only
    assert own.directory.stat().st_mode & 0o777 == 0o700
    assert (own.directory / f"{record.response['id']}.json").stat().st_mode & 0o777 == 0o600
    own.close()
    assert not own.directory.exists()
    given = ResponseStore(str(tmp_path / "kept"), 2**20)
    given.put(_record(10, random.Random(2)))
    given.close()
    assert len(list((tmp_path / "kept").glob("*.json"))) == 1
    # a store that keeps nothing makes no folder
    off = ResponseStore(None, 0)
    assert not off.enabled and off.directory is None and off.get(new_response_id()) is None


def test_an_event_log_is_read_from_any_offset_by_another_store(tmp_path):
    writer, reader = ResponseStore(str(tmp_path), 2**20), ResponseStore(str(tmp_path), 2**20)
    response_id = new_response_id()
    assert reader.read_events(response_id, 0) is None
    rng = random.Random(9)
    lines = [f'{{"n":{i},"t":"{"x" * rng.randrange(1, 50)}"}}'.encode() for i in range(20)]
    writer.append_events(response_id, lines[:7])
    writer.append_events(response_id, lines[7:])
    read, end = reader.read_events(response_id, 0)
    assert read == lines and reader.read_events(response_id, end) == ([], end)
    # from the offset after the first k lines: the rest
    offset = sum(len(line) + 1 for line in lines[:5])
    assert reader.read_events(response_id, offset) == (lines[5:], end)
    # a line still being written is not read until it is whole
    with open(tmp_path / f"{response_id}.events", "ab") as f:
        f.write(b'{"n":20,')
    assert reader.read_events(response_id, end) == ([], end)
    with open(tmp_path / f"{response_id}.events", "ab") as f:
        f.write(b'"t":"y"}\n')
    assert reader.read_events(response_id, end)[0] == [b'{"n":20,"t":"y"}']
    assert (tmp_path / f"{response_id}.events").stat().st_mode & 0o777 == 0o600
    # it goes with its response
    assert reader.delete(response_id) is False and reader.read_events(response_id, 0) is None


def test_a_responses_event_log_counts_towards_the_bound_and_goes_with_it(tmp_path):
    rng = random.Random(13)
    bound = 64 * 1024
    store = ResponseStore(str(tmp_path), bound)
    logged = _record(200, rng)
    assert store.put(logged)
    logged_id = logged.response["id"]
    store.append_events(logged_id, [b"x" * 1000] * 20)
    assert store.num_bytes() > 20_000
    os.utime(tmp_path / f"{logged_id}.json", ns=(time.time_ns(), 10**18))
    os.utime(tmp_path / f"{logged_id}.events", ns=(time.time_ns(), 10**18))
    # newer responses past the bound: the oldest, its log with it, is the first to go
    for i in range(40):
        record = _record(1500, rng)
        store.put(record)
        os.utime(tmp_path / f"{record.response['id']}.json", ns=(time.time_ns(), 10**18 + (i + 1) * 10**6))
    assert store.get(logged_id) is None and store.read_events(logged_id, 0) is None
    assert store.num_bytes() <= bound + bound // 8 + 2000
    # the twin: a log written last keeps its response though the response itself is the oldest
    kept = _record(200, rng)
    store.put(kept)
    os.utime(tmp_path / f"{kept.response['id']}.json", ns=(time.time_ns(), 10**18))
    for _ in range(10):
        store.append_events(kept.response["id"], [b"y" * 100])
        record = _record(1500, rng)
        store.put(record)
    assert store.get(kept.response["id"]) == kept
