"""The pd_master's router against scripted nodes (bare zmq sockets): routing to the least-loaded nodes, one
Finished per request, the master's queue when every decode node is full (dispatched when room frees, failed with
a message after the queue timeout), a silent prefill node dropped with its requests failed and the decode side
told to abort, and header checks at registration. Every frame is sealed with the cluster's secret, as nodes do."""

from __future__ import annotations

import os
import tempfile
import time

import msgspec
import pytest
import zmq

from lightllm.engine.messages import Abort, EngineOutput, EngineStats, Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.pd.auth import PdAuth
from lightllm.server.pd.header import MODEL_FIELDS, TransferHeader
from lightllm.server.pd.messages import NodeInput, PdPrefill
from lightllm.server.pd.router import PdRouter, Registration

HEADER = TransferHeader(
    "f" * 16, "qwen3_5", [3], [0, 1, 2], 2, 4, 16, 16, [[1, 16], [1, 16]], 4, "float32", "float32", 2
)
ENCODER = msgspec.msgpack.Encoder()
SECRET = "router-test-secret"
# the master's checkpoint, as `header.model_reference` reads it
REFERENCE = {name: getattr(HEADER, name) for name in MODEL_FIELDS}


class ScriptedNode:
    def __init__(self, ctx: zmq.Context, role: str, name: str, capacity: int = 4):
        self.inbox, self.outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inbox = f"tcp://127.0.0.1:{self.inbox.bind_to_random_port('tcp://127.0.0.1')}"
        outbox = f"tcp://127.0.0.1:{self.outbox.bind_to_random_port('tcp://127.0.0.1')}"
        self.reg = Registration(role, name, inbox, outbox, capacity)
        self.credential = os.urandom(16).hex()
        self.auth = PdAuth(SECRET)
        self._decoder = msgspec.msgpack.Decoder(NodeInput)

    def recv(self, timeout_s: float = 5.0):
        assert self.inbox.poll(int(timeout_s * 1000)), f"{self.reg.node_id} got nothing"
        return self._decoder.decode(self.auth.open(self.reg.inbox, self.inbox.recv()))

    def nothing(self, wait_s: float = 0.2) -> bool:
        return not self.inbox.poll(int(wait_s * 1000))

    def send(self, *outputs: EngineOutput) -> None:
        self.outbox.send(self.auth.seal(self.reg.outbox, ENCODER.encode([*outputs, EngineStats()])))


class Cluster:
    def __init__(self, node_timeout_s: float = 30.0, queue_timeout_s: float = 30.0, request_timeout_s: float = 30.0):
        self.dir = tempfile.mkdtemp(prefix="lightllm-pd-test-")
        self.router = PdRouter(
            f"ipc://{os.path.join(self.dir, 'in')}",
            f"ipc://{os.path.join(self.dir, 'out')}",
            node_timeout_s,
            queue_timeout_s,
            auth=PdAuth(SECRET),
            reference=REFERENCE,
            request_timeout_s=request_timeout_s,
        )
        self.router.start()
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.PUSH)
        self.front.connect(self.router.input_addr)
        self.back = self.ctx.socket(zmq.PULL)
        self.back.connect(self.router.output_addr)
        self._decoder = msgspec.msgpack.Decoder(list[EngineOutput])

    def node(self, role: str, name: str, capacity: int = 4) -> ScriptedNode:
        node = ScriptedNode(self.ctx, role, name, capacity)
        assert self.router.register(node.reg, HEADER, node.credential) is None
        time.sleep(0.1)
        # its first heartbeat: the router routes only to nodes it has heard from
        node.send()
        time.sleep(0.05)
        return node

    def submit(self, req_id: str) -> None:
        self.front.send(ENCODER.encode(NewRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))))

    def outputs(self, wait_s: float = 1.0) -> list[EngineOutput]:
        """Every TokenChunk / Finished the router relays within `wait_s`."""
        found, deadline = [], time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.back.poll(20):
                found += [o for o in self._decoder.decode(self.back.recv()) if not isinstance(o, EngineStats)]
        return found

    def close(self) -> None:
        self.router.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture
