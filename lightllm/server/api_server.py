"""Entry point: `python -m lightllm.server.api_server --model_dir DIR [flags]`.

Parse → resolve (refusing bad flag combinations with what to change) → start the engine process → serve HTTP.
uvicorn handles SIGINT/SIGTERM with a graceful shutdown, after which the engine process is stopped; the engine
also dies on its own if this process is killed.
"""

from __future__ import annotations

import logging
import signal
import sys

from lightllm.server.args import ServerArgs, load_server_args
from lightllm.server.launcher import EngineStartError, start_engine
from lightllm.server.model_info import ModelInfo
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

logger = logging.getLogger("lightllm.server")


def serve(args: ServerArgs, info: ModelInfo, runner_factory: str = DEFAULT_RUNNER_FACTORY) -> None:
    import uvicorn

    from lightllm.server.http.app import create_app
    from lightllm.server.tokenizer import Tokenizer

    tokenizer = Tokenizer(info)
    engine = start_engine(args, info, runner_factory)
    logger.info("engine ready: %s", engine.capacity_report)
    try:
        app = create_app(args, info, tokenizer, engine)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.stop()


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
        serve(args, info)
    except EngineStartError as exc:
        print(f"lightllm: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
