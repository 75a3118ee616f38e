"""GPU check of the model runner: tiny-checkpoint parity vs transformers (fp32 with ieee dots, and bf16) in every
state mode, plus one real-width forward (Qwen3-Next layout, 4 layers, hidden 2048, H=16, HV=32, K=V=128).

    python test/gpu/check_models_gpu.py            # prints a table, exit status 1 on any failure
    python test/gpu/check_models_gpu.py --skip-real-width --dtypes float32   # parts, to fit a 10-minute slot
    python test/gpu/check_models_gpu.py --skip-tiny
    python -m pytest -q test/gpu/check_models_gpu.py   # same checks as pytest tests (skipped without CUDA)

transformers (the oracle) runs on the CPU in fp32; the runner runs on CUDA. MoE tiny configs route every token to
all experts (top_k = num_experts) so TF32/bf16 noise cannot flip a routing decision.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")
MODES = ("native", "compact", "replay")
# tiny sizes: HV/H = 2, every expert active (no routing ties possible)
TINY = {"num_experts": 4, "num_experts_per_tok": 4}
REAL_WIDTH = dict(
    hidden_size=2048,
    num_layers=4,
    vocab_size=4096,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    intermediate_size=5120,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=4,
)
FP32_MAX_REL = 1e-3
BF16_MAX_REL = 8e-2
GREEDY_TOKENS = 32


def _imports():
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from lightllm.engine.batch import ForwardBatch
    from lightllm.tools.make_tiny_model import tiny_model_dir
    from lightllm.worker.config import RunnerConfig
    from lightllm.worker.runner import ModelRunner
    from unit_tests.helpers.hf_oracle import HFOracle

    return ForwardBatch, ModelRunner, RunnerConfig, tiny_model_dir, HFOracle


def max_rel(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.float().cpu(), e.float().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max()).item()


class Driver:
    """Prefill / verify / accept on one request, like the engine."""

    def __init__(self, runner, ForwardBatch):
        self.runner, self.FB = runner, ForwardBatch
        self.h = runner.add_request()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.runner.forward(self.FB([self.h], [len(ids)], [0], 1, torch.tensor(ids), [True])).logits[-1]

    def verify(self, window: list[int]) -> torch.Tensor:
        n = self.runner.num_tokens(self.h)
        return self.runner.forward(self.FB([self.h], [len(window)], [n], 0, torch.tensor(window))).logits


def check_tiny(arch: str, mode: str, dtype: str, cache: dict, device: str = "cuda") -> dict:
    """Prefill, decode, greedy-with-verify (W=2) and MTP draft parity of one (arch, mode, dtype)."""
    ForwardBatch, ModelRunner, RunnerConfig, tiny_model_dir, HFOracle = _imports()
    model_dir = str(tiny_model_dir(arch, seed=0, **TINY))
    if arch not in cache:
        oracle = HFOracle(model_dir)
        prompt = [(37 * i + 11) % 450 for i in range(24)]
        cache[arch] = (oracle, prompt, oracle.prefill_logits(prompt)[0], oracle.greedy(prompt, GREEDY_TOKENS))
    oracle, prompt, ref_prefill, ref_stream = cache[arch]
    mtp = arch != "kimi_linear"
    cfg = RunnerConfig(
        model_dir=model_dir,
        device=device,
        data_type=dtype,
        ssm_state_mode=mode,
        mtp_step=1 if mtp else 0,
        max_width=2,
        replay_capacity=4,
        max_running_requests=4,
        max_total_token_num=1024,
        max_req_total_len=256,
    )
    d = Driver(ModelRunner(cfg), ForwardBatch)
    t0 = time.perf_counter()
    logits = d.prefill(prompt)
    row = {"arch": arch, "mode": mode, "dtype": dtype, "prefill_err": max_rel(logits, ref_prefill[-1])}
    if mtp:
        nxt = int(logits.argmax())
        _, draft_logits = d.runner.draft_with_logits([d.h], torch.tensor([nxt]), 1)
        row["mtp_err"] = max_rel(draft_logits[0, 0], oracle.mtp_draft_logits(prompt + [nxt])[0, -1])
    out, step = [int(logits.argmax())], 0
    while len(out) < GREEDY_TOKENS:
        step += 1
        draft = ref_stream[len(out)] if step % 4 else (ref_stream[len(out)] + 1) % 450
        lg = d.verify([out[-1], draft])
        first = int(lg[0].argmax())
        out.append(first)
        accepted = 2 if draft == first else 1
        if accepted == 2:
            out.append(int(lg[1].argmax()))
        d.runner.accept([d.h], [accepted])
        if mtp:
            # keep the MTP bookkeeping exercised (drafts are not used: the stream supplies them)
            d.runner.draft([d.h], torch.tensor([out[-1]]), 1)
    match = next((i for i, (a, b) in enumerate(zip(out, ref_stream)) if a != b), GREEDY_TOKENS)
    row["greedy_match"] = match
    row["seconds"] = time.perf_counter() - t0
    limit = FP32_MAX_REL if dtype == "float32" else BF16_MAX_REL
    row["ok"] = row["prefill_err"] < limit and row.get("mtp_err", 0.0) < limit
    if dtype == "float32":
        row["ok"] = row["ok"] and match >= GREEDY_TOKENS
    return row


def check_real_width(mode: str, model_dir: str, device: str = "cuda") -> dict:
    """Random weights at Qwen3-Next TP1 width: prefill 2 x 700 tokens, chunked prefill, decode and W=4 verify."""
    ForwardBatch, ModelRunner, RunnerConfig, _, _ = _imports()
    cfg = RunnerConfig(
        model_dir=model_dir,
        device=device,
        data_type="bfloat16",
        ssm_state_mode=mode,
        mtp_step=3,
        replay_capacity=8,
        max_running_requests=8,
        max_total_token_num=8192,
        max_req_total_len=2048,
    )
    runner = ModelRunner(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 4000, (700,), generator=gen).tolist() for _ in range(2)]
    a, b, c = (runner.add_request() for _ in range(3))

    def timed(fn):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - t) * 1e3

    full, _ = timed(lambda: runner.forward(ForwardBatch([a, b], [700, 700], [0, 0], 2, torch.tensor(ids[0] + ids[1]))))
    runner.forward(ForwardBatch([c], [350], [0], 1, torch.tensor(ids[0][:350]), [False]))
    chunked, prefill_ms = timed(lambda: runner.forward(ForwardBatch([c], [350], [350], 1, torch.tensor(ids[0][350:]))))
    row = {"mode": mode, "chunked_vs_full": max_rel(chunked.logits[0], full.logits[0]), "prefill_ms": prefill_ms}
    nxt = full.logits.argmax(-1).tolist() + [int(chunked.logits[0].argmax())]
    drafts = runner.draft([a, b, c], torch.tensor(nxt), 3)
    window = torch.cat([torch.tensor(nxt)[:, None], drafts.cpu()], dim=1)
    verify = ForwardBatch([a, b, c], [4] * 3, [700] * 3, 0, window.flatten())
    out, row["verify_ms"] = timed(lambda: runner.forward(verify))
    accepted = [1, 2, 4]
    runner.accept([a, b, c], accepted)
    bonus = torch.stack([out.logits[4 * i + n - 1].argmax() for i, n in enumerate(accepted)]).cpu()
    decode = ForwardBatch([a, b, c], [1] * 3, [700 + n for n in accepted], 0, bonus)
    dec, row["decode_ms"] = timed(lambda: runner.forward(decode))
    runner.accept([a, b, c], [1, 1, 1])
    row["finite"] = bool(torch.isfinite(out.logits).all() and torch.isfinite(dec.logits).all())
    row["ok"] = row["finite"] and row["chunked_vs_full"] < BF16_MAX_REL
    return row


def real_width_checkpoint(root: str | None, arch: str = "qwen3_next", **sizes) -> str:
    """The random-weight bf16 checkpoint of `arch` at REAL_WIDTH (fields overridden by `sizes`), cached under `root`
    (None: tiny_model_dir's default cache)."""
    _, _, _, tiny_model_dir, _ = _imports()
    return str(tiny_model_dir(arch, seed=0, dtype="bfloat16", cache_dir=root, **{**REAL_WIDTH, **sizes}))


def print_table(rows: list[dict]) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    fmt = lambda v: f"{v:.2e}" if isinstance(v, float) and v < 1 else (f"{v:.1f}" if isinstance(v, float) else str(v))
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


_cache: dict = {}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32_dots():
    """Exact fp32 dots in Triton kernels for the fp32 parity rows (read when a kernel compiles)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_F32_DEFAULT", "ieee")
        yield


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_parity_on_gpu(arch, mode, dtype):
    row = check_tiny(arch, mode, dtype, _cache)
    assert row["ok"], row


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_real_width_forward_on_gpu(mode, tmp_path_factory):
    row = check_real_width(mode, real_width_checkpoint(str(tmp_path_factory.getbasetemp())))
    assert row["ok"], row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-real-width", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    # "cpu" only dry-runs the script's logic (slow; the real check is on CUDA)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    rows = []
    for dtype in [] if args.skip_tiny else args.dtypes.split(","):
        for arch in args.archs.split(","):
            for mode in args.modes.split(","):
                try:
                    rows.append(check_tiny(arch, mode, dtype, _cache, args.device))
                except Exception as exc:  # report and continue: one broken path must not hide the others
                    rows.append({"arch": arch, "mode": mode, "dtype": dtype, "ok": False, "error": repr(exc)[:120]})
                print_table(rows[-1:])
    real = []
    if not args.skip_real_width:
        with tempfile.TemporaryDirectory() as root:
            model_dir = real_width_checkpoint(root)
            for mode in args.modes.split(","):
                try:
                    real.append(check_real_width(mode, model_dir, args.device))
                except Exception as exc:
                    real.append({"mode": mode, "ok": False, "error": repr(exc)[:160]})
                print_table(real[-1:])
    print("\n== tiny parity (runner on CUDA vs transformers fp32 on CPU) ==")
    print_table(rows)
    if real:
        print("\n== real width (Qwen3-Next layout, 4 layers, bf16, random weights) ==")
        print_table(real)
    failed = [r for r in rows + real if not r["ok"]]
    print(f"\n{len(rows) + len(real) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    # exact fp32 dots in Triton kernels (fla and ours) for the fp32 parity rows; set before any kernel compiles
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    raise SystemExit(main())