def cluster():
    made = []

    def make(**kw):
        made.append(Cluster(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_routes_to_the_least_loaded_nodes_and_finishes_once(cluster):
    c = cluster()
    p = c.node("prefill", "p0")
    d0, d1 = c.node("decode", "d0"), c.node("decode", "d1")
    assert c.router.counts() == {"prefill": 1, "decode": 2}
    c.submit("a")
    c.submit("b")
    first, second = p.recv(), p.recv()
    assert isinstance(first, PdPrefill) and first.request.req_id == "a"
    # one request on each decode node
    assert {first.decode_addr, second.decode_addr} == {d0.reg.inbox, d1.reg.inbox}
    d = d0 if first.decode_addr == d0.reg.inbox else d1
    d.send(TokenChunk("a", [7]))
    c.front.send(ENCODER.encode(Abort("a")))
    # the abort goes to both nodes; both answer, the client hears one Finished
    assert isinstance(p.recv(), Abort) and isinstance(d.recv(), Abort)
    p.send(Finished("a", "abort"))
    d.send(Finished("a", "abort"))
    out = c.outputs()
    assert [(type(o).__name__, o.req_id) for o in out] == [("TokenChunk", "a"), ("Finished", "a")]
    # "b" ends on the prefill side (an unconfirmed transfer): its decode node is told to drop it
    other = d1 if d is d0 else d0
    p.send(Finished("b", "error", error="the decode node did not confirm the transfer within 1 s"))
    assert other.recv() == Abort("b")
    assert [o.req_id for o in c.outputs(0.3)] == ["b"]
    # teeth: a request the router does not know is never relayed
    d.send(TokenChunk("zzz", [1]))
    assert c.outputs(0.3) == []


def test_full_decode_nodes_queue_then_fail_with_a_message(cluster):
    c = cluster(queue_timeout_s=1.0)
    p = c.node("prefill", "p0")
    d = c.node("decode", "d0", capacity=1)
    c.submit("a")
    c.submit("b")
    assert p.recv().request.req_id == "a"
    # "b" waits in the master: the decode node holds one request, its capacity
    assert p.nothing(0.3)
    d.send(TokenChunk("a", [5]), Finished("a", "length", num_output_tokens=1))
    assert p.recv().request.req_id == "b"
    c.submit("c")
    start = time.monotonic()
    out = [o for o in c.outputs(2.0) if o.req_id == "c"]
    assert len(out) == 1 and out[0].reason == "error"
    assert "every decode node is full (waited 1 s for room)" in out[0].error
    assert 0.9 < time.monotonic() - start
    assert p.nothing()


def test_without_nodes_requests_fail_after_the_queue_timeout(cluster):
    c = cluster(queue_timeout_s=0.3)
    c.submit("a")
    out = c.outputs(1.0)
    assert len(out) == 1 and "no prefill and decode node is registered" in out[0].error


def test_a_silent_prefill_node_is_dropped_and_its_requests_fail(cluster):
    c = cluster(node_timeout_s=0.6)
    p = c.node("prefill", "p0")
    d = c.node("decode", "d0")
    c.submit("a")
    assert p.recv().request.req_id == "a"
    out, deadline = [], time.monotonic() + 1.5
    while time.monotonic() < deadline:
        # the decode node keeps its heartbeat, the prefill node says nothing
        d.send()
        out += c.outputs(0.1)
    assert len(out) == 1 and out[0].reason == "error" and "the prefill node p0 stopped responding" in out[0].error
    assert isinstance(d.recv(), Abort)
    assert c.router.counts() == {"prefill": 0, "decode": 1}
    # it comes back by registering again
    d.send()
    assert c.router.register(p.reg, HEADER, p.credential) is None
    time.sleep(0.1)
    p.send()
    time.sleep(0.1)
    assert c.router.counts() == {"prefill": 1, "decode": 1}


def test_registration_checks_the_header(cluster):
    c = cluster()
    c.node("prefill", "p0")
    node = ScriptedNode(c.ctx, "decode", "d0")
    # the model's fields against the master's own checkpoint
    error = c.router.register(node.reg, msgspec.structs.replace(HEADER, num_v_heads=8), node.credential)
    assert error.startswith("this decode node serves another model than the pd_master's")
    assert "num_v_heads: 4 (the pd_master's checkpoint) vs 8 (this node)" in error
    # the flags' fields against the nodes registered now
    error = c.router.register(node.reg, msgspec.structs.replace(HEADER, state_dtype="bfloat16"), node.credential)
    assert error.startswith("this decode node's transfer header differs from the registered nodes'")
    assert "state_dtype: float32 (registered nodes) vs bfloat16 (this node)" in error
    assert c.router.counts() == {"prefill": 1, "decode": 0}
    assert c.router.register(node.reg, HEADER, node.credential) is None
