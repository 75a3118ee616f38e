"""`--run_mode pd_master`: the OpenAI HTTP front-end over a `PdRouter` instead of a local engine process.

Beyond the usual routes (chat, completions, streaming, usage, /health, /metrics, /v1/models) it serves:
`POST /pd/register` (nodes; 409 with the reason when a node's transfer header differs from the registered
nodes'), `GET /pd/ready` (200 once at least one prefill and one decode node are registered, else 503) and
`GET /pd/nodes` (each node's role, load, last heartbeat and engine stats).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lightllm.server.args import ServerArgs
from lightllm.server.model_info import ModelInfo
from lightllm.server.pd.header import TransferHeader
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
    )
    router.start()
    return router, socket_dir


def add_pd_routes(app: FastAPI, router: PdRouter) -> None:
    async def register(request: Request):
        try:
            body = await request.json()
            header = msgspec.convert(body["header"], TransferHeader)
            role = body["role"]
            if role not in ("prefill", "decode"):
                raise ValueError(f"role must be prefill or decode, got {role!r}")
            reg = Registration(
                role,
                str(body["node_id"]),
                str(body["inbox"]),
                str(body["outbox"]),
                int(body["capacity"]),
                [str(kind) for kind in body.get("reads", [])],
                int(body.get("pid", 0)),
            )
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
            return JSONResponse({"error": f"malformed registration: {exc}"}, status_code=400)
        error = router.register(reg, header)
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
    import uvicorn

    from lightllm.server.http.app import create_app
    from lightllm.server.tokenizer import Tokenizer

    router, socket_dir = start_router(args)
    server = None
    router_died = False

    def on_router_exit() -> None:
        nonlocal router_died
        router_died = True
        server.should_exit = True

    try:
        app = create_app(args, info, Tokenizer(info), router, on_router_exit)
        add_pd_routes(app, router)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=10)
        server = uvicorn.Server(config)
        server.run()
    finally:
        router.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return 3 if router_died else 0
