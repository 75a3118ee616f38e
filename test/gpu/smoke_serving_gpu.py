"""GPU smoke run of the whole serving path: tiny checkpoints, every architecture x state mode x speculation.

    python test/gpu/smoke_serving_gpu.py [--archs qwen3_next,kimi_linear] [--max-tokens 32]

For each architecture it generates greedy text with the offline `LLM` API on CUDA (fp32 activations, fp32 state,
ieee dots so the comparison is exact) in native / compact / replay, without speculation, with MTP (Qwen) and with
n-gram drafts, and compares the token ids with transformers' greedy decoding on the CPU. Then it starts the HTTP
server on CUDA in replay mode with MTP and sends one chat completion. `--real-width` adds a random-weight
checkpoint at Qwen3-Next TP1 width (4 layers, bf16, the layout of `check_models_gpu.py`) served in each mode with
MTP: 8 concurrent prompts of 300 tokens, 64 new tokens each; it checks that every request finishes with the
requested length and reports tokens/s and the mean accepted length (random weights make the drafts poor, so the
acceptance is low; text equality across modes is not expected in bf16). Prints one table; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

# exact fp32 dots inside fla's chunk kernels for a token-exact comparison (set before fla is imported)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

PROMPTS = ["Linear attention keeps a state", "The quick brown fox", [5, 9, 13, 17, 21, 25, 29, 33] * 3]
HAS_MTP = {"qwen3_next": True, "qwen3_5": True, "qwen3_5_moe": True, "kimi_linear": False}


def _expected(model_dir: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from unit_tests.helpers.hf_oracle import HFOracle

    oracle = HFOracle(model_dir)
    return [oracle.greedy(ids, max_tokens) for ids in prompt_ids]


def _run_llm(model_dir: str, mode: str, spec: dict, max_tokens: int, device: str):
    from lightllm import LLM, SamplingParams

    llm = LLM(model_dir, device=device, data_type="float32", ssm_state_mode=mode, max_total_token_num=4096, **spec)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    prompt_ids = [o.prompt_token_ids for o in outs]
    close = getattr(llm, "shutdown", None) or getattr(llm, "close", None)
    if close is not None:
        close()
    return ids, seconds, prompt_ids


def _real_width_rows(root: str, modes: list[str], device: str) -> list[str]:
    """Serve the real-width random-weight checkpoint in each mode with MTP (bf16); one table row per mode."""
    from check_models_gpu import real_width_checkpoint

    from lightllm import LLM, SamplingParams

    model_dir = real_width_checkpoint(root)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (300,), generator=gen).tolist() for _ in range(8)]
    rows = []
    for mode in modes:
        try:
            llm = LLM(
                model_dir,
                device=device,
                data_type="bfloat16",
                ssm_state_mode=mode,
                mtp_step=2,
                max_total_token_num=16384,
                max_running_requests=8,
            )
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            st = llm.engine.stats
            accepted = (st.num_accepted_draft_tokens + st.num_spec_windows) / max(1, st.num_spec_windows)
            ok = lengths == [64] * len(prompts)
            status = "ok" if ok else f"FAIL lengths {lengths}"
            rows.append(f"| {mode} | {sum(lengths) / seconds:.0f} | {accepted:.2f} | {status} |")
            close = getattr(llm, "shutdown", None) or getattr(llm, "close", None)
            if close is not None:
                close()
        except Exception as exc:  # noqa: BLE001 - report every mode
            rows.append(f"| {mode} | - | - | ERROR {exc!r} |"[:200])
        print(rows[-1], flush=True)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: str, device: str, flags: list[str], log_path: str, tree: str | None = None
) -> tuple[subprocess.Popen, int]:
    """`python -m lightllm.server.api_server` on a free port with `flags`, its output in `log_path` (a file, so a
    chatty server never blocks on a full pipe). It stays in this process group: a deadline that stops the caller
    (`timeout` in h200_stages.sh) stops the server too. `tree`: the server of another copy of the repository (run
    from that folder, ahead on the path). Returns (process, port)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "lightllm.server.api_server",
        "--model_dir",
        model_dir,
        "--port",
        str(port),
        "--device",
        device,
        *flags,
    ]
    env = None
    if tree is not None:
        tree = os.path.abspath(tree)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tree, env=env)
    return proc, port


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Poll /health until it answers 200; RuntimeError when the server exits first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before /health answered")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {timeout_s:.0f} s")


