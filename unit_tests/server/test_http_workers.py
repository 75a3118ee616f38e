"""More than one HTTP front-end process (`--http_workers`): the engine sends each process its own requests' outputs,
a real server with two processes answers like the offline engine on every connection, /metrics counts all of them
whichever process answers, and the server stops when one of its processes dies."""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lightllm import LLM, SamplingParams
from lightllm.engine.messages import EngineStats, Finished, TokenChunk
from lightllm.server.api_server import serve
from lightllm.server.args import load_server_args
from lightllm.server.engine_loop import FrontendRoutes
from lightllm.server.http.metric_rows import MetricRows
from lightllm.server.http.metrics import Metrics
from lightllm.server.http.workers import Workers
from lightllm.server.launcher import EngineStartError
from lightllm.server.prestart import PrestartedHttpProcesses
from unit_tests.server.live_server import single_threaded_env
from unit_tests.server.responses_stream import stream_events


def test_routes_send_each_request_to_its_process_and_stats_to_all():
    routes = FrontendRoutes(3)
    for req_id, frontend in (("a", 0), ("b", 2), ("c", 1), ("d", 7), ("e", "x")):
        routes.note(req_id, frontend)
    stats = EngineStats()
    outputs = [TokenChunk("b", [1]), stats, TokenChunk("c", [2]), Finished("b", "stop"), TokenChunk("a", [3])]
    outputs += [TokenChunk("d", [4]), TokenChunk("e", [5]), TokenChunk("b", [6])]
    parts = routes.split(outputs)
    # an index no process has answers to the first; a route ends with its request's Finished
    assert parts[0] == [stats, outputs[4], outputs[5], outputs[6], outputs[7]]
    assert parts[1] == [stats, outputs[2]]
    assert parts[2] == [outputs[0], stats, outputs[3]]


def test_twin_a_request_noted_elsewhere_is_not_routed_there():
    routes = FrontendRoutes(2)
    routes.note("a", 1)
    assert routes.split([TokenChunk("a", [1])])[0] == []


