"""Prefill/decode disaggregation on one GPU: transfer bandwidth by transport, and serving latency against a
monolithic server. Rows print as they finish.

    python test/gpu/pd_bench.py                          # H200: real-width checkpoint, ~4 minutes
    python test/gpu/pd_bench.py --tiny --device cpu      # smoke run on the CPU (host transport only)

Part `transfer`: a prefill engine in this process and a decode engine in a child process, each with its role
(`PrefillRole` / `DecodeRole`) and the zmq transport, as in a node. Per prompt length a request is prefilled, handed
off and imported; the time runs from the end of the prefill step to the end of the import on the decode side
(export, staging or serialization, zmq, region copy or deserialization, import into the KV and state pools, all
synchronized), over the state's bytes (KV of every token, linear state, MTP head state). Transports: `host`
(staged in host memory, msgpack over TCP), `cuda_ipc` (device to device through the prefill node's staging
buffer) and, when a NIXL package is installed, `nixl` (NIXL reads of that buffer). Part `serving`: `lightllm.tools.bench_serving` (random 256-token prompts, 128 new tokens, greedy, all at
once at `--concurrency`) against a monolithic server, then against a pd_master with one prefill and one decode node
on the same GPU, per transport; TTFT and TPOT (mean, median, p99).

Checkpoint: `SERVING_BENCH_SIZES` (Qwen3.5 layout at hidden 2048, bf16, fp32 state, MTP head), built once.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import msgspec
import torch
import zmq

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.pd.auth import PdAuth, SealedDecoder
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads, cuda_ipc_kind, share_cuda_buffer
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import NodeInput, PdPrefill, PdTransfer, TransferAck
from lightllm.server.pd.nixl import NIXL_KIND, NixlEndpoint, NixlHandle, nixl_module_name
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.server.pd.staging import RegionReader, StagingBuffer, host_identity
from lightllm.server.pd.transport import ZmqHostTransport
from lightllm.tools.bench_throughput import serving_model_dir

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
# the control-plane secret both sides of the benchmark share
BENCH_SECRET = "pd-bench"


def _model_dir(tiny: bool) -> str:
    if tiny:
        from lightllm.tools.make_tiny_model import tiny_model_dir

        return str(tiny_model_dir("qwen3_5"))
    return serving_model_dir()


def _engine_args(a, mem_fraction: float) -> dict:
    # no decode graphs: the transfer part never decodes
    flags = dict(
        model_dir=_model_dir(a.tiny),
        device=a.device,
        mtp_step=a.mtp_step,
        max_running_requests=4,
        max_req_total_len=max(a.transfer_lens) + 64,
        disable_cudagraph=True,
    )
    if a.device == "cuda":
        flags["mem_fraction"] = mem_fraction
    else:
        flags["max_total_token_num"] = 2 * max(a.transfer_lens) + 256
    return flags


# transfer part ----------------------------------------------------------------------------------------------
def _reader(a, device: torch.device) -> RegionReader:
    """A decode side that reads every device path being measured."""
    reads, kinds = {}, []
    if "cuda_ipc" in a.transports:
        reads[CudaIpcHandle] = CudaIpcReads()
        kinds.append(cuda_ipc_kind(host_identity()))
    if "nixl" in a.transports:
        reads[NixlHandle] = NixlEndpoint("decode").read
        kinds.append(NIXL_KIND)
    return RegionReader(device, reads, kinds)


def _decode_child(a, inbox_addr: str, report_addr: str, conn) -> None:
    """The decode side: imports each transfer as it arrives, reports when the import is complete, then drops it."""
    args, info = load_server_args([], **_engine_args(a, 0.3))
    engine = build_engine(args, info, REAL_RUNNER)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(inbox_addr)
    report = ctx.socket(zmq.PUSH)
    report.connect(report_addr)
    fingerprint = runner_header(engine.runner, info.model_dir).fingerprint()
    reader = _reader(a, engine.runner.device)
    auth = PdAuth(BENCH_SECRET)
    role = DecodeRole(engine, ZmqHostTransport(ctx, auth), fingerprint, reader)
    conn.send(reader.kinds)
    # frames are sealed and opened as in a node: their MAC is part of the measured cost
    decoder = SealedDecoder(auth, inbox_addr, msgspec.msgpack.Decoder(NodeInput))
    while True:
        raw = inbox.recv()
        if raw == b"stop":
            break
        transfer = decoder.decode(raw)
        outputs = role.on_message(transfer) + role.admit()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        done = time.monotonic()
        ok = any(isinstance(o, TokenChunk) for o in outputs)
        report.send(msgspec.msgpack.encode([transfer.request.req_id, done, ok]))
        engine.abort(transfer.request.req_id)
    ctx.destroy(linger=0)


def _prefilled(engine, role: PrefillRole, vocab: int, n: int, req_id: str, decode_addr: str, reads: list) -> float:
    """Prefill a random prompt of `n` tokens up to its first token; hand it off; returns when the prefill step
    ended."""
    prompt = torch.randint(1, vocab, (n,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refused = role.on_message(PdPrefill(NewRequest(req_id, prompt, params), decode_addr, reads))
    if refused:
        raise RuntimeError(f"the prefill engine refused the request: {refused}")
    while True:
        outputs = engine.step()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.monotonic()
        done = any(isinstance(o, TokenChunk) and o.req_id == req_id for o in outputs)
        left = role.after_step(outputs)
        if any(isinstance(o, Finished) for o in left):
            raise RuntimeError(f"hand-off failed: {left}")
        if done:
            return t0


def _state_bytes(transfer: PdTransfer) -> int:
    s = transfer.state
    blobs = [*s.kv, s.conv, s.ssm, *s.mtp_kv, *([s.mtp_hidden] if s.mtp_hidden is not None else [])]
    return sum(b.nbytes for b in blobs)


def _recv_while_alive(sock: zmq.Socket, child, timeout_s: float = 120.0) -> bytes:
    """The next message on `sock`; raises when `child` exits first or nothing comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not sock.poll(1000):
        if not child.is_alive():
            raise RuntimeError(f"the decode process exited (code {child.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no report from the decode process within {timeout_s:g} s")
    return sock.recv()


