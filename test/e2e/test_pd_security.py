"""The PD control plane under attack, with real processes on 127.0.0.1: a pd_master (secret and API key set, in
this process) and a prefill and a decode node (`lightllm.server.api_server`). Each test replays an attack that
once did harm and checks it now does none: a forged registration taking over a node id (unsealed, wrong secret,
replayed seal, another credential), a forged header on a master without nodes, a node with the wrong secret
(exit 2), unauthenticated and garbage frames sent to a node's inbox while a request runs, /pd/nodes without the
API key, and a bounded fuzz of /pd/register (no 5xx, no node added, the master still serves)."""

from __future__ import annotations

import os
import random
import threading

import httpx
import msgspec
import pytest
import zmq

from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.pd.auth import REGISTER_CHANNEL, SEAL_HEADER, PdAuth
from lightllm.server.pd.header import TransferHeader, model_reference
from lightllm.server.pd.messages import PdPrefill
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import wait_for
from unit_tests.server.pd_cluster import Master, node_log, start_node, stop

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCH = "qwen3_5"
SECRET, API_KEY = "pd-test-secret", "api-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NODE_FLAGS = ["--device", "cpu", "--max_running_requests", "4", "--max_total_token_num", "1024"]


def _header(model_dir: str, **changes) -> dict:
    fields = {**model_reference(model_dir), "state_dtype": "float32", "act_dtype": "float32", "mtp_step": 0}
    return msgspec.to_builtins(TransferHeader(**{**fields, **changes}))


def _body(model_dir: str, node_id: str, **changes) -> dict:
    body = {
        "role": "prefill",
        "node_id": node_id,
        "inbox": "tcp://127.0.0.1:9",
        "outbox": "tcp://127.0.0.1:9",
        "capacity": 4,
        "header": _header(model_dir),
        "credential": os.urandom(16).hex(),
        "pid": 1,
    }
    return {**body, **changes}


