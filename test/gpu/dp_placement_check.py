"""Data-parallel device placement on a multi-GPU host: which GPUs each replica's processes really hold.

    python test/gpu/dp_placement_check.py --result_file $OUT/dp_placement.json

Cases (a case needing more GPUs than are visible is reported as skipped):
- `own-2x1`: `--dp 2 --tp 1` on 2+ GPUs: replica 0 on GPU 0 only, replica 1 on GPU 1 only;
- `own-2x2`: `--dp 2 --tp 2` on 4+ GPUs: replica 0 (rank 0 and its follower) on GPUs 0 and 1, replica 1 on 2 and 3;
- `shared`: `--dp 2` with only the first GPU visible: both replicas on it, the start-up log says they share it;
- `refused`: `--dp 2 --tp 2` with one or two GPUs visible: exit code 2 and one line naming the count, before any
  model loads.

A served case starts the HTTP server on the tiny Qwen3.5 checkpoint with `--dp_balancer round_robin`, sends the same
greedy chat request twice (one per replica: the answers must match), reads each replica's engine pid from
`GET /dp/replicas`, and maps the GPU processes `nvidia-smi` lists to replicas through their parent chain (a TP
follower is a child of its replica's engine). Exits 1 when a case fails; without CUDA it prints a skip and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import httpx  # noqa: E402
import torch  # noqa: E402
from smoke_serving_gpu import log_tail, stop_server, wait_healthy  # noqa: E402

START_TIMEOUT_S = 300
# seconds to wait for nvidia-smi to list every replica's process after /health answered
LIST_WAIT_S = 20


def gpu_uuids() -> list[str]:
    """The UUID of each GPU this process sees, in visible-index order (nvidia-smi's spelling)."""
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return [u if u.startswith("GPU-") else f"GPU-{u}" for u in uuids]


def gpu_processes() -> list[tuple[int, str]]:
    """(pid, GPU UUID) of every compute process nvidia-smi lists."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return [(int(pid), uuid.strip()) for pid, uuid in rows]


def ancestors(pid: int) -> set[int]:
    """`pid` and its parents up to init (from /proc)."""
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        # the command name in parentheses may hold spaces: the parent pid is the second field after it
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return chain


def replica_gpus(engine_pids: list[int], uuids: list[str]) -> list[list[int]]:
    """The GPUs each replica's process tree holds, as indices into `uuids` (the server's visible GPUs)."""
    found: list[set[int]] = [set() for _ in engine_pids]
    for pid, uuid in gpu_processes():
        chain = ancestors(pid)
        for i, engine in enumerate(engine_pids):
            if engine in chain and uuid in uuids:
                found[i].add(uuids.index(uuid))
    return [sorted(s) for s in found]


def served_case(name: str, model_dir: str, flags: list[str], visible: list[str], expected: list[list[int]]) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(visible))
    log = os.path.join(tempfile.gettempdir(), f"dp_placement_{name}.log")
    port = _free_port()
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", model_dir, "--port", str(port)]
    cmd += ["--device", "cuda", "--dp_balancer", "round_robin", "--mem_fraction", "0.3", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    row: dict = {"case": name, "flags": flags, "visible": visible, "expected": expected}
    try:
        wait_healthy(proc, port, START_TIMEOUT_S)
        answers = [greedy_text(port) for _ in range(2)]
        replicas = httpx.get(f"http://127.0.0.1:{port}/dp/replicas", timeout=10).json()["replicas"]
        pids = [r["pid"] for r in replicas]
        deadline = time.monotonic() + LIST_WAIT_S
        while True:
            got = replica_gpus(pids, visible)
            if got == expected or time.monotonic() > deadline:
                break
            time.sleep(1)
        row.update(got=got, routed=[r["num_routed"] for r in replicas], answers=answers)
        problems = []
        if got != expected:
            problems.append(f"replicas on GPUs {got}, expected {expected}")
        if answers[0] != answers[1]:
            problems.append(f"the replicas answered differently: {answers}")
        if row["routed"] != [1, 1]:
            problems.append(f"round robin routed {row['routed']}, expected [1, 1]")
        if "share" in name and "share CUDA device 0" not in log_tail(log, 200000):
            problems.append("no log line saying the replicas share device 0")
        row["ok"] = not problems
        if problems:
            row["error"] = "; ".join(problems)
    except Exception as exc:  # noqa: BLE001 - the row reports it, the other cases go on
        row.update(ok=False, error=f"{exc!r}; server log tail: {log_tail(log)}")
    finally:
        stop_server(proc, 60)
    return row


def greedy_text(port: int) -> str:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"]
    messages = [{"role": "user", "content": "Linear attention keeps a state"}]
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def refused_case(model_dir: str, visible: list[str]) -> dict:
    """`--dp 2 --tp 2` with one or two GPUs visible: refused (a replica of two ranks never shares a GPU)."""
    n = len(visible)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(visible))
    flags = ["--dp", "2", "--tp", "2"]
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", model_dir, "--device", "cuda", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    wanted = f"--dp 2 x --tp 2 needs 4 CUDA devices, {n} visible"
    lines = [line for line in done.stderr.splitlines() if line.startswith("lightllm:")]
    ok = done.returncode == 2 and len(lines) == 1 and wanted in lines[0]
    row = {"case": "refused", "flags": flags, "visible": visible, "ok": ok, "exit_code": done.returncode}
    row["line"] = lines[0] if lines else done.stderr[-500:]
    if not ok:
        row["error"] = f"expected exit 2 and one line with {wanted!r}"
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result_file", default=None, help="write the rows as JSON here")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        print("dp_placement_check: skipped (no CUDA device)")
        return 0
    from lightllm.tools.make_tiny_model import tiny_model_dir

    model_dir = str(tiny_model_dir("qwen3_5"))
    # each server sees the first GPUs of this process by UUID, the names nvidia-smi lists its processes under
    uuids = gpu_uuids()
    rows = []
    cases = [
        ("own-2x1", ["--dp", "2"], 2, [[0], [1]]),
        ("own-2x2", ["--dp", "2", "--tp", "2"], 4, [[0, 1], [2, 3]]),
        ("shared", ["--dp", "2"], 1, [[0], [0]]),
    ]
    for name, flags, needed, expected in cases:
        if len(uuids) < needed:
            rows.append({"case": name, "ok": None, "skipped": f"needs {needed} GPUs, {len(uuids)} visible"})
            continue
        rows.append(served_case(name, model_dir, flags, uuids[:needed], expected))
    rows.append(refused_case(model_dir, uuids[: min(len(uuids), 2)]))
    for row in rows:
        status = "skip" if row["ok"] is None else ("ok" if row["ok"] else "FAIL")
        detail = row.get("skipped") or row.get("error") or row.get("got") or row.get("line")
        print(f"| {row['case']} | {status} | {detail} |", flush=True)
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(rows, indent=1))
    return 1 if any(row["ok"] is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