def chat_once(port: int, content: str = "Hello", max_tokens: int = 16) -> dict:
    """One chat completion on the served model; raises unless the answer is HTTP 200. Returns the response body."""
    import httpx

    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def stop_server(proc: subprocess.Popen, timeout_s: float = 60) -> int | None:
    """SIGTERM (the server stops its engine and exits 0), then SIGKILL if it has not exited after `timeout_s` (its
    engine process ends itself when the server is gone). Returns the exit code, None when it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return None


def log_tail(path: str, chars: int = 1500) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def _http_smoke(model_dir: str, device: str) -> str:
    with tempfile.NamedTemporaryFile(prefix="lightllm_http_smoke_", suffix=".log", delete=False) as f:
        log = f.name
    proc, port = start_server(model_dir, device, ["--ssm_state_mode", "replay", "--mtp_step", "2"], log)
    try:
        wait_healthy(proc, port, 240)
        data = chat_once(port)
        return f"ok: {data['usage']['completion_tokens']} tokens, finish={data['choices'][0]['finish_reason']}"
    except Exception as exc:  # noqa: BLE001 - report and keep the table going
        stop_server(proc, 30)
        return f"FAIL {exc!r}; server log tail: {log_tail(log)}"
    finally:
        stop_server(proc, 30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="qwen3_next,qwen3_5,qwen3_5_moe,kimi_linear")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", default="native,compact,replay")
    p.add_argument("--specs", default="none,ngram,mtp")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--real-width", action="store_true", help="also serve a random-weight Qwen3-Next-width model")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script without a GPU")
    args = p.parse_args()
    from lightllm.tools.make_tiny_model import tiny_model_dir

    failures = 0
    print("\n| arch | mode | speculation | tokens equal to transformers | generate s | status |")
    print("|---|---|---|---|---|---|", flush=True)
    for arch in [] if args.skip_tiny else args.archs.split(","):
        model_dir = str(tiny_model_dir(arch))
        specs = {"none": {}, "ngram": {"spec_ngram": 3}}
        if HAS_MTP[arch]:
            specs["mtp"] = {"mtp_step": 2}
        expected = None
        for spec_name, spec in specs.items():
            for mode in args.modes.split(","):
                if (mode == "compact" and not spec) or spec_name not in args.specs.split(","):
                    continue
                try:
                    ids, seconds, prompt_ids = _run_llm(model_dir, mode, spec, args.max_tokens, args.device)
                    if expected is None:
                        expected = _expected(model_dir, prompt_ids, args.max_tokens)
                    match = sum(a == b for x, y in zip(ids, expected) for a, b in zip(x, y))
                    total = sum(len(y) for y in expected)
                    ok = ids == expected
                    status = "ok" if ok else "MISMATCH"
                except Exception as exc:  # noqa: BLE001 - one failing cell must not hide the others
                    ok, seconds, match, total, status = False, 0.0, 0, 0, f"ERROR {exc!r}"[:120]
                failures += not ok
                # printed as it goes: a run cut short by its time limit still shows every finished cell
                print(f"| {arch} | {mode} | {spec_name} | {match}/{total} | {seconds:.2f} | {status} |", flush=True)
    if args.real_width:
        print("\n| real width, mode (mtp_step=2, bf16) | tokens/s | mean accepted length | status |")
        print("|---|---|---|---|", flush=True)
        with tempfile.TemporaryDirectory() as root:
            rows = _real_width_rows(root, args.modes.split(","), args.device)
        failures += sum("| ok |" not in r for r in rows)
    if not args.skip_http:
        result = _http_smoke(str(tiny_model_dir("qwen3_next")), args.device)
        print(f"\nHTTP server on CUDA (qwen3_next, replay, mtp_step=2): {result}")
        failures += not result.startswith("ok")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{name} torch {torch.__version__}; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