def _staging(a, transport: str, device: torch.device) -> StagingBuffer | None:
    if transport == "host":
        return None
    buffer = torch.empty(a.ipc_buffer_mb << 20, dtype=torch.uint8, device=device)
    if transport == "nixl":
        endpoint = NixlEndpoint("prefill")
        return StagingBuffer(buffer, endpoint.share(buffer), NIXL_KIND, sharer=endpoint)
    return StagingBuffer(buffer, share_cuda_buffer(buffer), cuda_ipc_kind(host_identity()))


def transfer_part(a) -> None:
    """One prefill engine here and one decode engine in a child process serve every transport in turn (one
    prefill role per transport; the decode side reads every kind of region)."""
    args, info = load_server_args([], **_engine_args(a, 0.3))
    ctx = zmq.Context()
    sock_dir = f"/tmp/lightllm-pd-bench-{os.getpid()}"
    inbox_addr, decode_addr, report_addr = (f"ipc://{sock_dir}-{n}" for n in ("p", "d", "r"))
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(inbox_addr)
    report = ctx.socket(zmq.PULL)
    report.bind(report_addr)
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe()
    child = spawn.Process(target=_decode_child, args=(a, decode_addr, report_addr, child_conn), daemon=True)
    child.start()
    child_conn.close()  # a child that dies before it answers then ends the parent's wait (EOFError)
    engine = build_engine(args, info, REAL_RUNNER)
    fingerprint = runner_header(engine.runner, info.model_dir).fingerprint()
    sent: list[PdTransfer] = []

    class Recording(ZmqHostTransport):
        def send(self, addr, msg):
            if isinstance(msg, PdTransfer):
                sent.append(msg)
            super().send(addr, msg)

    auth = PdAuth(BENCH_SECRET)
    transport = Recording(ctx, auth)
    try:
        decode_reads = parent_conn.recv()
    except EOFError:
        raise RuntimeError(f"the decode process exited (code {child.exitcode}) before it was ready") from None
    ack_decoder = SealedDecoder(auth, inbox_addr, msgspec.msgpack.Decoder(NodeInput))
    try:
        for name in a.transports:
            staging = _staging(a, name, engine.runner.device)
            role = PrefillRole(engine, transport, fingerprint, inbox_addr, 60.0, staging)
            for n in a.transfer_lens:
                times = []
                for k in range(a.repeats + 1):
                    req_id = f"{name}-{n}-{k}"
                    t0 = _prefilled(engine, role, min(info.vocab_size, 30000), n, req_id, decode_addr, decode_reads)
                    got_id, done, ok = msgspec.msgpack.decode(_recv_while_alive(report, child))
                    assert got_id == req_id and ok, f"the decode side did not import {req_id}"
                    ack = ack_decoder.decode(_recv_while_alive(inbox, child))
                    assert isinstance(ack, TransferAck) and ack.error is None, ack
                    role.on_message(ack)
                    if k:  # the first of each length warms up allocations
                        times.append(done - t0)
                nbytes = _state_bytes(sent[-1])
                seconds = statistics.median(times)
                via = "staging region" if sent[-1].region is not None else "host bytes"
                print(
                    f"| {name} | {n} | {nbytes / 2**20:.1f} | {seconds * 1e3:.2f} | {nbytes / seconds / 1e9:.2f} "
                    f"| {via} |",
                    flush=True,
                )
            del role, staging
    finally:
        push = ctx.socket(zmq.PUSH)
        push.connect(decode_addr)
        push.send(b"stop")
        child.join(30)
        ctx.destroy(linger=0)


# serving part -----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightllm.server.api_server", *argv], stdout=open(log, "w"), stderr=subprocess.STDOUT
    )


