"""The pd_master's router: stands where the engine process stands for the HTTP front-end (the same zmq link,
`NewRequest`/`Abort` in, `TokenChunk`/`Finished`/`EngineStats` out) and sends each request to one prefill and one
decode node.

It runs in a thread of the master process and owns every node socket. Per request it picks the least-loaded
prefill node and the least-loaded decode node with room (requests routed to a decode node and not finished are
its load; its room is its `max_running_requests` plus its `max_queue_len`); when no decode node has room the request waits
in the master's queue, and fails with a message after `--pd_queue_timeout_s`. Outputs are relayed in order
(the decode node emits every token, the first included); a request's first `Finished` wins and later ones are
dropped, so an abort answered by both nodes finishes once. A node silent for `--pd_node_timeout_s` (nodes send
stats every half second) is dropped: its requests fail and the other node of each is told to abort; a node silent
for `HEALTHY_SILENCE_S` gets no new requests meanwhile. A routed request with no output from its nodes for
`--pd_request_timeout_s` fails (503) and both nodes are told to abort it.

Every frame to and from a node is sealed (`auth.py`); a frame that is forged, replayed or unreadable is dropped
and logged, never fatal. A node id, once registered, can only be registered again with the same node credential
(a random token the node chose) until the node is dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from lightllm.engine.messages import Abort, EngineInput, EngineOutput, EngineStats, Finished, NewRequest, TokenChunk
from lightllm.server.launcher import EngineEndpoint
from lightllm.server.pd.auth import PdAuth, endpoint_problem
from lightllm.server.pd.header import RUNTIME_FIELDS, TransferHeader, header_mismatch
from lightllm.server.pd.messages import PdPrefill

logger = logging.getLogger(__name__)
POLL_MS = 20
STATS_INTERVAL_S = 0.5
# a node not heard from for this long gets no new requests (it is dropped after --pd_node_timeout_s)
HEALTHY_SILENCE_S = 4 * STATS_INTERVAL_S
# how many dropped frames are logged one by one (then one line per LOG_EVERY)
LOG_FIRST, LOG_EVERY = 20, 1000


@dataclass
class Registration:
    role: str
    node_id: str
    # the node's inbox (the master pushes there) and outbox (the master pulls from there)
    inbox: str
    outbox: str
    capacity: int
    # a decode node: the kinds of staging region it reads (`staging.py`), passed to prefill nodes with each request
    reads: list[str] = field(default_factory=list)
    # the node's process id on its host (for operators: which process a node id is)
    pid: int = 0


@dataclass
class _Node:
    reg: Registration
    push: zmq.Socket
    pull: zmq.Socket
    last_seen: float
    # an authenticated frame came from its outbox: the master can reach it (until then it gets no request)
    heard: bool = False
    stats: EngineStats = field(default_factory=EngineStats)
    req_ids: set[str] = field(default_factory=set)


@dataclass
class _Route:
    prefill: str
    decode: str
    # when either node last sent an output of this request (routing counts as one)
    last_output: float = 0.0


class _ThreadProcess:
    """What the front-end's engine watcher reads from a process: its exit code (None while running)."""

    exitcode = None


