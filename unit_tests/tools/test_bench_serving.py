"""`python -m lightllm.tools.bench_serving` against a live demo-model server (real runner, CPU): both datasets
complete with exact output lengths, latencies are ordered and positive, MTP acceptance comes from /metrics, and the
JSON and PNG files are written."""

from __future__ import annotations

import asyncio
import json
import zlib

import numpy as np
import pytest

from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.tools import bench_serving
from lightllm.tools.png_plot import encode_png
from unit_tests.server.live_server import LiveServer


@pytest.fixture(scope="module")
def server():
    s = LiveServer(DEFAULT_RUNNER_FACTORY, device="cpu", max_running_requests=4, max_total_token_num=2048, mtp_step=1)
    yield s
    s.close()


def test_random_dataset(server, tmp_path):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    s = bench_serving.main(
        [
            "--base_url",
            server.base_url,
            "--num_prompts",
            "6",
            "--max_concurrency",
            "3",
            "--input_len",
            "12",
            "--output_len",
            "5",
            "--result_file",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert s["num_requests"] == 6 and s["num_failed"] == 0
    saved = json.loads(out.read_text())
    assert [r["output_tokens"] for r in saved["requests"]] == [5] * 6
    assert [r["prompt_tokens"] for r in saved["requests"]] == [12] * 6
    assert s["output_token_throughput"] > 0
    for name in ("ttft", "tpot", "itl"):
        assert 0 < s[name]["median_ms"] <= s[name]["p99_ms"]
    # ITL spans events: the tokens each streamed event carried on average
    events = sum(len(r["itl_s"]) + 1 for r in saved["requests"])
    assert 6 <= events <= 30 and s["tokens_per_event"] == pytest.approx(30 / events)
    # the server drafts with its MTP head: every decode window is drafted, accepted length in [1, 2]
    assert 1.0 <= s["mean_accepted_len"] <= 2.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_client_processes_share_the_requests(server, tmp_path):
    out = tmp_path / "w.json"
    argv = ["--base_url", server.base_url, "--num_prompts", "7", "--max_concurrency", "3", "--input_len", "9"]
    s = bench_serving.main([*argv, "--output_len", "4", "--num_workers", "2", "--result_file", str(out)])
    requests = json.loads(out.read_text())["requests"]
    assert s["num_requests"] == 7 and s["num_failed"] == 0 and len(requests) == 7
    assert [r["output_tokens"] for r in requests] == [4] * 7
    # both processes count from one shared start: every request began and ended inside the run
    assert all(0 <= r["start_s"] and r["start_s"] + r["latency_s"] <= s["duration_s"] + 1e-6 for r in requests)
    with pytest.raises(SystemExit):
        bench_serving.main([*argv, "--num_workers", "0"])


def test_multi_turn_dataset_sends_growing_conversations(server, tmp_path):
    out = tmp_path / "m.json"
    s = bench_serving.main(
        [
            "--base_url",
            server.base_url,
            "--dataset",
            "multi_turn",
            "--num_prompts",
            "2",
            "--num_turns",
            "3",
            "--input_len",
            "10",
            "--output_len",
            "4",
            "--max_concurrency",
            "2",
            "--result_file",
            str(out),
        ]
    )
    assert s["num_requests"] == 6 and s["num_failed"] == 0
    reqs = sorted(json.loads(out.read_text())["requests"], key=lambda r: r["start_s"])
    # each conversation's turns resend everything before: prompt lengths grow within a conversation
    first, later = min(r["prompt_tokens"] for r in reqs), max(r["prompt_tokens"] for r in reqs)
    assert later > first + 2 * 4


def test_png_encoder_roundtrip():
    img = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    data = encode_png(img, {"k": "v"})
    idat = data[data.index(b"IDAT") + 4 :]
    raw = zlib.decompress(idat[: idat.index(b"IEND") - 8])
    assert raw == b"\x00" + img[0].tobytes() + b"\x00" + img[1].tobytes()
    assert b"tEXtk\x00v" in data


class _ChunkedResponse:
    """What `_sse_data` reads of an httpx response: its body in the given chunks."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def aiter_bytes(self):
        for chunk in self.chunks:
            yield chunk


def _events_and_body(rng) -> tuple[list[bytes], bytes]:
    """Random SSE events (raw U+2028 and U+0085 inside the JSON, as a server may send them) with LF, CRLF or CR
    line ends, comment lines and blank lines between, and the stream's bytes."""
    payloads, body = [], b""
    for i in range(int(rng.integers(1, 30))):
        text = "".join(rng.choice(["a", "é", "\u2028", "\x85", " ", "中"], size=int(rng.integers(0, 12))))
        payload = json.dumps({"i": i, "text": text}, ensure_ascii=False).encode()
        end = [b"\n", b"\r\n", b"\r"][int(rng.integers(0, 3))]
        if rng.random() < 0.3:
            body += b": keep-alive" + end
        body += b"data: " + payload + end + end
        payloads.append(payload)
    return payloads + [b"[DONE]"], body + b"data: [DONE]\n\n"


def _parse(chunks: list[bytes]) -> list[bytes]:
    async def run():
        return [data async for data in bench_serving._sse_data(_ChunkedResponse(chunks))]

    return asyncio.run(run())


def _random_cuts(rng, body: bytes) -> list[bytes]:
    cuts = sorted(set(rng.integers(0, len(body), size=int(rng.integers(0, 12))).tolist()))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]


def test_sse_events_parse_from_any_chunking():
    rng = np.random.default_rng()
    for _ in range(100):
        payloads, body = _events_and_body(rng)
        assert _parse(_random_cuts(rng, body)) == payloads


def test_twin_a_line_reader_that_splits_like_str_splitlines_breaks_events():
    rng = np.random.default_rng()
    payloads, body = _events_and_body(rng)
    while not any("\u2028".encode() in p or "\x85".encode() in p for p in payloads):
        payloads, body = _events_and_body(rng)
    lines = body.decode().splitlines()
    assert [line[6:].encode() for line in lines if line.startswith("data: ")] != payloads


def test_itl_stalls_are_counted_in_the_window_they_end():
    # a 10 s run, median TPOT 10 ms: stalls are gaps over 40 ms
    r = bench_serving.RequestResult
    results = [
        # first token at 1.0 s, then gaps ending at 1.05 (stall), 1.06, 5.56 (stall)
        r(start_s=0.5, ok=True, ttft_s=0.5, itl_s=[0.05, 0.01, 4.5]),
        # gaps of exactly the bound are not stalls; one ending at 9.99 s is in the last window
        r(start_s=9.0, ok=True, ttft_s=0.1, itl_s=[0.04, 0.85]),
    ]
    s = bench_serving.itl_stalls(results, 10.0, 0.01)
    assert s["num_stalls"] == 3 and s["share"] == pytest.approx(3 / 5)
    assert s["by_window"] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    # twin: a slower median TPOT makes none of them stalls
    assert bench_serving.itl_stalls(results, 10.0, 2.0)["num_stalls"] == 0
