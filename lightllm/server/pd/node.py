"""A prefill or decode node: one engine (in this process) behind two zmq sockets, registered with the pd_master.

The node binds its inbox (PULL: the master's `PdPrefill`/`Abort`, other nodes' `PdTransfer`/`TransferAck`) and
outbox (PUSH: `TokenChunk`/`Finished`/`EngineStats` to the master) on `--host` at free ports, then registers
them with the master over HTTP (`POST /pd/register` at `--pd_master_ip:--pd_master_port`) with its transfer
header. A refused header ends the process with exit code 2 and the master's reason. Registration is repeated in
the background, so a restarted master learns of the node again. Stats go out every half second: the master's
heartbeat.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import httpx
import msgspec
import zmq

from lightllm.engine.messages import EngineOutput, Finished
from lightllm.server.args import ServerArgs
from lightllm.server.engine_process import build_engine, quiet_garbage_collector
from lightllm.server.model_info import ModelInfo
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import NodeInput
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.server.pd.transport import ZmqHostTransport
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 20
# how long a starting node waits for the master to answer, and how often a running node registers again
REGISTER_WAIT_S = 120.0
REREGISTER_INTERVAL_S = 5.0


class RegistrationRefused(RuntimeError):
    pass


def advertised_host(host: str) -> str:
    """The address other processes reach a socket bound on `host` at (a wildcard bind advertises the host's)."""
    if host in ("0.0.0.0", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def register(master_url: str, body: dict, wait_s: float) -> None:
    """POST the registration until the master answers (at most `wait_s`); RegistrationRefused on a refusal."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = httpx.post(f"{master_url}/pd/register", json=body, timeout=10.0)
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise RegistrationRefused(
                    f"the pd_master at {master_url} did not answer within {wait_s:g} s: {exc}"
                ) from None
            time.sleep(0.5)
            continue
        if reply.status_code == 200:
            return
        raise RegistrationRefused(f"the pd_master refused this node: {reply.json().get('error', reply.text)}")


def serve_node(args: ServerArgs, info: ModelInfo, runner_factory: str = DEFAULT_RUNNER_FACTORY) -> int:
    """Run a prefill or decode node until SIGTERM/SIGINT; returns the exit code (2: the master refused it)."""
    engine = build_engine(args, info, runner_factory)
    logger.info("%s node engine ready: %s", args.run_mode, engine.capacity_report())
    header = runner_header(engine.runner, info.model_dir)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 0)
    host = advertised_host(args.host)
    inbox_addr = f"tcp://{host}:{inbox.bind_to_random_port(f'tcp://{args.host}')}"
    outbox_addr = f"tcp://{host}:{outbox.bind_to_random_port(f'tcp://{args.host}')}"
    transport = ZmqHostTransport(ctx)
    fingerprint = header.fingerprint()
    if args.run_mode == "prefill":
        role = PrefillRole(engine, transport, fingerprint, inbox_addr, args.pd_transfer_timeout_s)
    else:
        role = DecodeRole(engine, transport, fingerprint)
    master_url = f"http://{args.pd_master_ip}:{args.pd_master_port}"
    # one line per periodic re-registration would drown the node's log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    body = {
        "role": args.run_mode,
        "node_id": f"{args.run_mode}@{inbox_addr.removeprefix('tcp://')}",
        "inbox": inbox_addr,
        "outbox": outbox_addr,
        "capacity": args.max_running_requests + args.max_queue_len,
        "header": msgspec.to_builtins(header),
        "pid": os.getpid(),
    }
    stop = threading.Event()
    try:
        register(master_url, body, REGISTER_WAIT_S)
        logger.info("registered with the pd_master at %s as %s", master_url, body["node_id"])
        threading.Thread(target=_keep_registered, args=(master_url, body, stop), daemon=True).start()
        quiet_garbage_collector()
        _loop(engine, role, inbox, outbox)
    finally:
        stop.set()
        transport.close()
        inbox.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
    return 0


def _keep_registered(master_url: str, body: dict, stop: threading.Event) -> None:
    while not stop.wait(REREGISTER_INTERVAL_S):
        try:
            register(master_url, body, 0.0)
        except RegistrationRefused as exc:
            logger.warning("re-registration failed: %s", exc)


def _loop(engine, role: PrefillRole | DecodeRole, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
    decoder = msgspec.msgpack.Decoder(NodeInput)
    encoder = msgspec.msgpack.Encoder()
    last_stats = 0.0
    while True:
        outputs: list[EngineOutput] = []
        timeout = 0 if role.has_work() else IDLE_POLL_MS
        while inbox.poll(timeout):
            timeout = 0
            try:
                msg = decoder.decode(inbox.recv())
            except msgspec.DecodeError as exc:
                logger.error("dropping an undecodable message: %s", exc)
                continue
            outputs += role.on_message(msg)
        outputs += role.tick()
        try:
            if engine.has_work():
                outputs += role.after_step(engine.step())
        except Exception:
            logger.exception("unexpected engine fault")
            outputs += role.after_step(engine.fail_all("internal engine fault (see the node's log)"))
        now = time.monotonic()
        if now - last_stats > STATS_INTERVAL_S or any(isinstance(o, Finished) for o in outputs):
            outputs.append(engine.snapshot())
            last_stats = now
        if outputs:
            try:
                outbox.send(encoder.encode(outputs), flags=zmq.NOBLOCK)
            except zmq.Again:
                # the master is gone or not reading: its own timeouts fail these requests
                logger.error("the pd_master does not read this node's outputs; %d dropped", len(outputs))