def _wait(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server process exited (code {[p.poll() for p in procs]}); see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s:g} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _serve_and_measure(a, name: str, base_url: str) -> None:
    from lightllm.tools.bench_serving import main as bench_serving

    flags = [
        "--base_url",
        base_url,
        "--num_prompts",
        str(a.concurrency),
        "--max_concurrency",
        str(a.concurrency),
        "--input_len",
        str(a.input_len),
        "--output_len",
        str(a.output_len),
        "--result_file",
        os.path.join(a.out, f"pd_bench_{name}.json"),
    ]
    # a warm-up round at the measured concurrency (allocator, fla-core's first varlen calls at this batch; other
    # prompts, so the prefix cache cannot serve the measured ones), then the measured one; bench_serving's own
    # report is not printed
    with contextlib.redirect_stdout(io.StringIO()):
        bench_serving(
            [
                *flags[:2],
                "--num_prompts",
                str(a.concurrency),
                "--max_concurrency",
                str(a.concurrency),
                "--input_len",
                str(a.input_len),
                "--output_len",
                "8",
                "--seed",
                "1",
            ]
        )
        s = bench_serving(flags)
    cells = [
        f"{s[m][k]:.1f}" if s[m][k] is not None else "-"
        for m in ("ttft", "tpot")
        for k in ("mean_ms", "median_ms", "p99_ms")
    ]
    print(
        f"| {name} | {s['num_requests'] - s['num_failed']}/{s['num_requests']} | {' | '.join(cells)} | "
        f"{s['output_token_throughput']:.0f} |",
        flush=True,
    )


def bench_serving_parts(a) -> None:
    model = _model_dir(a.tiny)
    common = ["--model_dir", model, "--device", a.device, "--mtp_step", str(a.mtp_step)]
    print(f"\nserving: {a.concurrency} concurrent requests, {a.input_len} prompt tokens, {a.output_len} new tokens")
    print("| server | ok | TTFT mean ms | TTFT median | TTFT p99 | TPOT mean ms | TPOT median | TPOT p99 | out tok/s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    port = _free_port()
    procs = [_start([*common, "--port", str(port)], os.path.join(a.out, "pd_bench_monolithic.log"))]
    try:
        _wait(f"http://127.0.0.1:{port}/health", procs, a.start_timeout_s)
        _serve_and_measure(a, "monolithic", f"http://127.0.0.1:{port}")
    finally:
        _stop(procs)
    node_mem = ["--mem_fraction", "0.38"] if a.device == "cuda" else []
    for transport in a.serving_transports:
        port = _free_port()
        master = _start(
            ["--run_mode", "pd_master", "--model_dir", model, "--port", str(port)],
            os.path.join(a.out, f"pd_bench_master_{transport}.log"),
        )
        nodes = [
            _start(
                [*common, *node_mem, "--run_mode", role, "--pd_master_port", str(port), "--pd_transport", transport],
                os.path.join(a.out, f"pd_bench_{role}_{transport}.log"),
            )
            for role in ("prefill", "decode")
        ]
        try:
            _wait(f"http://127.0.0.1:{port}/pd/ready", [master, *nodes], a.start_timeout_s)
            _serve_and_measure(a, f"pd 1P1D {transport}", f"http://127.0.0.1:{port}")
        finally:
            _stop([*nodes, master])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen3.5 checkpoint instead of the real-width one")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--parts", default="transfer,serving")
    p.add_argument("--transfer_lens", default="256,1024,4096,16384", help="prompt lengths of the transfer part")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--transports",
        default=None,
        help="transfer part (default: host,cuda_ipc on cuda, host on cpu; nixl if installed)",
    )
    p.add_argument("--serving_transports", default=None, help="serving part (default: cuda_ipc on cuda, else host)")
    p.add_argument("--ipc_buffer_mb", type=int, default=1024)
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input_len", type=int, default=256)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--start_timeout_s", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/lightllm_gpu_out"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    default_transports = "host,cuda_ipc" if a.device == "cuda" else "host"
    if nixl_module_name() is not None:
        default_transports += ",nixl"
    a = argparse.Namespace(
        **{
            **vars(a),
            "transfer_lens": [int(x) for x in a.transfer_lens.split(",")],
            "transports": (a.transports or default_transports).split(","),
            # one deployment against the monolithic server: the device path on cuda
            "serving_transports": (a.serving_transports or ("cuda_ipc" if a.device == "cuda" else "host")).split(","),
        }
    )
    parts = a.parts.split(",")
    print(
        f"checkpoint {_model_dir(a.tiny)} on {a.device}"
        + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else ""),
        flush=True,
    )
    if "transfer" in parts:
        print("\ntransfer: end of the prefill step -> imported on the decode process (median)")
        print("| transport | prompt tokens | state MiB | ms | GB/s | went as |\n|---|---|---|---|---|---|", flush=True)
        # in a process of its own, so its engines' device memory is free for the serving part
        proc = mp.get_context("spawn").Process(target=transfer_part, args=(a,))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"the transfer part failed (exit code {proc.exitcode})")
    if "serving" in parts:
        bench_serving_parts(a)


if __name__ == "__main__":
    main()