@pytest.mark.parametrize(
    "flags",
    [["--http_workers", "0"], ["--http_workers", "2", "--dp", "2"], ["--http_workers", "2", "--run_mode", "pd_master"]],
)
def test_refused_combinations(flags):
    with pytest.raises(ValueError, match="--http_workers"):
        load_server_args([*flags, "--device", "cpu"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the CLI with one HTTP process prestarted, as on a GPU host (its pid printed, to check it is the one that serves)
PRESTARTED_CLI = """
import sys
from lightllm.server import api_server, prestart
P = prestart.PrestartedHttpProcesses
spawn = P.__init__
def prestart_one(self, count):
    spawn(self, count)
    print("prestarted pids", [p.pid for p, _ in self._waiting], flush=True)
P.__init__ = prestart_one
P.for_host = classmethod(lambda cls: cls(1))
sys.exit(api_server.main(sys.argv[1:]))
"""


@pytest.fixture(params=["spawned", "prestarted"])
def two_process_server(tmp_path, request):
    port, log = _free_port(), tmp_path / "server.log"
    entry = ["-m", "lightllm.server.api_server"] if request.param == "spawned" else ["-c", PRESTARTED_CLI]
    cmd = [sys.executable, *entry, "--device", "cpu", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--http_workers", "2"], stdout=out, stderr=subprocess.STDOUT, env=single_threaded_env()
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not re.search(r"HTTP processes share port \d+ \(pids (\d+), (\d+)\)", log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    pids = [int(p) for p in re.search(r"\(pids (\d+), (\d+)\)", log.read_text()).groups()]
    prestarted = re.search(r"prestarted pids \[(\d+)\]", log.read_text())
    # the prestarted process became HTTP process 1; without one, nothing was prestarted
    assert (int(prestarted.group(1)) if prestarted else None) == (pids[1] if request.param == "prestarted" else None)
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    yield url, proc, pids, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _scrape(url: str) -> dict[str, float]:
    # a fresh connection each time: the kernel may hand it to either process
    text = httpx.get(f"{url}/metrics", headers={"connection": "close"}).text
    values = {}
    for line in text.splitlines():
        if line.startswith(("lightllm_requests_total", "lightllm_http_worker_requests_total")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_two_processes_serve_like_the_engine_and_count_together(two_process_server):
    url, proc, pids, log = two_process_server
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompts = [f"request {i} asks about the number {i * 7 % 13}" for i in range(24)]

    def complete(i: int) -> str:
        body = {"model": model, "prompt": prompts[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        with httpx.Client(headers={"connection": "close"}) as c:
            return c.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(complete, range(24)))
    llm = LLM(device="cpu")
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert texts == expected
    # the twin: answers matched to other prompts differ
    assert texts != expected[1:] + expected[:1]
    for _ in range(6):
        values = _scrape(url)
        assert sum(v for k, v in values.items() if k.startswith("lightllm_requests_total")) == 24
        per_process = [values[f'lightllm_http_worker_requests_total{{worker="{i}"}}'] for i in range(2)]
        assert sum(per_process) == 24 and min(per_process) > 0, per_process
    _continue_across_processes(url, model)
    # a process that dies stops the server with its own exit code
    os.kill(pids[1], signal.SIGKILL)
    assert proc.wait(60) == 4, log.read_text()[-3000:]


def _continue_across_processes(url: str, model: str) -> None:
    """A chain of Responses API continuations, each on a fresh connection (the kernel hands it to either process):
    every process finds the responses the other kept, and the last one answered the whole chain; background
    responses are cancelled through either process."""
    previous = None
    for turn in range(8):
        body = {"model": model, "input": f"turn {turn}", "max_output_tokens": 3, "temperature": 0}
        if previous is not None:
            body["previous_response_id"] = previous
        with httpx.Client(headers={"connection": "close"}) as c:
            r = c.post(f"{url}/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    with httpx.Client(headers={"connection": "close"}) as c:
        items = c.get(f"{url}/v1/responses/{previous}/input_items", params={"order": "asc", "limit": 100}).json()
    users = [i["content"][0]["text"] for i in items["data"] if i.get("role") == "user"]
    assert users == [f"turn {t}" for t in range(8)]
    # background responses polled and cancelled on fresh connections: whichever process runs one, another may be
    # asked about it
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 100000}}, "required": ["a"]}
    text = {"format": {"type": "json_schema", "name": "long", "schema": schema}}
    body = {"model": model, "input": "go", "max_output_tokens": 3000, "background": True, "text": text}
    for _ in range(3):
        with httpx.Client(headers={"connection": "close"}) as c:
            queued = c.post(f"{url}/v1/responses", json=body, timeout=120).json()
        with httpx.Client(headers={"connection": "close"}) as c:
            cancelled = c.post(f"{url}/v1/responses/{queued['id']}/cancel", timeout=60).json()
        assert cancelled["status"] == "cancelled", (cancelled["usage"], str(cancelled["output"])[:600])
    _stream_across_processes(url, {**body, "max_output_tokens": 120, "stream": True})
    _conversation_across_processes(url)


def _conversation_across_processes(url: str) -> None:
    """Items added to one conversation at once, each on a fresh connection (either process): none is lost."""

    def post(path: str, body: dict) -> dict:
        with httpx.Client(headers={"connection": "close"}) as c:
            r = c.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    conversation = post("/v1/conversations", {"items": [{"role": "user", "content": "start"}]})
    words = [f"word {i}" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda w: post(
                    f"/v1/conversations/{conversation['id']}/items", {"items": [{"role": "user", "content": w}]}
                ),
                words,
            )
        )
    with httpx.Client(headers={"connection": "close"}) as c:
        r = c.get(f"{url}/v1/conversations/{conversation['id']}/items", params={"order": "asc", "limit": 100})
    texts = [item["content"][0]["text"] for item in r.json()["data"]]
    assert texts[0] == "start" and sorted(texts[1:]) == sorted(words)


def _stream_across_processes(url: str, body: dict) -> None:
    """A streamed background response read a few events at a time, each time on a fresh connection resuming
    after the last event seen: whichever process runs it, the pieces join into the whole stream."""
    with httpx.Client(headers={"connection": "close"}) as c, c.stream("POST", f"{url}/v1/responses", json=body) as s:
        seen = list(itertools.islice(stream_events(s.iter_lines()), 3))
    response_id = seen[0][1]["response"]["id"]
    while seen[-1][0] not in ("response.completed", "response.incomplete"):
        params = {"stream": "true", "starting_after": seen[-1][1]["sequence_number"]}
        with httpx.Client(headers={"connection": "close"}) as c:
            with c.stream("GET", f"{url}/v1/responses/{response_id}", params=params, timeout=60) as s:
                seen.extend(itertools.islice(stream_events(s.iter_lines()), 40))
    with httpx.Client(headers={"connection": "close"}) as c:
        with c.stream("GET", f"{url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=60) as s:
            whole = list(stream_events(s.iter_lines()))
    assert seen == whole and whole[-1][1]["response"]["usage"]["output_tokens"] == 120


def test_sigterm_stops_every_process_cleanly(two_process_server):
    url, proc, pids, log = two_process_server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    time.sleep(1)
    for pid in pids[1:]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_first_process_refuses_a_port_another_server_holds():
    from lightllm.server.http.workers import listen_socket

    port = _free_port()
    # another server that shares its port on purpose (SO_REUSEPORT) and is listening
    other = listen_socket("127.0.0.1", port)
    other.listen()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_socket("127.0.0.1", port, first=True)
        # the twin: the server's own later processes do join it
        listen_socket("127.0.0.1", port).close()
    finally:
        other.close()
    listen_socket("127.0.0.1", port, first=True).close()


def test_processes_started_before_the_engine_wait_for_it_and_stop_without_it(tmp_path):
    """The other HTTP processes start beside the engine and block until they are handed its addresses; a server
    whose engine does not come up stops them while they wait."""
    args, info = load_server_args(["--device", "cpu", "--http_workers", "3"])
    rows_path = MetricRows.create_file(Metrics.WIDTH, args.http_workers)
    try:
        workers = Workers(args, info, rows_path)
        time.sleep(1.0)
        assert [p.is_alive() for p in workers.processes] == [True, True]
        started = time.monotonic()
        workers.stop()
        assert time.monotonic() - started < 15
        assert all(p.exitcode is not None for p in workers.processes)
    finally:
        os.remove(rows_path)


def _failing_runner(args, info):
    raise RuntimeError("this runner cannot start")


def test_an_engine_that_fails_to_start_stops_the_waiting_processes():
    args, info = load_server_args(["--device", "cpu", "--http_workers", "2", "--port", str(_free_port())])
    with pytest.raises(EngineStartError, match="this runner cannot start"):
        serve(args, info, runner_factory=f"{__name__}:_failing_runner")
    # the HTTP process started beside the engine is stopped and joined, not left waiting
    assert mp.active_children() == []


def test_prestarted_processes_are_taken_first_and_the_rest_spawned():
    args, info = load_server_args(["--device", "cpu", "--http_workers", "3"])
    rows_path = MetricRows.create_file(Metrics.WIDTH, args.http_workers)
    prestarted = PrestartedHttpProcesses(2)
    waiting = [p.pid for p, _ in prestarted._waiting]
    try:
        workers = Workers(args, info, rows_path, prestarted)
        assert [p.pid for p in workers.processes] == waiting
        assert [p.name for p in workers.processes] == ["lightllm-http-1", "lightllm-http-2"]
        workers.stop()
        # twin: with one prestarted, the second process is a fresh one
        prestarted = PrestartedHttpProcesses(1)
        waiting = [p.pid for p, _ in prestarted._waiting]
        workers = Workers(args, info, rows_path, prestarted)
        assert workers.processes[0].pid == waiting[0] and workers.processes[1].pid not in waiting
        workers.stop()
        assert all(p.exitcode is not None for p in workers.processes)
    finally:
        prestarted.discard()
        os.remove(rows_path)