class PdRouter(EngineEndpoint):
    def __init__(
        self,
        input_addr: str,
        output_addr: str,
        node_timeout_s: float,
        queue_timeout_s: float,
        *,
        auth: PdAuth,
        reference: dict,
        request_timeout_s: float = 120.0,
    ):
        """`reference`: the model fields of the header (`header.model_reference`) every node must match."""
        self.input_addr, self.output_addr = input_addr, output_addr
        self.node_timeout_s = node_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.request_timeout_s = request_timeout_s
        self.auth, self.reference = auth, reference
        self.process = _ThreadProcess()
        self._lock = threading.Lock()
        # the runtime fields (dtypes, MTP steps) of the nodes registered now; reset when none is left
        self._runtime: dict | None = None
        self._registrations: queue.Queue[Registration] = queue.Queue()
        # node id -> role and sha256 of its credential, as seen by the HTTP thread (the router thread owns `_nodes`)
        self._roles: dict[str, str] = {}
        self._credentials: dict[str, bytes] = {}
        self.num_dropped_frames = 0
        self._nodes: dict[str, _Node] = {}
        self._routes: dict[str, _Route] = {}
        self._waiting: deque[tuple[NewRequest, float]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightllm-pd-router", daemon=True)
        self._ready = threading.Event()

    # the front-end's engine handle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    # called from the HTTP thread -----------------------------------------------------------------------------
    def register(self, reg: Registration, header: TransferHeader, credential: str) -> str | None:
        """Accept a node (None) or say why not. The model fields must match the master's checkpoint, the runtime
        fields the nodes registered now; a registered node id takes only the credential it first came with."""
        for name in ("inbox", "outbox"):
            problem = endpoint_problem(getattr(reg, name))
            if problem is not None:
                return f"{name}: {problem}"
        diff = header_mismatch(self.reference, header, "the pd_master's checkpoint")
        if diff is not None:
            return f"this {reg.role} node serves another model than the pd_master's: {diff}"
        digest = hashlib.sha256(credential.encode()).digest()
        with self._lock:
            known = self._credentials.get(reg.node_id)
            if known is not None and not hmac.compare_digest(known, digest):
                return f"node id {reg.node_id!r} is registered by another node (its credential differs)"
            runtime = {name: getattr(header, name) for name in RUNTIME_FIELDS}
            if self._runtime is not None and (known is None or len(self._roles) > 1):
                diff = header_mismatch(self._runtime, header)
                if diff is not None:
                    return f"this {reg.role} node's transfer header differs from the registered nodes': {diff}"
            self._runtime = runtime
            self._roles[reg.node_id] = reg.role
            self._credentials[reg.node_id] = digest
        self._registrations.put(reg)
        return None

    def counts(self) -> dict[str, int]:
        """Nodes by role that can take a request now: registered, connected and heard from recently."""
        if not self.is_alive():
            return {"prefill": 0, "decode": 0}
        with self._lock:
            roles = [n.reg.role for n in self._nodes.values() if self._healthy(n, time.monotonic())]
        return {"prefill": roles.count("prefill"), "decode": roles.count("decode")}

    def serving_problem(self) -> str | None:
        """Why no request can be served now (None: one can): no healthy prefill or decode node."""
        missing = [role for role, n in self.counts().items() if n == 0]
        if missing:
            return f"no healthy {' and no healthy '.join(missing)} node"
        return None

    def _healthy(self, node: _Node, now: float) -> bool:
        return node.heard and now - node.last_seen <= min(HEALTHY_SILENCE_S, self.node_timeout_s)

    def nodes(self) -> list[dict]:
        now = time.monotonic()
        with self._lock:
            return [
                {
                    "node_id": n.reg.node_id,
                    "role": n.reg.role,
                    "inbox": n.reg.inbox,
                    "pid": n.reg.pid,
                    "reads": n.reg.reads,
                    "num_requests": len(n.req_ids),
                    "seconds_since_heard": round(now - n.last_seen, 3),
                    # whether it takes new requests now (heard from, recently)
                    "healthy": self._healthy(n, now),
                    "stats": msgspec.to_builtins(n.stats),
                }
                for n in self._nodes.values()
            ]

    # the router thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        self._ctx = ctx
        front_in = ctx.socket(zmq.PULL)
        front_in.bind(self.input_addr)
        self._front_out = ctx.socket(zmq.PUSH)
        self._front_out.bind(self.output_addr)
        self._decoder = msgspec.msgpack.Decoder(EngineInput)
        self._out_decoder = msgspec.msgpack.Decoder(list[EngineOutput])
        self._encoder = msgspec.msgpack.Encoder()
        self._ready.set()
        last_stats = 0.0
        try:
            while not self._stop.is_set():
                self._take_registrations()
                poller = zmq.Poller()
                poller.register(front_in, zmq.POLLIN)
                for node in self._nodes.values():
                    poller.register(node.pull, zmq.POLLIN)
                events = dict(poller.poll(POLL_MS))
                out: list[EngineOutput] = []
                if front_in in events:
                    while front_in.poll(0):
                        out += self._on_front(self._decoder.decode(front_in.recv()))
                for node in list(self._nodes.values()):
                    if node.pull in events:
                        while node.pull.poll(0):
                            out += self._on_frame(node, node.pull.recv())
                out += self._check_nodes()
                out += self._check_routes()
                out += self._dispatch()
                now = time.monotonic()
                if now - last_stats > STATS_INTERVAL_S:
                    out.append(self._stats())
                    last_stats = now
                if out:
                    self._front_out.send(self._encoder.encode(out))
        except Exception:
            logger.exception("the PD router failed")
            raise
        finally:
            for node in self._nodes.values():
                node.push.close(linger=0)
                node.pull.close(linger=0)
            front_in.close(linger=0)
            self._front_out.close(linger=0)
            ctx.term()

    def _take_registrations(self) -> None:
        while not self._registrations.empty():
            reg = self._registrations.get()
            old = self._nodes.get(reg.node_id)
            if old is not None and old.reg == reg:
                # a periodic re-registration of a node this master knows
                continue
            if old is not None:
                with self._lock:
                    self._close(self._nodes.pop(reg.node_id))
            push, pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
            push.setsockopt(zmq.LINGER, 0)
            try:
                push.connect(reg.inbox)
                pull.connect(reg.outbox)
            except zmq.ZMQError as exc:
                # validated at registration; a name that does not resolve still lands here
                logger.error(
                    "%s node %s: cannot connect to %s / %s: %s", reg.role, reg.node_id, reg.inbox, reg.outbox, exc
                )
                push.close(linger=0)
                pull.close(linger=0)
                self._forget(reg.node_id)
                continue
            with self._lock:
                self._nodes[reg.node_id] = _Node(reg, push, pull, time.monotonic())
            logger.info("%s node %s registered (inbox %s)", reg.role, reg.node_id, reg.inbox)

    def _on_front(self, msg) -> list[EngineOutput]:
        if isinstance(msg, NewRequest):
            self._waiting.append((msg, time.monotonic()))
            return []
        if isinstance(msg, Abort):
            for item in self._waiting:
                if item[0].req_id == msg.req_id:
                    self._waiting.remove(item)
                    return [Finished(msg.req_id, "abort", num_prompt_tokens=len(item[0].prompt_ids))]
            route = self._routes.get(msg.req_id)
            if route is not None:
                for node_id in (route.prefill, route.decode):
                    self._send(node_id, msg)
        return []

    def _forget(self, node_id: str) -> None:
        with self._lock:
            self._roles.pop(node_id, None)
            self._credentials.pop(node_id, None)
            if not self._roles:
                self._runtime = None

    def _pick(self, role: str) -> _Node | None:
        now = time.monotonic()
        nodes = [n for n in self._nodes.values() if n.reg.role == role and self._healthy(n, now)]
        if role == "decode":
            nodes = [n for n in nodes if len(n.req_ids) < n.reg.capacity]
        return min(nodes, key=lambda n: len(n.req_ids), default=None)

    def _dispatch(self) -> list[EngineOutput]:
        out: list[EngineOutput] = []
        now = time.monotonic()
        while self._waiting:
            msg, since = self._waiting[0]
            prefill, decode = self._pick("prefill"), self._pick("decode")
            if prefill is None or decode is None:
                if now - since <= self.queue_timeout_s:
                    break
                self._waiting.popleft()
                out.append(
                    Finished(
                        msg.req_id,
                        "error",
                        num_prompt_tokens=len(msg.prompt_ids),
                        error=self._no_room(),
                        error_status=503,
                    )
                )
                continue
            self._waiting.popleft()
            self._routes[msg.req_id] = _Route(prefill.reg.node_id, decode.reg.node_id, now)
            prefill.req_ids.add(msg.req_id)
            decode.req_ids.add(msg.req_id)
            self._send(prefill.reg.node_id, PdPrefill(msg, decode.reg.inbox, decode.reg.reads))
        return out

    def _no_room(self) -> str:
        counts = {role: sum(n.reg.role == role for n in self._nodes.values()) for role in ("prefill", "decode")}
        if not counts["prefill"] or not counts["decode"]:
            missing = " and ".join(role for role, n in counts.items() if not n)
            return f"no {missing} node is registered with the pd_master (waited {self.queue_timeout_s:g} s)"
        return f"every decode node is full (waited {self.queue_timeout_s:g} s for room); retry later"

    def _on_frame(self, node: _Node, frame: bytes) -> list[EngineOutput]:
        """One frame from a node's outbox: its outputs, or none when it is forged, replayed or unreadable."""
        try:
            outputs = self._out_decoder.decode(self.auth.open(node.reg.outbox, frame))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_dropped_frames += 1
            if self.num_dropped_frames <= LOG_FIRST or self.num_dropped_frames % LOG_EVERY == 0:
                logger.warning(
                    "dropped a frame from %s node %s (%d so far): %s",
                    node.reg.role,
                    node.reg.node_id,
                    self.num_dropped_frames,
                    exc,
                )
            return []
        return self._on_node(node, outputs)

    def _on_node(self, node: _Node, outputs: list[EngineOutput]) -> list[EngineOutput]:
        node.last_seen, node.heard = time.monotonic(), True
        relayed: list[EngineOutput] = []
        for out in outputs:
            if isinstance(out, EngineStats):
                node.stats = out
                continue
            route = self._routes.get(out.req_id)
            if route is None or node.reg.node_id not in (route.prefill, route.decode):
                # not this node's request: a node cannot answer for another's
                continue
            route.last_output = node.last_seen
            if isinstance(out, TokenChunk) and node.reg.node_id == route.decode:
                # the decode node holds it now: no longer the prefill node's load
                self._discard(route.prefill, out.req_id)
            if isinstance(out, Finished):
                self._finish_route(out.req_id)
                if node.reg.node_id == route.prefill:
                    # ended on the prefill side (e.g. an unconfirmed transfer): the decode node must not hold it
                    self._send(route.decode, Abort(out.req_id))
            relayed.append(out)
        return relayed

    def _finish_route(self, req_id: str) -> _Route | None:
        route = self._routes.pop(req_id, None)
        if route is not None:
            self._discard(route.prefill, req_id)
            self._discard(route.decode, req_id)
        return route

    def _discard(self, node_id: str, req_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.req_ids.discard(req_id)

    def _check_nodes(self) -> list[EngineOutput]:
        """Drop nodes not heard from within the timeout: fail their requests, abort them on the other node."""
        out: list[EngineOutput] = []
        now = time.monotonic()
        for node in [n for n in self._nodes.values() if now - n.last_seen > self.node_timeout_s]:
            logger.error(
                "%s node %s silent for %.1f s: dropping it and failing its %d requests",
                node.reg.role,
                node.reg.node_id,
                now - node.last_seen,
                len(node.req_ids),
            )
            with self._lock:
                del self._nodes[node.reg.node_id]
            self._forget(node.reg.node_id)
            self._close(node)
            error = f"the {node.reg.role} node {node.reg.node_id} stopped responding"
            for req_id in list(node.req_ids):
                route = self._finish_route(req_id)
                if route is not None:
                    other = route.decode if node.reg.role == "prefill" else route.prefill
                    self._send(other, Abort(req_id))
                out.append(Finished(req_id, "error", error=error))
        return out

    def _check_routes(self) -> list[EngineOutput]:
        """Fail routed requests whose nodes have said nothing of them for the request timeout; both nodes abort."""
        now = time.monotonic()
        stalled = [r for r, route in self._routes.items() if now - route.last_output > self.request_timeout_s]
        out: list[EngineOutput] = []
        for req_id in stalled:
            route = self._finish_route(req_id)
            logger.error(
                "request %s: no output from %s / %s for %.0f s; failing it",
                req_id,
                route.prefill,
                route.decode,
                now - route.last_output,
            )
            for node_id in (route.prefill, route.decode):
                self._send(node_id, Abort(req_id))
            error = f"no output from the prefill/decode nodes for {self.request_timeout_s:g} s; retry later"
            out.append(Finished(req_id, "error", error=error, error_status=503))
        return out

    def _send(self, node_id: str, msg) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        try:
            node.push.send(self.auth.seal(node.reg.inbox, self._encoder.encode(msg)), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.error("node %s does not accept messages; %s dropped", node_id, type(msg).__name__)

    @staticmethod
    def _close(node: _Node) -> None:
        node.push.close(linger=0)
        node.pull.close(linger=0)

    def _stats(self) -> EngineStats:
        """The decode nodes' free slots and KV (where requests run), every node's queue, the master's queue."""
        total = EngineStats(num_waiting=len(self._waiting))
        for node in self._nodes.values():
            s = node.stats
            total.num_waiting += s.num_waiting
            total.num_running += s.num_running
            total.num_preemptions += s.num_preemptions
            total.num_steps += s.num_steps
            if node.reg.role == "decode":
                total.num_free_kv_tokens += s.num_free_kv_tokens
                total.num_free_state_slots += s.num_free_state_slots
                total.num_spec_windows += s.num_spec_windows
                total.num_draft_tokens += s.num_draft_tokens
                total.num_accepted_draft_tokens += s.num_accepted_draft_tokens
        return total
