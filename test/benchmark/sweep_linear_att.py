"""Small hand-picked launch-config sweep of the decode / verify kernels; writes tuned tables.

    python test/benchmark/sweep_linear_att.py --out-dir lightllm/linear_att   # writes gdn/tuned, kda/tuned
    python test/benchmark/sweep_linear_att.py --families replay --cells 1x256 --out-dir lightllm/linear_att
    python test/benchmark/sweep_linear_att.py --state-dtype bf16 --out-dir lightllm/linear_att   # bf16-state entries
    python test/benchmark/sweep_linear_att.py --families serial,compact --cells 2x256,4x256 --out-dir lightllm/linear_att

Entries of an existing table that a sweep does not retime are kept.

The autotuner (`bench_linear_att.py --tune`) searches the full candidate grid; this sweep times a few configs
around the known-good ones with the benchmark's own method (CUDA graph over pools rotated beyond L2, amortised
over fold cycles), picks the fastest per kernel family and shape, and saves one JSON table per algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import bench_linear_att as bench  # noqa: E402

from lightllm.linear_att import autotune  # noqa: E402
from lightllm.linear_att.autotune import KernelConfig  # noqa: E402


def parse_configs(text: str) -> list[KernelConfig]:
    """ "64x2,32x4x2" -> BV x num_warps [x num_stages] launch configs (one stage unless given)."""
    configs = []
    for c in text.split(","):
        parts = [int(x) for x in c.split("x")]
        if len(parts) not in (2, 3):
            raise ValueError(f"launch config {c!r} is not BVxWARPS or BVxWARPSxSTAGES")
        configs.append(KernelConfig(*parts, *([1] if len(parts) == 2 else [])))
    return configs


# 128 x 4 warps: the same 128 tile elements per thread as 64 x 2, one program per head instead of two (fewer static
# instructions per head, but slower in every H200 sweep: fewer resident blocks)
# (64 x 2 with two stages: the token loop's loads software-pipelined, each token's loads issued a token ahead)
SERIAL = parse_configs("64x2,32x4,32x2,64x4,128x4,64x2x2")
# compact does W + pending token updates per program and one state write: wider tiles share each token's loads,
# norms and gates across more of V; one warp on a [128, 32] tile keeps each reduction over K inside a warp
COMPACT = parse_configs("64x2,64x4,32x2,32x4,128x4,128x8,64x2x2,32x1,32x1x2")
REPLAY = parse_configs("32x4,64x8,64x2,32x2,64x4,128x8,128x4")


def sweep_cell(
    shape, W, N, family, configs, replay_capacity, device, timer, log, projection="inline", state=torch.float32
):
    """Time each config of one family (and replay projection) at one (shape, W, N) and state dtype; returns
    {config: µs}."""
    act = torch.bfloat16
    inp = bench.make_inputs(shape, N, W, act, device)
    key_args = (device, state, act, shape.H, shape.HV, shape.K, shape.V, shape.GK, W)
    if family in ("serial", "compact"):
        key = autotune.make_key(family, *key_args)
        make_steps = bench.native_steps if family == "serial" else bench.compact_steps
        build = lambda cfg: make_steps(shape, inp, N, W, state, device, config=cfg)  # noqa: E731
    else:
        key = autotune.make_key("replay", *key_args, replay_capacity, projection)
        build = lambda cfg: bench.replay_steps(  # noqa: E731
            shape, inp, N, W, replay_capacity, state, projection, device, config=cfg
        )
    out = {}
    for cfg in configs:
        try:
            steps = build(cfg)
            out[cfg] = timer(steps)
        except Exception as err:
            log(f"  {shape.name} {family} W={W} N={N} {cfg}: {type(err).__name__}: {str(err)[:160]}")
        finally:
            steps = None
            torch.cuda.empty_cache()
        if cfg in out:
            tag = f"{family} ({projection})" if family == "replay" and W > 1 else family
            tile = f"bv={cfg.block_v} nw={cfg.num_warps} ns={cfg.num_stages}"
            log(f"  {shape.name} {tag} W={W} N={N} {tile}: {out[cfg]:.1f} us")
    return key, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=None, help="package dir: writes <algo>/tuned/h200.json under it")
    p.add_argument("--replay_capacity", type=int, default=16)
    p.add_argument("--shapes", default="qwen3-next-tp1,kimi-linear-tp1")
    p.add_argument("--families", default="serial,replay", help="serial (native verify), compact, replay")
    p.add_argument("--cells", default="1x256,4x128", help="WxN pairs to time, e.g. 1x256,4x128")
    p.add_argument(
        "--state-dtype", default="fp32", choices=sorted(bench.DTYPES), help="state dtype the entries are for"
    )
    p.add_argument(
        "--projections", default="inline,precompute", help="replay projections to time at W > 1 (inline is the default)"
    )
    p.add_argument(
        "--configs", default=None, help="BVxWARPS[xSTAGES] candidates instead of the built-in lists, e.g. 64x2,32x1x2"
    )
    args = p.parse_args(argv)
    device = torch.device("cuda")
    state = bench.DTYPES[args.state_dtype]
    timer = bench.Timer(device, reps=max(24, 2 * args.replay_capacity))
    tables = {"gdn": autotune.ConfigTable(), "kda": autotune.ConfigTable()}
    extra = {"gdn": {}, "kda": {}}
    t0 = time.time()
    for name in args.shapes.split(","):
        shape = bench.SHAPES[name]
        families = {"serial": SERIAL, "compact": COMPACT, "replay": REPLAY}
        if args.configs:
            custom = parse_configs(args.configs)
            families = {name: custom for name in families}
        for family in args.families.split(","):
            configs = families[family]
            for W, N in (tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")):
                if family == "compact" and W == 1:
                    continue  # compact mode verifies windows of 2 or more
                # plain decode has one kernel; for W > 1 "inline" (FMA reductions per token) and "precompute"
                # (tensor-core products, block solve) are different code in the window kernel, each tuned for itself
                projections = args.projections.split(",") if family == "replay" and W > 1 else ("inline",)
                for projection in projections:
                    key, res = sweep_cell(
                        shape, W, N, family, configs, args.replay_capacity, device, timer, print, projection, state
                    )
                    if not res:
                        continue
                    best = min(res, key=res.get)
                    tables[shape.algo].put(key, best)
                    extra[shape.algo][key.to_str()] = {"us": round(res[best], 2), "rows": N}
                    if family == "replay" and W == 1:  # the same kernel under either projection name
                        pkey = autotune.make_key(
                            "replay",
                            device,
                            state,
                            torch.bfloat16,
                            shape.H,
                            shape.HV,
                            shape.K,
                            shape.V,
                            shape.GK,
                            W,
                            args.replay_capacity,
                            "precompute",
                        )
                        tables[shape.algo].put(pkey, best)
        print(f"[{time.time() - t0:.0f} s] {name} done", flush=True)
        if args.out_dir:  # after every shape, so a sweep stopped early keeps what it timed
            save_tables(tables, extra, args.out_dir)
    for table in tables.values():
        for key, cfg in sorted(table.entries.items()):
            print(f"{key}: {cfg}")
    return 0


def save_tables(tables, extra, out_dir) -> None:
    """Merges the sweep's entries into `<out_dir>/<algo>/tuned/h200.json`; entries it did not retime stay."""
    for algo, table in tables.items():
        if not table.entries:
            continue
        path = os.path.join(out_dir, algo, "tuned", "h200.json")
        merged = autotune.ConfigTable()
        notes = {}
        if os.path.exists(path):
            with open(path) as f:
                for k, d in json.load(f)["entries"].items():
                    merged.entries[k] = KernelConfig.from_dict(d)
                    notes[k] = {x: d[x] for x in ("us", "rows") if x in d}
        merged.entries.update(table.entries)
        notes.update(extra[algo])
        merged.save(path, notes)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
