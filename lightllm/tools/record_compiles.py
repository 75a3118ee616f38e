"""Record the Triton kernels a server start-up compiles into the compile list of this GPU kind, so that a fresh
machine compiles them in worker processes while the engine loads weights (`lightllm.kernels.compile_ahead`).

    python -m lightllm.tools.record_compiles --serving_model [--modes replay,native,compact] [SERVER FLAGS ...]
    python -m lightllm.tools.record_compiles --model_dir DIR --load_format dummy --tp 1 ...

Builds the engine the server would build from SERVER FLAGS (start-up warm-up, graph capture and the grammar warm-up
included) once per state mode in `--modes` (each in a process of its own), with Triton's post-compile hook recording
every kernel variant, and adds each mode's variants to the group of the model's key in the list (default
`lightllm/kernels/compile_ahead/lists/<device name>.json`; `--replace` drops the group's earlier entries first). A
warm Triton cache records the same variants as an empty one. The key ignores depth and vocabulary, so a shallow
random-weight copy of a model records its full-size group (`lightllm.tools.dummy_model_dir`). Run it on the GPU kind
the list is for and commit the list.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from lightllm.kernels.compile_ahead.lists import LIST_DIR, list_path, merge_entries
from lightllm.kernels.compile_ahead.record import CompileRecorder
from lightllm.kernels.tuned_tables import device_name


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.record_compiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--serving_model", action="store_true", help="the serving benchmark's random-weight checkpoint")
    p.add_argument("--modes", default="replay", help="comma-separated state modes, one engine each")
    p.add_argument("--list_dir", default=str(LIST_DIR), help="folder of the lists (one file per device name)")
    p.add_argument("--replace", action="store_true", help="drop the group's earlier entries")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> Path:
    a, server_flags = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("record_compiles records the compiles of the GPU it runs on: no CUDA device")
    path = list_path(device_name(torch.device("cuda")), Path(a.list_dir))
    modes = a.modes.split(",")
    if len(modes) > 1:
        # one process per mode: an engine's device memory and the kernels already in memory go with its process,
        # so each mode's engine sizes its caches on an empty device and its hook sees every compile
        for k, mode in enumerate(modes):
            flags = ["--modes", mode, "--list_dir", a.list_dir, *server_flags]
            flags += ["--serving_model"] * a.serving_model + ["--replace"] * (a.replace and k == 0)
            subprocess.run([sys.executable, "-m", "lightllm.tools.record_compiles", *flags], check=True)
        return path
    from lightllm.models.registry import load_model_config
    from lightllm.server.args import load_server_args
    from lightllm.server.engine_process import build_engine
    from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY, runner_config
    from lightllm.worker.compile_ahead import runner_group_key

    overrides = {}
    if a.serving_model:
        from lightllm.tools.bench_throughput import serving_model_dir

        overrides["model_dir"] = serving_model_dir()
    args, info = load_server_args(server_flags, ssm_state_mode=modes[0], **overrides)
    config = runner_config(args)
    key = runner_group_key(config, load_model_config(config.model_dir))
    with CompileRecorder() as recorder:
        build_engine(args, info, DEFAULT_RUNNER_FACTORY)
    for kernel, count in sorted(recorder.refused.items()):
        print(f"  not recordable: {kernel} ({count} variants)", flush=True)
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    total = merge_entries(path, key, recorder.entries, a.replace, [target.backend, target.arch, target.warp_size])
    print(
        f"{modes[0]}: {len(recorder.entries)} kernel variants compiled at start-up; {path.name}: group {key} has "
        f"{total} entries",
        flush=True,
    )
    return path


if __name__ == "__main__":
    main()
