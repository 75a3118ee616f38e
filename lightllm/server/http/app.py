"""The FastAPI application: OpenAI routes, /health, /metrics, /v1/models, the tokenizer utilities, and error mapping
to 4xx/5xx."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightllm.server.args import ServerArgs
from lightllm.server.http.background_responses import BackgroundResponses
from lightllm.server.http.chat_api import router as chat_router
from lightllm.server.http.conversations_api import router as conversations_router
from lightllm.server.http.edge import EdgeMiddleware
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.http.metric_rows import MetricRows
from lightllm.server.http.metrics import Metrics
from lightllm.server.http.openai_api import error_response
from lightllm.server.http.openai_api import router as openai_router
from lightllm.server.http.response_store import ResponseStore
from lightllm.server.http.responses_api import router as responses_router
from lightllm.server.http.serving import RETRY_AFTER_S, ApiError, ClientDisconnected, Frontend
from lightllm.server.http.stats_log import log_stats
from lightllm.server.http.stored_responses_api import router as stored_responses_router
from lightllm.server.http.tokenize_api import router as tokenize_router
from lightllm.server.http.watchdog import ProgressWatchdog
from lightllm.server.launcher import EngineHandle
from lightllm.server.model_info import ModelInfo
from lightllm.server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
ENGINE_CHECK_INTERVAL_S = 0.5
# threads that tokenize and render chat templates off the event loop
TEXT_WORKERS = 4


def _is_field(part) -> bool:
    """Union members show up in an error's location as tags like `list[int]` or `function-after[...]`: not fields."""
    text = str(part)
    return part != "body" and "[" not in text and text not in ("str", "int", "float", "bool", "dict", "list")


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if _is_field(p)]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", None)
    if not loc:
        return ApiError(400, f"the body must be a JSON object: {first.get('msg')}", None)
    message = first.get("msg", "invalid value")
    return ApiError(400, f"{field}: {message}" if field else message, field)


def _unparsable_body(cause: BaseException | None) -> str:
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not valid UTF-8"
    return "the body is not valid JSON"


async def _watch(watchdog: ProgressWatchdog) -> None:
    """Check progress between /health probes too, so a stall is logged and counted when it happens."""
    while True:
        await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
        watchdog.problem()


async def _watch_engine(engine: EngineHandle, client: EngineClient, on_exit: Callable[[], None] | None) -> None:
    """When the engine process dies: say so in the log at once, finish every waiting request with an error, and
    (unless told to stay up) stop the server so that a supervisor restarts it."""
    while engine.is_alive():
        await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
    logger.error(
        "the engine process exited (%s); failing %d sequences in flight",
        engine.exit_description(),
        client.num_in_flight,
    )
    client.fail_all("the engine process exited")
    if on_exit is not None:
        on_exit()
    while True:
        # a request that passed the liveness check just before the death must not wait forever either
        await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
        client.fail_all("the engine process exited")


def _openapi_with_400(app: FastAPI) -> Callable[[], dict]:
    """FastAPI documents 422 for body validation; this server answers 400 with an OpenAI error body."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error = {
                "type": "object",
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": "string", "nullable": True},
                            "code": {"type": "integer"},
                        },
                    }
                },
            }
            schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = error
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {
                            "description": "Invalid request (the message names the field)",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                        }
            for name in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_app(
    args: ServerArgs,
    info: ModelInfo,
    tokenizer: Tokenizer,
    engine: EngineHandle,
    on_engine_exit: Callable[[], None] | None = None,
    serving_problem: Callable[[], str | None] | None = None,
    metric_rows: MetricRows | None = None,
) -> FastAPI:
    """An app bound to a running engine process; the zmq client lives on the app's event loop.

    `on_engine_exit` is called once if the engine process dies (the CLI stops the server with it), unless
    --keep_serving_after_engine_exit. `serving_problem` says why the engine, though alive, cannot serve now
    (None: it can); /health answers 503 with it. `metric_rows`: this process's row of the counters every HTTP
    process of the server shares (`--http_workers`; a private row by default)."""
    started = int(time.time())
    if args.keep_serving_after_engine_exit:
        on_engine_exit = None
    if serving_problem is None:
        serving_problem = engine.serving_problem

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = engine.connect(args)
        metrics = Metrics(lambda: client.stats, metric_rows)
        engine.register_metrics(metrics.registry)
        client.observers.append(metrics.on_output)
        client.start()
        pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="lightllm-text")
        app.state.frontend = Frontend(args, info, tokenizer, client, metrics, engine.accepts_requests, pool)
        app.state.metrics = metrics
        watchdog = ProgressWatchdog(args.progress_timeout_s, metrics.in_flight, lambda: client.stats, metrics.registry)
        client.observers.append(watchdog.observe)
        app.state.watchdog = watchdog
        app.state.responses = ResponseStore(args.responses_store_dir, int(args.responses_store_mb * 2**20))
        app.state.background = BackgroundResponses(app.state.responses)
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(_watch_engine(engine, client, on_engine_exit)), loop.create_task(_watch(watchdog))]
        if args.log_stats_interval > 0:
            tasks.append(loop.create_task(log_stats(client, metrics, args.log_stats_interval)))
        # every streamed response runs in an anyio task group, and anyio imports its asyncio backend at the first
        # one: import it now, not on the event loop of the first stream
        async with anyio.create_task_group():
            pass
        yield
        for task in tasks:
            task.cancel()
        await app.state.background.close()
        pool.shutdown(wait=False, cancel_futures=True)
        app.state.responses.close()
        await client.close()

    docs = args.enable_docs
    app = FastAPI(
        title="lightllm",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.openapi = _openapi_with_400(app)
    app.include_router(chat_router)
    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(stored_responses_router)
    app.include_router(conversations_router)
    app.include_router(tokenize_router)
    engine.add_routes(app)
    app.add_middleware(
        EdgeMiddleware,
        max_body_bytes=args.max_request_body_bytes,
        api_key=args.api_key,
        max_json_items=args.max_request_json_items,
        body_timeout_s=args.http_body_timeout_s,
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status == 503 and not exc.headers:
            # nothing could take the request now (e.g. no healthy PD node): the client may try again
            exc.headers = {"Retry-After": str(RETRY_AFTER_S)}
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
        # FastAPI raises this for bodies it cannot parse at all, with the parser's exception as the cause; a 405
        # carries its Allow header
        message = _unparsable_body(exc.__cause__) if exc.status_code == 400 else str(exc.detail)
        return error_response(ApiError(exc.status_code, message, headers=exc.headers))

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return JSONResponse({"status": "engine process is not running"}, status_code=503)
        problem = serving_problem() if serving_problem is not None else None
        problem = problem or app.state.watchdog.problem()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return engine.health()

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    card = {
        "id": args.served_model_name,
        "object": "model",
        "created": started,
        "owned_by": "lightllm",
        "max_model_len": args.max_req_total_len,
    }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    # a served name may hold slashes (`Qwen/Qwen3.5-35B-A3B`)
    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != args.served_model_name:
            raise ApiError(404, f"model {model!r} is not served here; use {args.served_model_name!r}", "model")
        return card

    return app
