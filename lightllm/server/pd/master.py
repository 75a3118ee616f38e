"""`--run_mode pd_master`: the OpenAI HTTP front-end over a `PdRouter` instead of a local engine process.

Beyond the usual routes (chat, completions, streaming, usage, /health, /metrics, /v1/models) it serves:
`POST /pd/register` (nodes; the body sealed with the PD secret (`auth.py`), else 401; 400 for a malformed body;
409 with the reason when a node's transfer header differs from the master's checkpoint or the registered nodes',
or its node id is held by another node), `GET /pd/ready` (200 while at least one prefill and one decode node can
take requests, else 503) and `GET /pd/nodes` (each node's role, address, load, last heartbeat and engine stats;
behind the API key when one is set).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Annotated, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lightllm.server.args import ServerArgs
from lightllm.server.model_info import ModelInfo
from lightllm.server.pd.auth import REGISTER_CHANNEL, SEAL_HEADER, PdAuth, Unauthenticated
from lightllm.server.pd.header import TransferHeader, model_reference
from lightllm.server.pd.router import PdRouter, Registration

logger = logging.getLogger(__name__)


def start_router(args: ServerArgs) -> tuple[PdRouter, str]:
    """A started router on fresh ipc addresses; returns it and the folder of its sockets (remove it after)."""
    socket_dir = tempfile.mkdtemp(prefix="lightllm-pd-")
    router = PdRouter(
        f"ipc://{os.path.join(socket_dir, 'in')}",
        f"ipc://{os.path.join(socket_dir, 'out')}",
        node_timeout_s=args.pd_node_timeout_s,
        queue_timeout_s=args.pd_queue_timeout_s,
        auth=PdAuth(args.pd_secret),
        reference=model_reference(args.model_dir),
        request_timeout_s=args.pd_request_timeout_s,
    )
    if not router.auth.authenticated:
        logger.warning("the PD control plane has no secret (--pd_secret): only loopback nodes are safe")
    router.start()
    return router, socket_dir


class RegistrationBody(msgspec.Struct, forbid_unknown_fields=True):
    """What a node posts to /pd/register (sealed: `auth.py`)."""

    role: Literal["prefill", "decode"]
    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    inbox: Annotated[str, msgspec.Meta(max_length=512)]
    outbox: Annotated[str, msgspec.Meta(max_length=512)]
    # requests the node takes at once (running + queued): the master's routing bound
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    header: TransferHeader
    # a random token the node chose at start: only it can register this node id again
    credential: Annotated[str, msgspec.Meta(min_length=16, max_length=256)]
    reads: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=16)] = []
    pid: Annotated[int, msgspec.Meta(ge=0, le=1 << 32)] = 0


def add_pd_routes(app: FastAPI, router: PdRouter) -> None:
    async def register(request: Request):
        raw = await request.body()
        try:
            seal = bytes.fromhex(request.headers.get(SEAL_HEADER, ""))
            router.auth.open(REGISTER_CHANNEL, seal + raw)
        except (ValueError, Unauthenticated) as exc:
            logger.warning("refused an unauthenticated registration from %s: %s", request.client, exc)
            return JSONResponse({"error": f"unauthenticated registration: {exc}"}, status_code=401)
        try:
            body = msgspec.json.decode(raw, type=RegistrationBody)
        except msgspec.DecodeError as exc:
            logger.warning("refused a malformed registration from %s: %s", request.client, exc)
            return JSONResponse({"error": f"malformed registration: {exc}"}, status_code=400)
        reg = Registration(body.role, body.node_id, body.inbox, body.outbox, body.capacity, body.reads, body.pid)
        error = router.register(reg, body.header, body.credential)
        if error is not None:
            logger.error("refused %s node %s: %s", reg.role, reg.node_id, error)
            return JSONResponse({"error": error}, status_code=409)
        return {"ok": True}

    async def ready():
        counts = router.counts()
        ok = counts["prefill"] > 0 and counts["decode"] > 0
        return JSONResponse({"ready": ok, **counts}, status_code=200 if ok else 503)

    async def nodes():
        return {"nodes": router.nodes()}

    app.add_api_route("/pd/register", register, methods=["POST"])
    app.add_api_route("/pd/ready", ready, methods=["GET"])
    app.add_api_route("/pd/nodes", nodes, methods=["GET"])


def serve_master(args: ServerArgs, info: ModelInfo) -> int:
    """Serve the master until shut down; returns the exit code (3 when the router thread died)."""

    from lightllm.server.collector import freeze_startup_objects
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server import http_server
    from lightllm.server.tokenizer import Tokenizer

    router, socket_dir = start_router(args)
    server = None
    router_died = False

    def on_router_exit() -> None:
        nonlocal router_died
        router_died = True
        server.should_exit = True

    try:
        app = create_app(args, info, Tokenizer(info), router, on_router_exit, router.serving_problem)
        add_pd_routes(app, router)
        server = http_server(app, args)
        freeze_startup_objects()
        server.run()
    finally:
        router.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return 3 if router_died else 0
