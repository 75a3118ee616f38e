"""Entry point: `python -m lightllm.server.api_server --model_dir DIR [flags]`.

Parse → resolve (refusing bad flag combinations with what to change) → start the engine process → serve HTTP.
uvicorn handles SIGINT/SIGTERM with a graceful shutdown, after which the engine process is stopped; the engine
also dies on its own if this process is killed. If the engine process dies, the server stops and exits with
ENGINE_EXITED (non-zero, so a supervisor restarts it) unless --keep_serving_after_engine_exit.
"""

from __future__ import annotations

import logging
import signal
import sys

from lightllm.server.args import ServerArgs, load_server_args
from lightllm.server.dp.replicas import start_engines
from lightllm.server.launcher import EngineStartError
from lightllm.server.model_info import ModelInfo
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

logger = logging.getLogger("lightllm.server")
# exit code when the server stopped because its engine process died
ENGINE_EXITED = 3


def serve(args: ServerArgs, info: ModelInfo, runner_factory: str = DEFAULT_RUNNER_FACTORY) -> int:
    """Serve until shut down; returns the process exit code."""
    import uvicorn

    from lightllm.server.collector import freeze_startup_objects
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server import uvicorn_config
    from lightllm.server.tokenizer import Tokenizer

    tokenizer = Tokenizer(info)
    engine = start_engines(args, info, runner_factory)
    logger.info("engine ready: %s", engine.capacity_report)
    engine_died = False
    server = None

    def on_engine_exit() -> None:
        nonlocal engine_died
        engine_died = True
        logger.error("the engine process is gone: stopping the server, which exits with code %d", ENGINE_EXITED)
        server.should_exit = True

    try:
        app = create_app(args, info, tokenizer, engine, on_engine_exit)
        server = uvicorn.Server(uvicorn_config(app, args))
        freeze_startup_objects()
        server.run()
    finally:
        engine.stop()
    return ENGINE_EXITED if engine_died else 0


def _exit_on_sigterm(signum, frame) -> None:
    # uvicorn re-raises the signal it caught once it has shut down; turning it into SystemExit lets the engine be
    # stopped in serve()'s finally block and the process exit 0
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args, info = load_server_args(argv)
    except ValueError as exc:
        print(f"lightllm: refusing to start: {exc}", file=sys.stderr)
        return 2
    logger.info("serving %s (%s) with %s", args.served_model_name, info.architecture, args)
    try:
        if args.run_mode == "pd_master":
            from lightllm.server.pd.master import serve_master

            return serve_master(args, info)
        if args.run_mode in ("prefill", "decode"):
            from lightllm.server.pd.node import RegistrationRefused, serve_node
            from lightllm.server.pd.node_replicas import serve_node_replicas

            try:
                return serve_node(args, info) if args.dp == 1 else serve_node_replicas(args, info)
            except RegistrationRefused as exc:
                print(f"lightllm: refusing to start: {exc}", file=sys.stderr)
                return 2
        return serve(args, info)
    except EngineStartError as exc:
        print(f"lightllm: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
