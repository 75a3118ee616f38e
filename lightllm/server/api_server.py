"""Entry point: `python -m lightllm.server.api_server --model_dir DIR [flags]`.

Start the engine process (it imports its modules meanwhile: `prestart`) → parse → resolve (refusing bad flag
combinations with what to change) → hand the engine process its flags → serve HTTP.
uvicorn handles SIGINT/SIGTERM with a graceful shutdown, after which the engine process is stopped; the engine
also dies on its own if this process is killed. If the engine process dies, the server stops and exits with
ENGINE_EXITED (non-zero, so a supervisor restarts it) unless --keep_serving_after_engine_exit.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from lightllm.server.prestart import PrestartedEngine, PrestartedHttpProcesses
from lightllm.server.termination import exit_on_sigterm

if TYPE_CHECKING:
    from lightllm.server.args import ServerArgs
    from lightllm.server.model_info import ModelInfo

logger = logging.getLogger("lightllm.server")
# exit codes when the server stopped because its engine process, or one of its HTTP processes, died
ENGINE_EXITED = 3
HTTP_WORKER_EXITED = 4


def serve(
    args: ServerArgs,
    info: ModelInfo,
    runner_factory: str | None = None,
    prestarted: PrestartedEngine | None = None,
    prestarted_http: PrestartedHttpProcesses | None = None,
) -> int:
    """Serve until shut down; returns the process exit code. `runner_factory`: the real runner's when None;
    `prestarted` becomes the (first) engine process, `prestarted_http` the other HTTP processes (those not needed
    are stopped)."""
    from lightllm.server.collector import freeze_startup_objects
    from lightllm.server.dp.replicas import start_engines
    from lightllm.server.http.app import create_app
    from lightllm.server.http.metric_rows import MetricRows
    from lightllm.server.http.metrics import Metrics
    from lightllm.server.http.server import http_server
    from lightllm.server.http.workers import Workers, listen_socket
    from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
    from lightllm.server.tokenizer import Tokenizer

    exit_code = 0
    server, engine = None, None
    workers, rows_path, rows, sockets, responses_dir = None, None, None, None, None

    def stop_serving(code: int, why: str) -> None:
        nonlocal exit_code
        exit_code = code
        logger.error("%s: stopping the server, which exits with code %d", why, code)
        server.should_exit = True

    def on_worker_exit(process) -> None:
        if server.should_exit:
            # the server is stopping anyway (a signal to every process of the group, as Ctrl-C or systemd send)
            return
        if process.exitcode == 0:
            # stopped on request: the server stops with it, cleanly
            logger.info("%s stopped: stopping the server", process.name)
            server.should_exit = True
        else:
            stop_serving(HTTP_WORKER_EXITED, f"{process.name} exited with code {process.exitcode}")

    try:
        if args.http_workers > 1:
            # bound before anything starts, so a port in use fails at once
            sockets = [listen_socket(args.host, args.port, first=True)]
            rows_path = MetricRows.create_file(Metrics.WIDTH, args.http_workers)
            rows = MetricRows(Metrics.WIDTH, args.http_workers, 0, rows_path)
            if args.responses_store_mb and args.responses_store_dir is None:
                # one folder of stored responses for every HTTP process: a continuation may reach any of them
                responses_dir = tempfile.mkdtemp(prefix="lightllm-responses-")
                args = dataclasses.replace(args, responses_store_dir=responses_dir)
            # the other HTTP processes import and load the tokenizer while the engine starts (seconds each)
            workers = Workers(args, info, rows_path, prestarted_http)
        if prestarted_http is not None:
            prestarted_http.discard()
        # the tokenizer loads (seconds on a fresh machine) while the engine process starts
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as loading:
            tokenizer_loaded = loading.submit(Tokenizer, info)
            engine = start_engines(args, info, runner_factory or DEFAULT_RUNNER_FACTORY, prestarted)
            tokenizer = tokenizer_loaded.result()
        logger.info("engine ready: %s", engine.capacity_report)
        app = create_app(
            args,
            info,
            tokenizer,
            engine,
            lambda: stop_serving(ENGINE_EXITED, "the engine process is gone"),
            metric_rows=rows,
        )
        server = http_server(app, args)
        if workers is not None:
            workers.connect(engine)
            workers.watch(on_worker_exit)
            pids = ", ".join(str(p.pid) for p in [mp.current_process(), *workers.processes])
            logger.info("%d HTTP processes share port %d (pids %s)", args.http_workers, args.port, pids)
        freeze_startup_objects()
        server.run(sockets=sockets)
    finally:
        if workers is not None:
            workers.stop()
        if engine is not None:
            engine.stop()
        if rows_path is not None:
            os.remove(rows_path)
        if responses_dir is not None:
            shutil.rmtree(responses_dir, ignore_errors=True)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    # the engine process (and on a GPU host the other HTTP processes) import their modules while this one imports
    # its own and resolves the flags
    prestarted = PrestartedEngine()
    prestarted_http = PrestartedHttpProcesses.for_host()
    try:
        return _main(argv, prestarted, prestarted_http)
    finally:
        prestarted_http.discard()
        prestarted.discard()


def _main(argv: list[str] | None, prestarted: PrestartedEngine, prestarted_http: PrestartedHttpProcesses) -> int:
    from lightllm.server.args import load_server_args
    from lightllm.server.launcher import EngineStartError

    # uvicorn re-raises the signal it caught once it has shut down: as SystemExit, serve()'s finally block stops the
    # engine and the process exits 0
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args, info = load_server_args(argv)
    except ValueError as exc:
        print(f"lightllm: refusing to start: {exc}", file=sys.stderr)
        return 2
    logger.info("serving %s (%s) with %s", args.served_model_name, info.architecture, args)
    if info.sampling_defaults:
        taken = ", ".join(f"{k}={v}" for k, v in info.sampling_defaults)
        logger.info("sampling defaults from the generation config (a request's own values win): %s", taken)
    try:
        if args.run_mode == "pd_master":
            from lightllm.server.pd.master import serve_master

            prestarted.discard()
            prestarted_http.discard()
            return serve_master(args, info)
        if args.run_mode in ("prefill", "decode"):
            from lightllm.server.pd.node import RegistrationRefused, serve_node
            from lightllm.server.pd.node_replicas import serve_node_replicas

            prestarted.discard()
            prestarted_http.discard()
            try:
                return serve_node(args, info) if args.dp == 1 else serve_node_replicas(args, info)
            except RegistrationRefused as exc:
                print(f"lightllm: refusing to start: {exc}", file=sys.stderr)
                return 2
        return serve(args, info, prestarted=prestarted, prestarted_http=prestarted_http)
    except EngineStartError as exc:
        print(f"lightllm: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