def _post(master: Master, body, secret: str | None = SECRET, seal: bytes | None = None) -> httpx.Response:
    """A registration as a node sends it; `secret` None: unsealed; `seal` given: that seal instead of a fresh one."""
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    headers = {"content-type": "application/json"}
    if seal is None and secret is not None:
        sealed = PdAuth(secret).seal(REGISTER_CHANNEL, raw)
        seal = sealed[: len(sealed) - len(raw)]
    if seal is not None:
        headers[SEAL_HEADER] = seal.hex()
    return httpx.post(f"{master.url}/pd/register", content=raw, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def cluster():
    model_dir = str(tiny_model_dir(ARCH))
    master = Master(model_dir, 6.0, pd_secret=SECRET, api_key=API_KEY)
    procs = []
    try:
        # finding 2: on a master with no nodes yet, a forged header must not become the reference
        forged = _header(model_dir, num_v_heads=64, state_dtype="bfloat16")
        attacks = {
            "unsealed": _post(master, _body(model_dir, "evil", header=forged), secret=None),
            "authenticated_other_model": _post(master, _body(model_dir, "evil", header=forged)),
        }
        procs += [start_node(master, model_dir, role, *NODE_FLAGS) for role in ("prefill", "decode")]
        procs.append(start_node(master, model_dir, "decode", *NODE_FLAGS, secret="not-the-secret"))
        wait_for(lambda: httpx.get(f"{master.url}/pd/ready").status_code == 200, 120, "both nodes registered")
        yield master, model_dir, procs, attacks
    finally:
        for proc in procs:
            stop(proc)
        master.close()


def _complete(master: Master, prompt: list[int], max_tokens: int = 6) -> httpx.Response:
    body = {
        "model": master.args.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{master.url}/v1/completions", json=body, headers=AUTH, timeout=60)


def _nodes(master: Master) -> list[dict]:
    return httpx.get(f"{master.url}/pd/nodes", headers=AUTH).json()["nodes"]


def test_a_forged_header_on_an_empty_master_is_refused_and_real_nodes_register(cluster):
    master, _, procs, attacks = cluster
    assert attacks["unsealed"].status_code == 401
    refused = attacks["authenticated_other_model"]
    assert refused.status_code == 409
    assert "num_v_heads: 4 (the pd_master's checkpoint) vs 64 (this node)" in refused.json()["error"]
    assert sorted(n["pid"] for n in _nodes(master)) == sorted(p.pid for p in procs[:2])


def test_a_node_with_the_wrong_secret_is_refused_and_exits_2(cluster):
    master, _, procs, _ = cluster
    wrong = procs[2]
    wrong.wait(120)
    assert wrong.returncode == 2
    assert "unauthenticated registration" in node_log(wrong)
    assert wrong.pid not in [n["pid"] for n in _nodes(master)]


def test_a_forged_node_cannot_take_over_a_node_id(cluster):
    master, model_dir, procs, _ = cluster
    prefill = next(n for n in _nodes(master) if n["role"] == "prefill")
    # the attacker listens where it wants the prompts to go
    ctx = zmq.Context()
    trap = ctx.socket(zmq.PULL)
    trap_addr = f"tcp://127.0.0.1:{trap.bind_to_random_port('tcp://127.0.0.1')}"
    takeover = _body(model_dir, prefill["node_id"], inbox=trap_addr, outbox=trap_addr)
    try:
        assert _post(master, takeover, secret=None).status_code == 401
        assert _post(master, takeover, secret="guessed").status_code == 401
        # even with the secret (a misconfigured node), another credential cannot take a registered id
        r = _post(master, takeover)
        assert r.status_code == 409 and "registered by another node" in r.json()["error"]
        # a captured seal is worth one registration: replayed, it is refused
        fresh = _body(model_dir, "p-extra", inbox=trap_addr, outbox=trap_addr, capacity=1)
        raw = msgspec.json.encode(fresh)
        sealed = PdAuth(SECRET).seal(REGISTER_CHANNEL, raw)
        seal = sealed[: len(sealed) - len(raw)]
        assert _post(master, raw, seal=seal).status_code == 200
        replay = _post(master, raw, seal=seal)
        assert replay.status_code == 401 and "replayed" in replay.json()["error"]
        # the registered p-extra never speaks: it gets no request, the real prefill node serves them all
        for _ in range(3):
            r = _complete(master, [5, 9, 13, 2])
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert not trap.poll(200)
        assert prefill["node_id"] in [n["node_id"] for n in _nodes(master) if n["pid"] == prefill["pid"]]
    finally:
        ctx.destroy(linger=0)


def test_unauthenticated_frames_to_a_node_inbox_do_no_harm(cluster):
    master, _, procs, _ = cluster
    prefill = next(n for n in _nodes(master) if n["role"] == "prefill")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(prefill["inbox"])
    forged = PdPrefill(NewRequest("forged", [1, 2, 3], SamplingParams(max_tokens=4)), "tcp://127.0.0.1:1")
    results = []
    legit = threading.Thread(target=lambda: results.append(_complete(master, [11, 12, 13, 14, 15], 12)))
    try:
        legit.start()
        rng = random.Random(3)
        for _ in range(50):
            # finding 5: a crafted prefill with a bad decode_addr; finding 3: garbage bytes; a wrong-secret seal
            push.send(msgspec.msgpack.encode(forged))
            push.send(rng.randbytes(rng.randrange(1, 200)))
            push.send(PdAuth("guessed").seal(prefill["inbox"], msgspec.msgpack.encode(forged)))
        legit.join(60)
        assert results and results[0].status_code == 200, results and results[0].text
        assert results[0].json()["usage"]["completion_tokens"] == 12
        assert all(p.poll() is None for p in procs[:2])
        log = node_log(procs[0])
        # every refusal is logged up to a bound: 150 bad frames give 20 lines
        assert "the seal does not match" in log and log.count("dropping an undecodable") == 20
    finally:
        ctx.destroy(linger=0)


def test_pd_nodes_needs_the_api_key_and_health_says_the_master_serves(cluster):
    master, _, _, _ = cluster
    r = httpx.get(f"{master.url}/pd/nodes")
    assert r.status_code == 401
    assert httpx.get(f"{master.url}/pd/nodes", headers=AUTH).status_code == 200
    assert httpx.get(f"{master.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{master.url}/pd/ready").json()["ready"] is True


def test_fuzzed_registrations_never_crash_the_master(cluster):
    master, model_dir, _, _ = cluster
    before = {n["node_id"] for n in _nodes(master)}
    rng = random.Random(5)
    statuses = []
    for i in range(150):
        kind = rng.randrange(5)
        if kind == 0:
            r = _post(master, rng.randbytes(rng.randrange(0, 400)), secret=rng.choice([None, SECRET]))
        elif kind == 1:
            r = _post(master, rng.randbytes(64), seal=rng.randbytes(rng.randrange(0, 80)))
        elif kind == 2:
            junk = rng.choice([[], {}, 5, "x", None, {"role": "decode"}, [1] * 100])
            r = _post(master, msgspec.json.encode(junk))
        elif kind == 3:
            field = rng.choice(["role", "inbox", "capacity", "header", "credential", "reads", "pid"])
            value = rng.choice([None, -1, 2**70, "", "tcp://0.0.0.0:1", [None], {"a": 1}, "x" * 2000])
            r = _post(master, {**_body(model_dir, f"fz{i}"), field: value})
        else:
            r = httpx.request(rng.choice(["GET", "PUT", "DELETE"]), f"{master.url}/pd/register", timeout=10)
        statuses.append(r.status_code)
    assert max(statuses) < 500, sorted(set(statuses))
    # nothing fuzzed registered (an earlier test's silent node may have been dropped meanwhile)
    assert {n["node_id"] for n in _nodes(master)} <= before
    assert httpx.get(f"{master.url}/pd/ready").status_code == 200
    assert _complete(master, [7, 8, 9]).status_code == 200
