"""The pd_master's router against hostile or broken nodes (scripted zmq sockets): garbage, unsealed, replayed and
misdirected frames are dropped while routing goes on; a node cannot answer for another node's request or take
over a registered node id; a node silent for a few heartbeats gets no new request; an endpoint nobody can
connect to never counts as healthy; a routed request nobody answers fails with 503 and both nodes abort it; a
bounded fuzz of frames and registrations leaves the router alive."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from lightllm.engine.messages import Abort, EngineStats, Finished, TokenChunk
from lightllm.server.pd.messages import PdPrefill
from lightllm.server.pd.router import HEALTHY_SILENCE_S, Registration
from unit_tests.server.test_pd_router import ENCODER, HEADER, Cluster, ScriptedNode


@pytest.fixture
def cluster():
    made = []

    def make(**kw):
        made.append(Cluster(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _garbage(node: ScriptedNode, rng: random.Random) -> bytes:
    """One bad frame of a random kind."""
    kind = rng.randrange(6)
    payload = rng.randbytes(rng.randrange(0, 300))
    if kind == 0:
        return payload
    if kind == 1:
        # well-formed outputs, not sealed
        return ENCODER.encode([TokenChunk("a", [1]), EngineStats()])
    if kind == 2:
        # sealed, not msgpack
        return node.auth.seal(node.reg.outbox, payload)
    if kind == 3:
        # sealed msgpack of the wrong shape
        return node.auth.seal(node.reg.outbox, ENCODER.encode({"type": "TokenChunk", "req_id": 5}))
    if kind == 4:
        # sealed for another socket
        return node.auth.seal(node.reg.inbox, ENCODER.encode([EngineStats()]))
    frame = node.auth.seal(node.reg.outbox, ENCODER.encode([EngineStats()]))
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


def test_garbage_and_replayed_frames_are_dropped_and_routing_goes_on(cluster):
    c = cluster()
    p, d = c.node("prefill", "p0"), c.node("decode", "d0")
    rng = random.Random(7)
    for _ in range(300):
        p.outbox.send(_garbage(p, rng))
    # a replay of a genuine frame: its first copy counts, the second is dropped
    frame = d.auth.seal(d.reg.outbox, ENCODER.encode([EngineStats()]))
    d.outbox.send(frame)
    d.outbox.send(frame)
    c.submit("a")
    assert p.recv().request.req_id == "a"
    d.send(TokenChunk("a", [4]), Finished("a", "length", num_output_tokens=1))
    out = c.outputs(0.5)
    assert [(type(o).__name__, o.req_id) for o in out] == [("TokenChunk", "a"), ("Finished", "a")]
    assert c.router.is_alive()
    assert c.router.num_dropped_frames == 301


def test_a_node_cannot_answer_for_another_nodes_request(cluster):
    c = cluster()
    p = c.node("prefill", "p0")
    d0, d1 = c.node("decode", "d0", capacity=1), c.node("decode", "d1", capacity=1)
    c.submit("a")
    route = p.recv()
    owner, other = (d0, d1) if route.decode_addr == d0.reg.inbox else (d1, d0)
    other.send(TokenChunk("a", [666]), Finished("a", "stop"))
    assert c.outputs(0.3) == []
    owner.send(TokenChunk("a", [5]))
    assert [o.token_ids for o in c.outputs(0.3)] == [[5]]


def test_a_node_id_is_kept_by_its_credential(cluster):
    c = cluster(node_timeout_s=0.8)
    p = c.node("prefill", "p0")
    thief = ScriptedNode(c.ctx, "prefill", "p0")
    error = c.router.register(thief.reg, HEADER, thief.credential)
    assert error == "node id 'p0' is registered by another node (its credential differs)"
    # the owner registers again as often as it likes
    assert c.router.register(p.reg, HEADER, p.credential) is None
    # once the owner is dropped (silent past the node timeout) the id is free
    time.sleep(1.2)
    c.outputs(0.1)
    assert c.router.register(thief.reg, HEADER, thief.credential) is None


def test_a_quiet_node_gets_no_new_request_before_it_is_dropped(cluster):
    c = cluster(node_timeout_s=30.0, queue_timeout_s=0.5)
    p, d = c.node("prefill", "p0"), c.node("decode", "d0")
    deadline = time.monotonic() + HEALTHY_SILENCE_S + 0.3
    while time.monotonic() < deadline:
        # the prefill node keeps its heartbeat, the decode node has gone quiet
        p.send()
        time.sleep(0.1)
    assert c.router.counts() == {"prefill": 1, "decode": 0}
    assert c.router.serving_problem() == "no healthy decode node"
    c.submit("a")
    out = []
    for _ in range(10):
        p.send()
        out += c.outputs(0.1)
    assert len(out) == 1 and out[0].reason == "error" and out[0].error_status == 503
    assert p.nothing(0.1) and d.nothing(0.1)
    # teeth: heard from again, it serves
    d.send()
    p.send()
    time.sleep(0.1)
    assert c.router.counts() == {"prefill": 1, "decode": 1}
    c.submit("b")
    assert p.recv().request.req_id == "b"


def test_an_endpoint_nobody_can_reach_never_serves(cluster):
    c = cluster(queue_timeout_s=0.5)
    p = c.node("prefill", "p0")
    bad = Registration("decode", "d-bad", "tcp://nonsense", p.reg.outbox, 4)
    assert c.router.register(bad, HEADER, "c" * 32) == "inbox: 'tcp://nonsense' is not a tcp://host:port endpoint"
    # a well-formed endpoint where nothing listens: registered, never heard from, never healthy
    ghost = Registration("decode", "d-ghost", "tcp://no-such-host.invalid:5555", "tcp://127.0.0.1:9", 4)
    assert c.router.register(ghost, HEADER, "c" * 32) is None
    time.sleep(HEALTHY_SILENCE_S + 0.3)
    p.send()
    time.sleep(0.1)
    assert c.router.counts() == {"prefill": 1, "decode": 0}
    c.submit("a")
    out = []
    for _ in range(10):
        p.send()
        out += c.outputs(0.1)
    assert len(out) == 1 and out[0].error_status == 503
    assert p.nothing(0.1)
    assert c.router.is_alive()


def test_a_routed_request_nobody_answers_fails_with_503(cluster):
    c = cluster(request_timeout_s=0.6)
    p, d = c.node("prefill", "p0"), c.node("decode", "d0")
    c.submit("a")
    c.submit("b")
    assert isinstance(p.recv(), PdPrefill) and isinstance(p.recv(), PdPrefill)
    out = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        # both nodes are alive; "b" makes progress, "a" none
        p.send()
        d.send(TokenChunk("b", [3]))
        out += [o for o in c.outputs(0.1) if o.req_id == "a"]
    assert len(out) == 1 and out[0].reason == "error" and out[0].error_status == 503
    assert "no output from the prefill/decode nodes for 0.6 s" in out[0].error
    assert p.recv() == Abort("a") and d.recv() == Abort("a")


def test_fuzzed_registrations_never_crash_the_router(cluster):
    c = cluster()
    rng = random.Random(11)
    refused = 0
    for i in range(300):
        host = rng.choice(["127.0.0.1", "0.0.0.0", "", "x" * 300, "[::1]", "a b"])
        port = rng.choice([0, 1, 5555, 65535, 70000, -1])
        addr = rng.choice([f"tcp://{host}:{port}", rng.randbytes(8).hex(), f"ipc://{host}"])
        reg = Registration(rng.choice(["prefill", "decode"]), f"n{i}", addr, addr, rng.randrange(1, 9))
        header = msgspec.structs.replace(HEADER, num_k_heads=rng.choice([2, 2, 3]))
        refused += c.router.register(reg, header, rng.randbytes(16).hex()) is not None
    time.sleep(0.2)
    assert c.router.is_alive() and refused > 200
    # the nodes that did register never heard from: nothing counts as serving
    assert c.router.counts() == {"prefill": 0, "decode": 0}
