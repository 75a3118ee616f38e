"""The engine process (rank 0): receives NewRequest/Abort over zmq, runs `Engine.step`, sends outputs back (the
loop of `engine_loop`, shared with the prefill/decode nodes).

It reports start-up success (with the capacity report) or failure over a pipe, ignores SIGINT (the parent
decides when to stop) and exits when the parent dies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from lightllm.engine.engine import Engine
from lightllm.engine.messages import EngineInput
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.server.args import ServerArgs
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_loop import ServingRole, run_engine_loop
from lightllm.server.grammar_vocab import build_grammar_vocabulary, load_grammar_vocabulary, warm_grammars
from lightllm.server.model_info import ModelInfo
from lightllm.server.runner_factory import load_factory
from lightllm.server.termination import die_with_parent, exit_on_sigterm

IDLE_POLL_MS = 50


def _no_process_shared_locks() -> None:
    """tqdm's default lock is a multiprocessing semaphore registered with the parent's resource tracker; an engine
    that is killed never unregisters it and the parent warns of a leaked semaphore at exit. One process needs only
    a thread lock."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def build_engine(
    args: ServerArgs, info: ModelInfo, runner_factory: str, acceptance: SimulatedAcceptance | None = None
) -> Engine:
    """The engine `args` describe. `acceptance` (offline benchmarks only, never from a server flag) replaces the
    model's verification of drafts. The checkpoint's grammar vocabulary is built here, before any request, beside
    the runner's start-up.

    The GIL's switch interval is short from the start (`GIL_SWITCH_S`): the start-up's background threads (the
    grammar vocabulary, fla's import) run Python for seconds, and at Python's default each of the main thread's
    waits for the GIL while it loads weights and allocates caches lasts up to 5 ms."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="grammar-vocabulary") as building:
            vocabulary = building.submit(build_grammar_vocabulary, info)
            runner = load_factory(runner_factory)(args, info)
            try:
                engine = engine_for_runner(args, runner, acceptance)
                warm_grammars(engine, info, args.device, vocabulary)
            except BaseException:
                # a tensor-parallel runner's followers and process group outlive a failed start otherwise
                close = getattr(runner, "close", None)
                if close is not None:
                    close()
                raise
    except BaseException:
        sys.setswitchinterval(switch_interval)
        raise
    quiet_host_threads(args.device)
    return engine


# how long a thread waiting for the GIL waits before it asks the holder to drop it (Python's default is 5 ms)
GIL_SWITCH_S = 0.0001


def quiet_host_threads(device: str) -> None:
    """One torch intra-op thread once a GPU engine is built (its weights load with all of them). The step loop's
    CPU tensor work is small host buffers that the intra-op pool does not speed up, and the pool's idle threads
    spin after each such op on cores that llguidance's mask pool and the HTTP side need: on a 16-core host, 64 grammar
    masks took as long on 12 pool threads as on one beside them.

    The GIL's switch interval stays short (`build_engine` set it), on every device: an overlapped step's grammar
    masks are filled on a background thread while the step's thread runs Python (emitting tokens, launching the next
    forward), and the masked draw waits for them. With Python's default, that thread waits 5 ms for the GIL to start
    the job and again when llguidance returns, each a step's length; at 0.1 ms the two cost a few tenths of a
    millisecond."""
    if device == "cuda":
        import torch

        torch.set_num_threads(1)


def engine_for_runner(args: ServerArgs, runner, acceptance: SimulatedAcceptance | None = None) -> Engine:
    return Engine(
        runner,
        # the runner holds fewer request slots where their linear state does not fit the device
        max_running_requests=min(args.max_running_requests, runner.num_free_requests()),
        chunked_prefill_size=args.chunked_prefill_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_mixed_prefill_tokens=args.max_mixed_prefill_tokens,
        # a capped step's prompt chunks fit the largest prefill graph, so the step replays graphs (CUDA only)
        mixed_prefill_chunk=args.prefill_graph_max_tokens
        if args.device == "cuda" and not args.disable_cudagraph
        else None,
        max_req_total_len=args.max_req_total_len,
        mtp_step=args.mtp_step,
        spec_ngram=args.spec_ngram,
        state_mode=args.ssm_state_mode,
        prefix_cache_checkpoint_interval=0 if args.disable_prefix_cache else args.prefix_cache_checkpoint_interval,
        overlap_schedule=not args.disable_overlap_schedule,
        # a hit whose suffix is one short prefill (a graph on CUDA) feeds its last prompt token in it
        short_resume_tokens=args.prefill_graph_max_tokens,
        acceptance=acceptance,
        grammar_vocabulary=load_grammar_vocabulary,
    )


def engine_main(
    args: ServerArgs, info: ModelInfo, input_addr: str, output_addrs: list[str], runner_factory: str, conn
) -> None:
    """Entry point of the spawned engine process: requests in at `input_addr` from every HTTP front-end process,
    front-end i's outputs out at `output_addrs[i]`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the parent stops us with SIGTERM
    exit_on_sigterm()
    _no_process_shared_locks()
    die_with_parent()
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
    outboxes = []
    for addr in output_addrs:
        outboxes.append(ctx.socket(zmq.PUSH))
        outboxes[-1].bind(addr)
    conn.send({"ok": True, "report": report})
    conn.close()
    role = ServingRole(engine, len(outboxes))
    encoder = msgspec.msgpack.Encoder()

    def send(outputs) -> None:
        for outbox, part in zip(outboxes, role.routes.split(outputs)):
            if part:
                outbox.send(encoder.encode(part))

    run_engine_loop(
        role,
        inbox,
        msgspec.msgpack.Decoder(EngineInput),
        idle_poll_ms=IDLE_POLL_MS,
        keep_running=lambda: os.getppid() == parent,
        send=send,
        log_name="engine log",
    )
