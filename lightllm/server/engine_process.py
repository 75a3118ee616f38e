"""The engine process (rank 0): receives NewRequest/Abort over zmq, runs `Engine.step`, sends outputs back.

It reports start-up success (with the capacity report) or failure over a pipe, ignores SIGINT (the parent
decides when to stop) and exits when the parent dies.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from lightllm.engine.engine import Engine
from lightllm.engine.messages import Abort, EngineInput, EngineOutput, Finished, NewRequest
from lightllm.server.args import ServerArgs
from lightllm.server.model_info import ModelInfo
from lightllm.server.runner_factory import load_factory

logger = logging.getLogger(__name__)
# how often stats go out while idle or busy, seconds
STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 50


def _die_with_parent() -> None:
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        # not Linux: the parent-pid check in the loop still ends the process
        pass


def _no_process_shared_locks() -> None:
    """tqdm's default lock is a multiprocessing semaphore registered with the parent's resource tracker; an engine
    that is killed never unregisters it and the parent warns of a leaked semaphore at exit. One process needs only
    a thread lock."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def build_engine(args: ServerArgs, info: ModelInfo, runner_factory: str) -> Engine:
    return engine_for_runner(args, load_factory(runner_factory)(args, info))


def engine_for_runner(args: ServerArgs, runner) -> Engine:
    return Engine(
        runner,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_req_total_len=args.max_req_total_len,
        mtp_step=args.mtp_step,
        spec_ngram=args.spec_ngram,
        state_mode=args.ssm_state_mode,
        prefix_cache_checkpoint_interval=0 if args.disable_prefix_cache else args.prefix_cache_checkpoint_interval,
        overlap_schedule=not args.disable_overlap_schedule,
    )


def quiet_garbage_collector() -> None:
    """Keep Python's cyclic collector off the step loop: the objects made at start-up (modules, weights, pools)
    live for the whole process, and rescanning them in every full collection cost milliseconds per step at a
    few hundred requests. They move to the permanent generation, and young collections run less often. For a
    process that serves one engine (the engine process, the offline API, benchmarks), after it is built."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def engine_main(
    args: ServerArgs, info: ModelInfo, input_addr: str, output_addr: str, runner_factory: str, conn
) -> None:
    """Entry point of the spawned engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the parent stops us with SIGTERM: exit through Python so multiprocessing's finalizers release what they hold
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    _no_process_shared_locks()
    _die_with_parent()
    parent = os.getppid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        engine = build_engine(args, info, runner_factory)
        report = engine.capacity_report()
        quiet_garbage_collector()
    except Exception as exc:
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.bind(output_addr)
    conn.send({"ok": True, "report": report})
    conn.close()
    decoder = msgspec.msgpack.Decoder(EngineInput)
    encoder = msgspec.msgpack.Encoder()
    last_stats = 0.0
    while os.getppid() == parent:
        outputs: list[EngineOutput] = []
        timeout = 0 if engine.has_work() else IDLE_POLL_MS
        while inbox.poll(timeout):
            timeout = 0
            outputs += _handle(engine, decoder, inbox.recv())
        try:
            if engine.has_work():
                outputs += engine.step()
        except Exception:
            # runner failures are handled inside step(); reaching here means an engine bug: fail the requests in
            # flight rather than the process, so the server keeps answering
            logger.exception("unexpected engine fault")
            outputs += engine.fail_all("internal engine fault (see the engine log)")
        now = time.monotonic()
        # stats go out periodically and right after any request finishes, so /metrics sees freed slots promptly
        if now - last_stats > STATS_INTERVAL_S or any(isinstance(o, Finished) for o in outputs):
            outputs.append(engine.snapshot())
            last_stats = now
        if outputs:
            outbox.send(encoder.encode(outputs))


def _handle(engine: Engine, decoder: msgspec.msgpack.Decoder, raw: bytes) -> list[EngineOutput]:
    try:
        msg = decoder.decode(raw)
    except msgspec.DecodeError as exc:
        return _refuse_undecodable(raw, exc)
    if isinstance(msg, NewRequest):
        return engine.add_request(msg)
    if isinstance(msg, Abort):
        return engine.abort(msg.req_id)
    return []


def _refuse_undecodable(raw: bytes, exc: Exception) -> list[EngineOutput]:
    """A request the typed decoder refuses still has a waiting front-end: answer it with an error if its id can
    be read, so it does not wait forever."""
    try:
        loose = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        loose = None
    req_id = loose.get("req_id") if isinstance(loose, dict) else None
    if not isinstance(req_id, str) or loose.get("type") != "NewRequest":
        logger.error("dropping an undecodable message: %s", exc)
        return []
    return [Finished(req_id, "error", error=f"the engine could not read this request: {exc}")]
