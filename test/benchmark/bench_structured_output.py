"""Cost of structured output on decode throughput: the same batch decoded free and under a JSON-schema grammar,
side by side in one run (one engine each, same prompts, same lengths).

    python test/benchmark/bench_structured_output.py [--batch 64] [--mtp_step 0|2] [--mode native|compact|replay]

On CUDA it uses the serving benchmark's checkpoint (bench_throughput.serving_model_dir: Qwen3.5 layout, 32k vocab);
without CUDA it exits unless `--device cpu` is given (then the tiny demo model, a smoke run only). The grammar is an
array of at least 100000 one-digit integers, so no request finishes before `--output_len` and both runs emit the
same number of tokens. Prints decode tokens/s for both and their ratio (the target: constrained >= 0.9 x free).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.http.structured import json_schema_grammar
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.server.tokenizer import Tokenizer

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 100000}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input_len", type=int, default=256)
    p.add_argument("--output_len", type=int, default=256)
    p.add_argument("--mode", default="native", choices=("native", "compact", "replay"))
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model_dir", default=None)
    return p.parse_args(argv)


def _run(engine, tok, model_dir: str, opts, grammar: str | None, tag: str) -> dict:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=opts.output_len, ignore_eos=grammar is None, grammar=grammar)
    for i in range(opts.batch):
        prompt = rng.integers(10, min(1000, engine.runner.vocab_size - 10), size=opts.input_len).tolist()
        msg = NewRequest(f"{tag}-{i}", prompt, params, list(tok.eos_token_ids), tokenizer_dir=model_dir)
        refused = engine.add_request(msg)
        assert refused == [], refused
    step_ms, num_tokens = [], 0
    while engine.has_work():
        decode_only = not any(r.is_prefilling for r in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        outputs = engine.step()
        if decode_only:
            step_ms.append((time.perf_counter() - t0) * 1000)
        for out in outputs:
            if isinstance(out, TokenChunk):
                num_tokens += len(out.token_ids)
            elif isinstance(out, Finished) and out.reason != "length":
                raise RuntimeError(f"{out.req_id} ended with {out.reason}: {out.error}")
    step = statistics.median(step_ms[4:] or step_ms)
    return {"tokens": num_tokens, "decode_step_ms": step, "decode_tok_per_s": opts.batch * 1000 / step}


def main(argv=None) -> int:
    opts = _parse(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (pass --device cpu for a smoke run on the tiny demo model)")
        return 0
    model_dir = opts.model_dir
    if model_dir is None and opts.device == "cuda":
        from lightllm.tools.bench_throughput import serving_model_dir

        model_dir = serving_model_dir()
    flags = dict(device=opts.device, ssm_state_mode=opts.mode, mtp_step=opts.mtp_step)
    flags.update(max_running_requests=opts.batch, max_req_total_len=opts.input_len + opts.output_len + 8)
    args, info = load_server_args([], model_dir=model_dir, **flags)
    tok = Tokenizer(info)
    grammar = json_schema_grammar(SCHEMA)
    rows = {}
    for name, g in (("free", None), ("json_schema", grammar), ("free again", None)):
        engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY)
        # warm-up at the same shapes (first prefill compiles and autotunes kernels; the first grammar builds the
        # vocabulary)
        _run(engine, tok, info.model_dir, argparse.Namespace(**{**vars(opts), "output_len": 8}), g, "warm")
        rows[name] = _run(engine, tok, info.model_dir, opts, g, name)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"batch {opts.batch}, mode {opts.mode}, mtp_step {opts.mtp_step}, {opts.device}, model {info.model_dir}")
    print(f"{'run':<12} {'decode step ms':>15} {'decode tok/s':>13}")
    for name, r in rows.items():
        print(f"{name:<12} {r['decode_step_ms']:>15.2f} {r['decode_tok_per_s']:>13.1f}")
    free = statistics.mean([rows["free"]["decode_tok_per_s"], rows["free again"]["decode_tok_per_s"]])
    print(f"constrained / free = {rows['json_schema']['decode_tok_per_s'] / free:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
