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
SCRIPTS = ("h200_stages.sh", "h200_parallel.sh", "install_wheels.sh", "python_env.sh")
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
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    run = subprocess.run(
        ["bash", "test/gpu/h200_stages.sh", "benchmark"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and "h200_stages.sh kernels" in run.stdout


def test_memcheck_stage_runs_the_script_under_compute_sanitizer_without_the_caching_allocator(tmp_path):
    """A stand-in compute-sanitizer records how it is called and runs the rest; a stand-in script fails."""
    repo, env = _scratch_repo(tmp_path, gpus=1)
    (repo / "test" / "gpu" / "memcheck_kernels.py").write_text(
        "import sys\nprint('cases', sys.argv[1:])\nsys.exit(1)\n"
    )
    sanitizer = tmp_path / "bin" / "compute-sanitizer"
    sanitizer.write_text(
        '#!/bin/sh\necho "sanitizer $PYTORCH_NO_CUDA_MEMORY_CACHING $1 $2 $3 $4"\nshift 4\nexec "$@"\n'
    )
    sanitizer.chmod(0o755)
    run = subprocess.run(
        ["bash", "test/gpu/h200_stages.sh", "memcheck", "60", "--cases", "conv"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "sanitizer 1 --tool memcheck --error-exitcode 1" in run.stdout, run.stdout + run.stderr
    assert "cases ['--cases', 'conv']" in run.stdout and "memcheck exit status 1" in run.stdout
    assert "cases ['--cases', 'conv']" in (tmp_path / "out" / "memcheck.log").read_text()


def test_startup_stage_returns_its_table_and_every_server_log(tmp_path):
    repo, env = _scratch_repo(tmp_path, gpus=1)
    (repo / "test" / "gpu" / "startup_check.py").write_text(
        "import os, sys\n"
        "log_dir = sys.argv[sys.argv.index('--log_dir') + 1]\n"
        "open(os.path.join(log_dir, 'start00-native-64.log'), 'w').write('server log')\n"
        "print('| 0 | native | 64 | 1.0 | 3+8 | 0.5 | ok |', sys.argv[1:])\n"
    )
    run = subprocess.run(
        ["bash", "test/gpu/h200_stages.sh", "startup", "60", "--starts", "2"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "| 0 | native | 64 |" in run.stdout and "'--starts', '2'" in run.stdout, run.stdout + run.stderr
    assert "startup exit status 0" in run.stdout
    with tarfile.open(tmp_path / "out" / "startup_logs.tgz") as logs:
        assert logs.extractfile("./start00-native-64.log").read() == b"server log"
    assert "| 0 | native | 64 |" in (tmp_path / "out" / "startup.log").read_text()
