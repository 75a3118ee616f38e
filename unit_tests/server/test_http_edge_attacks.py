"""Attacks on the HTTP edge that once did harm, against the real app and engine process on 127.0.0.1 (the fake
runner, slowed so requests stay in flight): huge bodies under the size cap no longer stall the event loop
(/health timed while each is sent), 60 concurrent streams cannot pass a queue of 2, a half-sent head, a silent
connection and a half-sent body are cut off, a request head over the bound gets 431, degenerate sampling values
behave as greedy or are refused, and the smaller items: a 405 names the allowed methods, deeply nested JSON says so, best_of is honoured or refused, and
the OpenAPI schema states the ranges and forms the server accepts."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lightllm.server.http.edge import json_items
from lightllm.server.http.protocol import CompletionRequest
from unit_tests.server.live_server import LiveServer, slow_server

KEY = "edge-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_RUNNING, MAX_QUEUE = 2, 2
TIMEOUT_S = 1.0
# what /health may take while another client's request is being read and refused: 9 in 10 answers within 50 ms,
# none beyond 200 ms (scheduling noise of a shared 2-core runner; the stall this prevents lasted seconds)
HEALTH_P90_S, HEALTH_MAX_S = 0.05, 0.2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = slow_server(
        tmp_path_factory.mktemp("slow"),
        max_running_requests=MAX_RUNNING,
        max_queue_len=MAX_QUEUE,
        max_total_token_num=2048,
        api_key=KEY,
        http_header_timeout_s=TIMEOUT_S,
        http_body_timeout_s=TIMEOUT_S,
    )
    yield s
    s.close()


def _post(server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60, **kw)


# the attacker: another process (in this one, its thread would share the server's GIL and slow /health itself)
SENDER = """
import http.client, sys
body = open(sys.argv[3], "rb").read()
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
conn.request("POST", sys.argv[2], body, {"Authorization": "Bearer %s" % sys.argv[4], "Content-Type": "application/json"})
reply = conn.getresponse()
sys.stdout.write("%d %s" % (reply.status, reply.read().decode()))
"""


def _health_during(server, path: str, body: bytes, tmp_path) -> tuple[int, dict, list[float]]:
    """`body` posted to `path` by another process; /health timed over and over until that post is answered."""
    (tmp_path / "body.json").write_bytes(body)
    argv = [sys.executable, "-c", SENDER, str(server.port), path, str(tmp_path / "body.json"), KEY]
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        client.get("/health")
        sender = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        while sender.poll() is None:
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    status, _, reply = sender.stdout.read().partition(" ")
    return int(status), json.loads(reply), latencies


def _bodies(model: str) -> dict[str, tuple[str, bytes]]:
    chat = [{"role": "user", "content": "x"}] * 400_000
    return {
        "nested_prompt": ("/v1/completions", json.dumps({"model": model, "prompt": [[5]] * 2_500_000}).encode()),
        "chat_messages": ("/v1/chat/completions", json.dumps({"model": model, "messages": chat}).encode()),
        "tokenize": ("/tokenize", json.dumps({"model": model, "messages": chat}).encode()),
    }


@pytest.mark.parametrize("name", ["nested_prompt", "chat_messages", "tokenize"])
def test_a_huge_body_under_the_size_cap_does_not_stall_health(server, name, tmp_path):
    path, body = _bodies(server.model)[name]
    assert len(body) < server.args.max_request_body_bytes
    status, reply, latencies = _health_during(server, path, body, tmp_path)
    assert status == 413 and "--max_request_json_items" in reply["error"]["message"]
    _assert_prompt(latencies)


def _assert_prompt(latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    assert p90 < HEALTH_P90_S and ordered[-1] < HEALTH_MAX_S, [round(x * 1e3, 1) for x in ordered]


def test_teeth_without_the_bound_a_huge_body_stalls_health(tmp_path):
    """The same measurement sees the stall when the bound is lifted (a smaller body: it is parsed in full)."""
    s = LiveServer(device="cpu", max_running_requests=2, max_total_token_num=1024, max_request_json_items=10**9)
    try:
        body = json.dumps({"model": s.model, "prompt": [[5]] * 400_000}).encode()
        _, _, latencies = _health_during(s, "/v1/completions", body, tmp_path)
        with pytest.raises(AssertionError):
            _assert_prompt(latencies)
    finally:
        s.close()


def test_json_items_bounds_the_values_of_a_body():
    rng = random.Random(0)
    for _ in range(50):
        value = [rng.choice([1, "a,b", {"k": [2, 3]}, [], None]) for _ in range(rng.randrange(0, 20))]
        body = json.dumps({"prompt": value}).encode()
        values = _count_values(json.loads(body))
        # exact but for empty containers (a bracket, no value inside) and commas inside strings
        empty = body.count(b"[]") + body.count(b"{}")
        assert values <= json_items(body) == values + empty + body.count(b"a,b")


def _count_values(value) -> int:
    if isinstance(value, list):
        return 1 + sum(_count_values(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_count_values(v) for v in value.values())
    return 1


def test_sixty_concurrent_streams_cannot_pass_a_queue_of_two(server):
    body = {"model": server.model, "prompt": "fill", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None]:
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            await r.aread()
            return r.status_code, r.headers.get("retry-after")

    async def flood():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*[one(client) for _ in range(60)])

    results = asyncio.run(flood())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(accepted) + len(refused) == 60
    assert 1 <= len(accepted) <= MAX_RUNNING + MAX_QUEUE, len(accepted)
    assert all(retry == "1" for _, retry in refused)
    # the room comes back once the streams are over
    r = _post(server, "/v1/completions", {**body, "stream": False, "max_tokens": 1})
    assert r.status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection within `seconds`, or None if it stayed open."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    return data


def test_an_idle_connection_and_a_half_sent_head_are_closed(server):
    idle = socket.create_connection(("127.0.0.1", server.port))
    loris = socket.create_connection(("127.0.0.1", server.port))
    start = time.monotonic()
    loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    # a header byte now and then: each would have kept a connection alive forever
    for _ in range(3):
        time.sleep(0.25)
        loris.sendall(b"X")
    assert _closed_within(loris, 3 * TIMEOUT_S) == b""
    assert _closed_within(idle, 3 * TIMEOUT_S) == b""
    assert time.monotonic() - start < 3 * TIMEOUT_S
    # teeth: a complete request on a fresh connection is served
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize("whole", [True, False])
def test_a_request_head_over_the_bound_gets_431_and_a_head_under_it_is_served(server, whole):
    """`whole`: the head arrives in one piece (seen parsed); else a header that never ends arrives in pieces within
    the head deadline (seen as raw bytes)."""
    from lightllm.server.http.server import MAX_HEAD_BYTES

    def head(header_bytes: int) -> bytes:
        start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
        return start + b"a" * (header_bytes - len(start) - 4) + (b"\r\n\r\n" if whole else b"")

    for size, expected in ((MAX_HEAD_BYTES + 1024, b"HTTP/1.1 431"), (MAX_HEAD_BYTES - 1024, b"HTTP/1.1 200")):
        sock = socket.create_connection(("127.0.0.1", server.port))
        data = head(size)
        step = len(data) if whole else -(-len(data) // 8)
        try:
            for i in range(0, len(data), step):
                sock.sendall(data[i : i + step])
                time.sleep(0 if whole else 0.05)
            if not whole and expected.endswith(b"200"):
                sock.sendall(b"\r\n\r\n")
        except ConnectionError:
            pass
        reply = _closed_within(sock, 3 * TIMEOUT_S) if expected.endswith(b"431") else sock.recv(65536)
        sock.close()
        assert reply is not None and reply.startswith(expected), (size, reply[:200] if reply else reply)


def test_a_half_sent_body_gets_408(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"model": ')
    reply = _closed_within(sock, 3 * TIMEOUT_S)
    assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--http_body_timeout_s" in reply


def _complete(server, **params) -> httpx.Response:
    body = {"model": server.model, "prompt": [1, 2, 3, 4], "max_tokens": 24, "ignore_eos": True, "logprobs": 0}
    return _post(server, "/v1/completions", {**body, **params})


def _tokens(reply: httpx.Response) -> list[str]:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("params", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-6, "seed": 3}])
def test_degenerate_temperature_or_top_p_is_greedy(server, params):
    greedy = _tokens(_complete(server, temperature=0))
    assert len(set(greedy)) > 1
    assert _tokens(_complete(server, **params)) == greedy
    # teeth: a real temperature samples something else
    assert _tokens(_complete(server, temperature=2.0, seed=1)) != greedy


def test_a_meaningless_repetition_penalty_is_refused(server):
    r = _complete(server, repetition_penalty=1e-300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    assert "greater than or equal to 0.01" in r.json()["error"]["message"]
    assert _complete(server, repetition_penalty=0.01).status_code == 200


def test_random_valid_sampling_never_gives_a_constant_stream(server):
    rng = random.Random(17)
    for _ in range(12):
        params = {
            "temperature": rng.choice([1e-300, 1e-6, 0.0, rng.uniform(0.05, 2.0)]),
            "top_p": rng.choice([1e-300, 1e-6, rng.uniform(0.05, 1.0), 1.0]),
            "top_k": rng.choice([-1, 1, 5, 64]),
            "repetition_penalty": rng.uniform(1.0, 10.0),
            "presence_penalty": rng.uniform(0.0, 2.0),
            "frequency_penalty": rng.uniform(0.0, 2.0),
            "seed": rng.randrange(1000),
        }
        tokens = _tokens(_complete(server, **params))
        assert len(set(tokens)) > 1, params


def test_405_names_the_allowed_methods(server):
    r = httpx.get(f"{server.base_url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


def test_deeply_nested_json_says_so(server):
    body = b'{"model": "m", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body's JSON nests too deeply"
    # teeth: bytes that are not UTF-8 are named as such
    r = _post(server, "/v1/completions", b'{"model": "\xff\xfe"}')
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]


def test_best_of_is_honoured_when_it_equals_n_and_refused_otherwise(server):
    same = _complete(server, temperature=0, n=2, best_of=2)
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
    r = _complete(server, n=1, best_of=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert "only best_of equal to n (1)" in r.json()["error"]["message"]


def test_the_schema_states_what_the_server_accepts(server):
    fields = CompletionRequest.model_json_schema()["properties"]
    penalty = next(b for b in fields["repetition_penalty"]["anyOf"] if b.get("type") == "number")
    assert (penalty["minimum"], penalty["maximum"]) == (0.01, 10.0)
    for value, ok in ((0.01, True), (0.005, False), (10.0, True), (10.5, False)):
        assert (_complete(server, repetition_penalty=value).status_code == 200) is ok, value
    # the prompt's four accepted forms are each a branch of its schema; a form outside them is refused
    kinds = [(b["type"], b.get("items", {}).get("type")) for b in fields["prompt"]["anyOf"]]
    assert kinds == [("string", None), ("array", "string"), ("array", "integer"), ("array", "array")]
    for prompt, ok in (
        ("hi", True),
        (["a", "b"], True),
        ([1, 2], True),
        ([[1], [2, 3]], True),
        ([1, "a"], False),
        ({"a": 1}, False),
    ):
        assert (_complete(server, prompt=prompt, max_tokens=1).status_code == 200) is ok, prompt
    assert [b["type"] for b in fields["stop"]["anyOf"]] == ["string", "array", "null"]
