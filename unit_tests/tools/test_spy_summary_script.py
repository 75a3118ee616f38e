"""`test/gpu/spy_summary.py` on a recording in py-spy's raw format (`--subprocesses --threads`): samples go to the
innermost process and its thread, own time to the last frame, the project's frames get the samples under them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("spy_summary", ROOT / "test" / "gpu" / "spy_summary.py")
spy_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spy_summary)

SERVER = 'process 10:"python -m lightllm.server.api_server --port 8011"'
ENGINE = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"'
STEP = "step (lightllm/engine/engine.py:120)"
RECORDING = [
    f"{SERVER};thread (0x1);run (uvicorn/server.py:60);send (lightllm/server/http/serving.py:88);write (asyncio:1) 30\n",
    f"{SERVER};thread (0x1);run (uvicorn/server.py:60);receive (lightllm/server/http/engine_client.py:40) 10\n",
    f"{SERVER};{ENGINE};thread (0x7);serve (lightllm/server/engine_loop.py:50);{STEP};forward (torch/nn.py:1) 45\n",
    f"{SERVER};{ENGINE};thread (0x7);serve (lightllm/server/engine_loop.py:50);{STEP} 5\n",
    f"{SERVER};{ENGINE};thread (0x9);fill (llguidance:1) 20\n",
    "a malformed line without a count\n",
]


def test_samples_go_to_the_innermost_process_and_its_thread():
    rows = {root: (n, dict(own), dict(under)) for root, n, own, under in spy_summary.summarize(RECORDING)}
    assert set(rows) == {"process 10 thread (0x1)", "process 11 thread (0x7)", "process 11 thread (0x9)"}
    n, own, under = rows["process 11 thread (0x7)"]
    assert n == 50 and own == {"forward (torch/nn.py:1)": 45, STEP: 5}
    assert under == {"serve (lightllm/server/engine_loop.py:50)": 50, STEP: 50}
    n, own, under = rows["process 10 thread (0x1)"]
    assert n == 40 and own == {"write (asyncio:1)": 30, "receive (lightllm/server/http/engine_client.py:40)": 10}
    assert under == {
        "send (lightllm/server/http/serving.py:88)": 30,
        "receive (lightllm/server/http/engine_client.py:40)": 10,
    }
    # twin: the engine's samples counted under the server process (the outermost frame) would merge the two
    assert rows["process 11 thread (0x9)"][0] == 20 and "process 10 thread (0x7)" not in rows


def test_the_busiest_root_comes_first_and_busy_shares_print(capsys, tmp_path):
    path = tmp_path / "spy.txt"
    path.write_text("".join(RECORDING))
    spy_summary.main([str(path), "--rate", "10", "--seconds", "5", "--top", "2"])
    out = capsys.readouterr().out
    assert out.index("process 11 thread (0x7): 50 samples, 100% busy") < out.index("process 10 thread (0x1): 40")
    assert "  90.0%  forward (torch/nn.py:1)" in out
