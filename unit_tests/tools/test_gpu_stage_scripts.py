"""`test/gpu/h200_parallel.sh` and `h200_stages.sh` (the drivers of every GPU run) on the CPU, in a scratch copy
of the scripts with a stand-in `nvidia-smi` and a probe test as the stage's suite: each list of stages runs on its
own GPU, in order, and the logs and the shared Triton cache come back as one set of files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("h200_stages.sh", "h200_parallel.sh", "install_wheels.sh")
PROBE = """import os


def test_probe():
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"] + "\\n")
"""


def _scratch_repo(tmp_path: Path, gpus: int) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    (repo / "test" / "gpu").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(ROOT / "test" / "gpu" / name, repo / "test" / "gpu" / name)
    (repo / "test" / "gpu" / "test_probe.py").write_text(PROBE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: stand-in"\n' for i in range(gpus)))
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SKIP_CACHE_SAVE")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", OUT=str(tmp_path / "out"), PROBE_OUT=str(tmp_path / "probe"))
    return repo, env


def test_stage_lists_run_on_their_own_gpus_and_return_one_set_of_files(tmp_path):
    repo, env = _scratch_repo(tmp_path, gpus=2)
    probe = "kernels 60 test/gpu/test_probe.py"
    run = subprocess.run(
        ["bash", "test/gpu/h200_parallel.sh", f"{probe}; {probe}", probe],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # two stages on GPU 0, one on GPU 1; each stage's output is prefixed with its GPU
    assert sorted((tmp_path / "probe").read_text().split()) == ["0", "0", "1"]
    assert "[gpu0 kernels] 1 passed" in run.stdout and "[gpu1 kernels] 1 passed" in run.stdout
    out = tmp_path / "out"
    with tarfile.open(out / "logs.tgz") as logs:
        names = {Path(n).as_posix().lstrip("./") for n in logs.getnames()}
        assert {"gpu0-0-kernels/kernels.log", "gpu0-1-kernels/kernels.log", "gpu1-0-kernels/kernels.log"} <= names
        log = logs.extractfile("./gpu1-0-kernels/kernels.log").read().decode()
    assert "1 passed" in log
    # one copy of the shared cache, saved once by the driver (the stages skip their own saves)
    assert [p.name for p in out.glob("triton.tgz*")] == ["triton.tgz.part-00"]
    assert not list(out.glob("gpu*")), "stage folders stay in the driver's scratch space"


def test_more_stage_lists_than_gpus_is_refused(tmp_path):
    repo, env = _scratch_repo(tmp_path, gpus=1)
    probe = "kernels 60 test/gpu/test_probe.py"
    run = subprocess.run(
        ["bash", "test/gpu/h200_parallel.sh", probe, probe], cwd=repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and "2 stage lists for 1 GPUs" in run.stdout
    assert not (tmp_path / "probe").exists(), "nothing ran"


def test_unknown_stage_prints_the_usage(tmp_path):
    repo, env = _scratch_repo(tmp_path, gpus=1)
    run = subprocess.run(["bash", "test/gpu/h200_stages.sh", "benchmark"], cwd=repo, env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 2 and "h200_stages.sh kernels" in run.stdout
