"""`test/gpu/memcheck_kernels.py` (the compute-sanitizer check of every Triton kernel) on the CPU: its case list covers
every launched kernel of the project at the served shapes, its case code runs under Triton's interpreter with the
per-launch bounds check (one case per family and state mode; the whole tiny list takes ~10 minutes interpreted),
and a kernel reading one token past `x` fails its case."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "gpu" / "memcheck_kernels.py"
# one case of every family and state mode, all on the tiny shapes; together they launch every kernel
CPU_CASES = [
    "conv_prefill/tiny-kda/N=7",
    "conv_prefill/tiny-kda/N=1 lens=23 Wmax=2 padded",
    "conv_decode/tiny-kda/N=3 W=2",
    "native/tiny-kda/N=3 W=4",
    "compact/tiny-kda/N=3",
    "replay/tiny-kda/N=3 W=1",
    "replay/tiny-kda/N=3 W=2",
    "state/tiny-kda/native N=3",
    "state/tiny-kda/compact N=3",
    "state/tiny-kda/replay N=3 W=1",
    "cursor",
    "paged_attention/tiny-attention/N=3 12+4 0+1 40+2 splits=3",
    "mla_attention/tiny-mla-latent/N=3 12+4 5+0 40+2 splits=3",
    "fused_moe/tiny-moe/T=37",
    "fused_moe/tiny-moe-grouped/T=37",
    "fp8/tiny-fp8-odd/M=37 N=200 K=136",
    "token_bitmask/tiny-bitmask/R=5 V=1000",
    "rms_norm/tiny-norm/T=37 D=100 mode=1 gate=1",
    "silu_mul/tiny-silu-mul/T=37 I=100 strided",
    "split_columns/tiny-split/T=37 sizes=72-48-3-3 strided",
    "attention_io/tiny-attention/T=37",
    "host_flag",
]


def _script():
    if "memcheck_kernels" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("memcheck_kernels", SCRIPT)
        sys.modules["memcheck_kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["memcheck_kernels"])
    return sys.modules["memcheck_kernels"]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = single_threaded_env()
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_case_list_covers_every_kernel_shape_width_and_mode():
    run = _run("--list", timeout=60)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    mk = _script()
    kernels = mk.project_kernels()
    # the kernels the project launches today; a new one must get a case (the list exits 1 without one)
    assert {
        "causal_conv_prefill_kernel",
        "causal_conv_decode_kernel",
        "serial_verify_kernel",
        "compact_commit_kernel",
        "replay_decode_kernel",
        "replay_window_kernel",
        "replay_fold_kernel",
        "replay_accept_kernel",
        "native_accept_kernel",
        "paged_attention_kernel",
        "paged_attention_combine_kernel",
        "mla_attention_kernel",
        "moe_softmax_topk_kernel",
        "moe_sigmoid_topk_kernel",
        "moe_gate_up_kernel",
        "moe_down_kernel",
        "moe_combine_kernel",
        "fp8_group_quant_kernel",
        "fp8_block_gemm_kernel",
        "apply_token_bitmask_kernel",
        "rms_norm_kernel",
        "silu_mul_kernel",
        "split_columns_kernel",
        "qk_norm_rope_kernel",
        "sigmoid_gate_kernel",
        "wait_host_flag_kernel",
    } <= set(kernels)
    cases = mk.build_cases()
    for name in kernels:
        for shape in ("qwen3-next", "qwen3.5", "kimi-linear", "tiny-gdn", "tiny-kda"):
            # the state kernels run at every served state shape; the others have shapes of their own
            if not name.startswith(
                (
                    "paged_attention",
                    "mla_attention",
                    "moe_",
                    "fp8_",
                    "apply_token_bitmask",
                    "rms_norm",
                    "silu_mul",
                    "split_columns",
                    "qk_norm_rope",
                    "sigmoid_gate",
                    "wait_host_flag",
                )
            ):
                assert any(name in c.kernels and c.shape == shape for c in cases), f"{name} has no {shape} case"
        assert re.search(rf"^  {name} .* [1-9]\d* cases$", run.stdout, re.M), f"{name} not listed with its cases"
    ids = [c.id for c in cases]
    for mode, widths in (("native", (1, 2, 4)), ("compact", (2, 4)), ("replay", (1, 2, 4))):
        for w in widths:
            assert any(i.startswith(f"{mode}/") and f"W={w} " in f"{i} " for i in ids), f"no {mode} case at W={w}"
        for n in (3, 7):
            assert any(i.startswith(f"{mode}/") and f"N={n} " in i for i in ids), f"no {mode} case of {n} rows"
        assert any(i.startswith("state/") and f"/{mode} " in i for i in ids), f"no state-class case in {mode}"
    for projection in ("inline", "precompute"):
        assert any(i.startswith("replay/") and projection in i for i in ids), projection
    # prefill rows packed so the last row ends x with a length that is no multiple of the 16-token tile
    for c in cases:
        if c.family == "conv_prefill":
            last = int(c.detail.split("lens=")[1].split()[0].split("-")[-1])
            assert last % 16, c.id
    assert sum(c.tiny for c in cases) < len(cases), "the served shapes are in the list"


def test_the_tiny_cases_run_under_the_interpreter_with_the_bounds_check():
    """One case per family / state mode on the CPU (~40 s): the case code runs and every kernel is launched."""
    run = _run("--tiny-only", "--device", "cpu", "--cases", ",".join(CPU_CASES))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "failures: 0" in run.stdout
    assert run.stdout.count("\n   ok ") == len(CPU_CASES), run.stdout
    for name in _script().project_kernels():
        row = re.search(rf"^\| {name} \| \S+ \| (\d+) \|", run.stdout, re.M)
        assert row and int(row.group(1)) > 0, f"{name} was not launched"
    assert "row folds" in run.stdout, "the replay cases fold"


@pytest.mark.skipif(torch.cuda.is_available(), reason="in-process interpreter run: CPU-only machines")
def test_a_kernel_reading_past_x_fails_its_case(monkeypatch, capsys):
    """The prefill conv given one token more than x holds (the start-up crash's read past x): its case fails."""
    from lightllm.linear_att import ops

    real = ops.causal_conv_prefill

    def one_token_too_many(x, conv, offset, slots, cu_seqlens, *args, **kwargs):
        cu = cu_seqlens.clone()
        cu[-1] += 1
        return real(x, conv, offset, slots, cu, *args, **kwargs)

    monkeypatch.setattr(ops, "causal_conv_prefill", one_token_too_many)
    rc = _script().main(["--tiny-only", "--device", "cpu", "--cases", "conv_prefill/tiny-kda/N=3 lens=17"])
    out = capsys.readouterr()
    assert rc == 1
    assert "outside every tensor argument" in out.out and "failures: 1" in out.out
    assert re.search(r"^\| conv_prefill/tiny-kda/N=3 .*\| causal_conv_prefill_kernel x1 \| .* \| ERROR ", out.out, re.M)
