"""The pd_master's router: stands where the engine process stands for the HTTP front-end (the same zmq link,
`NewRequest`/`Abort` in, `TokenChunk`/`Finished`/`EngineStats` out) and sends each request to one prefill and one
decode node.

It runs in a thread of the master process and owns every node socket. Per request it picks the least-loaded
prefill node and the least-loaded decode node with room (requests routed to a decode node and not finished are
its load; its room is its `max_running_requests` plus its `max_queue_len`); when no decode node has room the request waits
in the master's queue, and fails with a message after `--pd_queue_timeout_s`. Outputs are relayed in order
(the decode node emits every token, the first included); a request's first `Finished` wins and later ones are
dropped, so an abort answered by both nodes finishes once. A node silent for `--pd_node_timeout_s` (nodes send
stats every half second) is dropped: its requests fail and the other node of each is told to abort.
"""

from __future__ import annotations

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
from lightllm.server.pd.header import TransferHeader, header_mismatch
from lightllm.server.pd.messages import PdPrefill

logger = logging.getLogger(__name__)
POLL_MS = 20
STATS_INTERVAL_S = 0.5


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
    stats: EngineStats = field(default_factory=EngineStats)
    req_ids: set[str] = field(default_factory=set)


@dataclass
class _Route:
    prefill: str
    decode: str


class _ThreadProcess:
    """What the front-end's engine watcher reads from a process: its exit code (None while running)."""

    exitcode = None


class PdRouter(EngineEndpoint):
    def __init__(self, input_addr: str, output_addr: str, node_timeout_s: float, queue_timeout_s: float):
        self.input_addr, self.output_addr = input_addr, output_addr
        self.node_timeout_s = node_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.process = _ThreadProcess()
        self._lock = threading.Lock()
        self._header: TransferHeader | None = None
        self._registrations: queue.Queue[Registration] = queue.Queue()
        # node id -> role, as seen by the HTTP thread (the router thread owns `_nodes`)
        self._roles: dict[str, str] = {}
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
    def register(self, reg: Registration, header: TransferHeader) -> str | None:
        """Accept a node (None) or say why not: the first node's header is the reference for every later one."""
        with self._lock:
            if self._header is not None:
                diff = header_mismatch(self._header, header)
                if diff is not None:
                    return f"this {reg.role} node's transfer header differs from the registered nodes': {diff}"
            self._header = self._header or header
            self._roles[reg.node_id] = reg.role
        self._registrations.put(reg)
        return None

    def counts(self) -> dict[str, int]:
        """Healthy registered nodes by role."""
        with self._lock:
            roles = list(self._roles.values())
        return {"prefill": roles.count("prefill"), "decode": roles.count("decode")}

    def nodes(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "node_id": n.reg.node_id,
                    "role": n.reg.role,
                    "inbox": n.reg.inbox,
                    "pid": n.reg.pid,
                    "reads": n.reg.reads,
                    "num_requests": len(n.req_ids),
                    "seconds_since_heard": round(time.monotonic() - n.last_seen, 3),
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
                            out += self._on_node(node, self._out_decoder.decode(node.pull.recv()))
                out += self._check_nodes()
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
                self._close(self._nodes.pop(reg.node_id))
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(reg.inbox)
            pull = self._ctx.socket(zmq.PULL)
            pull.connect(reg.outbox)
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

    def _pick(self, role: str) -> _Node | None:
        nodes = [n for n in self._nodes.values() if n.reg.role == role]
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
            self._routes[msg.req_id] = _Route(prefill.reg.node_id, decode.reg.node_id)
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

    def _on_node(self, node: _Node, outputs: list[EngineOutput]) -> list[EngineOutput]:
        node.last_seen = time.monotonic()
        relayed: list[EngineOutput] = []
        for out in outputs:
            if isinstance(out, EngineStats):
                node.stats = out
                continue
            route = self._routes.get(out.req_id)
            if route is None:
                continue
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
                node.reg.role, node.reg.node_id, now - node.last_seen, len(node.req_ids),
            )  # fmt: skip
            with self._lock:
                del self._nodes[node.reg.node_id]
                self._roles.pop(node.reg.node_id, None)
            self._close(node)
            error = f"the {node.reg.role} node {node.reg.node_id} stopped responding"
            for req_id in list(node.req_ids):
                route = self._finish_route(req_id)
                if route is not None:
                    other = route.decode if node.reg.role == "prefill" else route.prefill
                    self._send(other, Abort(req_id))
                out.append(Finished(req_id, "error", error=error))
        return out

    def _send(self, node_id: str, msg) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        try:
            node.push.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
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
