"""The FastAPI application: OpenAI routes, /health, /metrics, /v1/models, and error mapping to 4xx/5xx."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightllm.server.args import ServerArgs
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.http.metrics import Metrics
from lightllm.server.http.openai_api import error_response, router
from lightllm.server.http.serving import ApiError, ClientDisconnected, Frontend
from lightllm.server.launcher import EngineHandle
from lightllm.server.model_info import ModelInfo
from lightllm.server.tokenizer import Tokenizer

ENGINE_CHECK_INTERVAL_S = 1.0


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", None)
    if not loc:
        return ApiError(400, f"the body must be a JSON object: {first.get('msg')}", None)
    message = first.get("msg", "invalid value")
    return ApiError(400, f"{field}: {message}" if field else message, field)


async def _watch_engine(engine: EngineHandle, client: EngineClient) -> None:
    """If the engine process dies, finish every waiting request with an error instead of hanging it."""
    while True:
        if not engine.is_alive():
            client.fail_all("the engine process exited")
        await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)


def create_app(args: ServerArgs, info: ModelInfo, tokenizer: Tokenizer, engine: EngineHandle) -> FastAPI:
    """An app bound to a running engine process; the zmq client lives on the app's event loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(engine.input_addr, engine.output_addr)
        metrics = Metrics(lambda: client.stats)
        client.observers.append(metrics.on_output)
        client.start()
        app.state.frontend = Frontend(args, info, tokenizer, client, metrics, engine.is_alive)
        app.state.metrics = metrics
        watchdog = asyncio.get_running_loop().create_task(_watch_engine(engine, client))
        yield
        watchdog.cancel()
        await client.close()

    app = FastAPI(title="lightllm", lifespan=lifespan)
    app.include_router(router)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        # nginx's "client closed request": nobody reads it, but the access log shows what happened
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI raises this for bodies it cannot parse at all (e.g. invalid UTF-8)
        message = "the body is not valid UTF-8 JSON" if exc.status_code == 400 else str(exc.detail)
        return error_response(ApiError(exc.status_code, message))

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return JSONResponse({"status": "engine process is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": args.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "lightllm"}
        return {"object": "list", "data": [{**card, "max_model_len": args.max_req_total_len}]}

    return app
