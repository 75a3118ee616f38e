"""A prefill or decode node: one engine (in this process) behind two zmq sockets, registered with the pd_master.

The node binds its inbox (PULL: the master's `PdPrefill`/`Abort`, other nodes' `PdTransfer`/`TransferAck`) and
outbox (PUSH: `TokenChunk`/`Finished`/`EngineStats` to the master) on `--host` at free ports, then registers
them with the master over HTTP (`POST /pd/register` at `--pd_master_ip:--pd_master_port`) with its transfer
header and a random credential of this process, sealed with the PD secret; every frame it sends is sealed and
every frame its inbox takes must be (`auth.py`: others are dropped and logged). A refused header ends the process with exit code 2 and the master's reason. Registration is repeated in
the background, so a restarted master learns of the node again. The engine runs the engine process's loop
(`engine_loop`) with the node's role; its stats go out every half second: the master's heartbeat.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

import httpx
import msgspec
import torch
import zmq

from lightllm.server.args import ServerArgs
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_loop import run_engine_loop
from lightllm.server.engine_process import build_engine
from lightllm.server.model_info import ModelInfo
from lightllm.server.pd.auth import REGISTER_CHANNEL, SEAL_HEADER, PdAuth, SealedDecoder
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads, cuda_ipc_kind, share_cuda_buffer
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import NodeInput
from lightllm.server.pd.nixl import NIXL_KIND, NixlEndpoint, NixlHandle
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.server.pd.staging import RegionReader, StagingBuffer, host_identity, uses_cuda_ipc
from lightllm.server.pd.transport import ZmqHostTransport
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY, rank_device, use_device

logger = logging.getLogger(__name__)
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


def register(master_url: str, body: dict, wait_s: float, auth: PdAuth) -> None:
    """POST the registration until the master answers (at most `wait_s`); RegistrationRefused on a refusal."""
    deadline = time.monotonic() + wait_s
    raw = msgspec.json.encode(body)
    while True:
        # a fresh seal per attempt: the master refuses a replayed one
        sealed = auth.seal(REGISTER_CHANNEL, raw)
        headers = {SEAL_HEADER: sealed[: len(sealed) - len(raw)].hex(), "content-type": "application/json"}
        try:
            reply = httpx.post(f"{master_url}/pd/register", content=raw, headers=headers, timeout=10.0)
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
    # a data-parallel replica's node runs on its own device: make it current before anything takes memory there
    use_device(args)
    # a prefill node's staging buffer exists before the engine sizes its KV cache from the memory left, so the
    # cache does not take the bytes the buffer needs
    staging = staging_buffer(args, torch.device(rank_device(args))) if args.run_mode == "prefill" else None
    engine = build_engine(args, info, runner_factory)
    logger.info("%s node engine ready: %s", args.run_mode, engine.capacity_report())
    header = runner_header(engine.runner, info.model_dir)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 0)
    host = advertised_host(args.host)
    inbox_addr = f"tcp://{host}:{inbox.bind_to_random_port(f'tcp://{args.host}')}"
    outbox_addr = f"tcp://{host}:{outbox.bind_to_random_port(f'tcp://{args.host}')}"
    auth = PdAuth(args.pd_secret)
    transport = ZmqHostTransport(ctx, auth)
    fingerprint = header.fingerprint()
    reader = None
    if args.run_mode == "prefill":
        role = PrefillRole(engine, transport, fingerprint, inbox_addr, args.pd_transfer_timeout_s, staging)
    else:
        reader = region_reader(args, engine.runner.device)
        role = DecodeRole(engine, transport, fingerprint, reader, device_budget_bytes=args.pd_ipc_buffer_mb << 20)
    master_url = f"http://{args.pd_master_ip}:{args.pd_master_port}"
    # one line per periodic re-registration would drown the node's log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    body = {
        "role": args.run_mode,
        "node_id": f"{args.run_mode}@{inbox_addr.removeprefix('tcp://')}",
        "inbox": inbox_addr,
        "outbox": outbox_addr,
        "capacity": args.max_running_requests + args.max_queue_len,
        # a decode node says which staging regions it reads; prefill nodes with such a buffer send through it
        "reads": reader.kinds if reader is not None else [],
        "header": msgspec.to_builtins(header),
        "credential": secrets.token_hex(16),
        "pid": os.getpid(),
    }
    stop = threading.Event()
    try:
        register(master_url, body, REGISTER_WAIT_S, auth)
        logger.info("registered with the pd_master at %s as %s", master_url, body["node_id"])
        threading.Thread(target=_keep_registered, args=(master_url, body, stop, auth), daemon=True).start()
        quiet_garbage_collector()
        encoder = msgspec.msgpack.Encoder()
        run_engine_loop(
            role,
            inbox,
            SealedDecoder(auth, inbox_addr, msgspec.msgpack.Decoder(NodeInput)),
            idle_poll_ms=IDLE_POLL_MS,
            keep_running=lambda: True,
            send=lambda outputs: _send_to_master(outbox, auth.seal(outbox_addr, encoder.encode(outputs))),
            log_name="node's log",
        )
    finally:
        stop.set()
        transport.close()
        inbox.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
    return 0


def staging_buffer(args: ServerArgs, device: torch.device) -> StagingBuffer | None:
    """A prefill node's staging buffer: registered with NIXL, shared by CUDA IPC, or none (host-staged)."""
    if args.pd_ipc_buffer_mb == 0 or not (args.pd_transport == "nixl" or uses_cuda_ipc(args.pd_transport, args.device)):
        return None
    buffer = torch.empty(args.pd_ipc_buffer_mb << 20, dtype=torch.uint8, device=device)
    if args.pd_transport == "nixl":
        endpoint = NixlEndpoint("prefill")
        return StagingBuffer(buffer, endpoint.share(buffer), NIXL_KIND, sharer=endpoint)
    return StagingBuffer(buffer, share_cuda_buffer(buffer), cuda_ipc_kind(host_identity()))


def region_reader(args: ServerArgs, device: torch.device) -> RegionReader | None:
    """What a decode node reads: NIXL regions, CUDA IPC regions of its host, or none (host-staged only)."""
    if args.pd_transport == "nixl":
        return RegionReader(device, {NixlHandle: NixlEndpoint("decode").read}, [NIXL_KIND])
    if uses_cuda_ipc(args.pd_transport, args.device):
        return RegionReader(device, {CudaIpcHandle: CudaIpcReads()}, [cuda_ipc_kind(host_identity())])
    return None


def _send_to_master(outbox: zmq.Socket, raw: bytes) -> None:
    try:
        outbox.send(raw, flags=zmq.NOBLOCK)
    except zmq.Again:
        # the master is gone or not reading: its own timeouts fail these requests
        logger.error("the pd_master does not read this node's outputs; a batch of outputs dropped")


def _keep_registered(master_url: str, body: dict, stop: threading.Event, auth: PdAuth) -> None:
    while not stop.wait(REREGISTER_INTERVAL_S):
        try:
            register(master_url, body, 0.0, auth)
        except RegistrationRefused as exc:
            logger.warning("re-registration failed: %s", exc)
