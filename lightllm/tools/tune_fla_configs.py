"""Tune fla-core's autotuned prefill kernels once on this GPU kind and write the table the server pins them from.

    python -m lightllm.tools.tune_fla_configs --serving_model            # or --model_dir DIR [--tp 2]
        [--max_num_batched_tokens 2048] [--prefill_graph_max_tokens 1024] [--out PATH]

Runs the start-up prefill warm-up's calls (`lightllm.linear_att.warmup`: every token count that reaches a tuning
key of a step of up to `--max_num_batched_tokens` prefill tokens, the one-sequence prefills of the graph buckets)
on scratch tensors of the model's linear-attention shapes (per tensor-parallel rank) with fla autotuning as usual,
then records every key each autotuned kernel met and the config it chose (`fla_pinning.record_table`), merged into
the table of this GPU kind (default `lightllm/linear_att/fla_tuned/<device name>.json`; keys of other models in it
are kept). Run it once per model family served on the GPU kind (GDN and KDA kernels differ) and commit the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from lightllm.linear_att.fla_pinning import fla_autotuners, record_table, table_path


def merge_tables(old: dict | None, new: dict) -> dict:
    """`new`'s kernels and keys over `old`'s, its other fields (versions, capability) over `old`'s (same versions
    only; a table of other versions is replaced)."""
    if old is None or old.get("versions") != new["versions"]:
        return new
    kernels = dict(old["kernels"])
    for name, spec in new["kernels"].items():
        if name not in kernels:
            kernels[name] = spec
            continue
        by_key = {json.dumps(e["key"]): e for e in kernels[name]["by_key"]}
        by_key.update({json.dumps(e["key"]): e for e in spec["by_key"]})
        kernels[name] = {"default": kernels[name]["default"], "by_key": list(by_key.values())}
    return {**old, **new, "kernels": kernels}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.tune_fla_configs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", default=None)
    p.add_argument("--serving_model", action="store_true", help="the serving benchmark's random-weight checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size served (heads per rank)")
    p.add_argument("--max_num_batched_tokens", type=int, default=2048)
    p.add_argument("--prefill_graph_max_tokens", type=int, default=1024)
    p.add_argument("--out", default=None, help="table to write (default: the shipped table of this GPU kind)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    a = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_fla_configs tunes on the GPU it runs on: no CUDA device")
    from lightllm.linear_att.warmup import prefill_warmup_calls, run_prefill_once
    from lightllm.models.registry import load_model_config
    from lightllm.worker.config import DTYPES
    from lightllm.worker.graphs.prefill import prefill_buckets

    if a.serving_model:
        from lightllm.tools.bench_throughput import serving_model_dir

        a.model_dir = serving_model_dir()
    cfg = load_model_config(a.model_dir)
    spec = dataclasses.replace(
        cfg.linear, num_k_heads=cfg.linear.num_k_heads // a.tp, num_v_heads=cfg.linear.num_v_heads // a.tp
    )
    dtype, device = DTYPES[cfg.torch_dtype], torch.device("cuda")
    buckets = prefill_buckets(a.prefill_graph_max_tokens) if a.prefill_graph_max_tokens else []
    calls = prefill_warmup_calls(a.max_num_batched_tokens, spec.num_k_heads, buckets)
    with torch.no_grad():
        for lengths, one_sequence in calls:
            run_prefill_once(spec, lengths, dtype, device, one_sequence=one_sequence)
    torch.cuda.synchronize()
    out = Path(a.out) if a.out else table_path(torch.cuda.get_device_name(device))
    old = json.loads(out.read_text()) if out.exists() else None
    table = merge_tables(old, record_table(fla_autotuners()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(table['kernels'])} kernels, {sum(len(k['by_key']) for k in table['kernels'].values())} keys")
    return out


if __name__ == "__main__":
    main()
