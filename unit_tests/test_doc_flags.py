"""The commands and flags the user-facing pages (README.md and docs/*.md but the benchmark log) show exist as written.

- Every command `python -m lightllm.<module> ...` or `python test/<script>.py ...` runs a program that exists, uses
  only flags of its parser, and gives a flag with choices one of them (`a|b` for alternatives).
- docs/server_args.md has one table row per server flag and no other.
- Every other flag a page names is the server's, one of a program the page runs or names, or one of another program
  named on purpose (`FOREIGN_FLAGS`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest

from lightllm.server.args import build_parser

ROOT = Path(__file__).resolve().parents[1]
SERVER = "lightllm.server.api_server"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
# flags of other programs that the pages name on purpose
FOREIGN_FLAGS = {
    "--api-key": "vLLM's spelling, named for comparison",
    "--index-url": "pip's, for torch's CPU build",
    "--extra-index-url": "pip's, for torch's CPU build",
    "--tool": "compute-sanitizer's",
    "--error-exitcode": "compute-sanitizer's",
    "--ipc": "docker's, for CUDA IPC between containers",
}

# a module of the package or the tests, or a script under test/
PROGRAM = r"(?:lightllm|unit_tests)(?:\.\w+)+|test/[\w/]+\.py"
# a command (its words may wrap) runs to the end of its line (continuations joined), its code span, a comment or `&`
COMMAND = re.compile(rf"python\s+(?:-m\s+)?({PROGRAM})([^`&#\n]*)")
# a program named in a code span without being run (its flags may then be named in the prose)
NAMED = re.compile(rf"`({PROGRAM})`")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
FLAG_VALUE = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)(?:[ =]([^\s\[\]-][^\s\[\]]*))?")
ROW = re.compile(r"^\| `(--\w+)` \|", re.MULTILINE)


def source(program: str) -> Path:
    return ROOT / program if program.endswith(".py") else ROOT / (program.replace(".", "/") + ".py")


def has_parser(program: str) -> bool:
    """Whether `program` is a file whose `main(argv)` parses its flags (the form every CLI here takes)."""
    path = source(program)
    return path.is_file() and "def main(argv" in path.read_text(encoding="utf-8")


class _Parsed(BaseException):
    """Raised in place of parsing, carrying the parser (a BaseException, so no `except Exception` swallows it)."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def _load(program: str):
    if not program.endswith(".py"):
        return importlib.import_module(program)
    spec = importlib.util.spec_from_file_location(Path(program).stem, source(program))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def options(program: str) -> dict[str, tuple[str, ...] | None]:
    """Option string -> its choices as text (None: any value) of the parser `program` builds: the server's
    `build_parser`, or the parser a program's `main(argv)` builds (taken where it would parse, before it runs)."""
    if program == SERVER:
        parser = build_parser()
    else:

        def stop(parser, *args, **kwargs):
            raise _Parsed(parser)

        # a script may put its folder on sys.path for its siblings: only while it loads
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
            mock.patch.object(sys, "path", [*sys.path]),
        ):
            try:
                _load(program).main([])
            except _Parsed as parsed:
                parser = parsed.parser
            else:
                raise AssertionError(f"{program}: main([]) parsed no arguments")
    return {
        flag: None if action.choices is None else tuple(map(str, action.choices))
        for action in parser._actions
        for flag in action.option_strings
    }


def commands(text: str) -> list[tuple[str, str]]:
    """(program, the rest of the command) of every command in `text` that runs a program of the repository."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [(m.group(1), m.group(2)) for m in COMMAND.finditer(joined)]


def command_problems(text: str) -> list[str]:
    """Programs the commands of `text` run that do not exist, flags their parsers lack, values outside a flag's
    choices."""
    problems = []
    for program, rest in commands(text):
        if not source(program).is_file():
            problems.append(f"no program {program}")
            continue
        for flag, value in FLAG_VALUE.findall(rest):
            known = options(program)
            if flag not in known:
                problems.append(f"{program}: no flag {flag}")
            elif known[flag] is not None and value and not value.startswith("$"):
                bad = [v for v in value.split("|") if v not in known[flag]]
                if bad:
                    problems.append(f"{program} {flag}: {', '.join(bad)} not one of {', '.join(known[flag])}")
    return problems


def table_problems(doc: str) -> list[str]:
    """Server flags without a row of `doc`, rows naming no server flag, and flags with several rows."""
    rows = ROW.findall(doc)
    flags = {f for f in options(SERVER) if f not in ("-h", "--help")}
    return (
        [f"no row for {f}" for f in sorted(flags - set(rows))]
        + [f"a row for {f}, which the server lacks" for f in sorted(set(rows) - flags)]
        + [f"{n} rows for {f}" for f, n in sorted(Counter(rows).items()) if n > 1]
    )


def prose_problems(text: str) -> list[str]:
    """Flags named in `text` that are neither the server's, nor of a program it runs or names, nor foreign."""
    programs = {program for program, _ in commands(text)} | set(NAMED.findall(text))
    known = set(FOREIGN_FLAGS) | set(options(SERVER))
    for program in sorted(programs):
        if has_parser(program):
            known |= set(options(program))
    return sorted({f"no flag {flag}" for flag in FLAG.findall(text) if flag not in known})


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_run_existing_programs_with_their_flags(page):
    assert command_problems(page.read_text(encoding="utf-8")) == []


def test_server_args_has_one_row_per_server_flag():
    assert table_problems(_read("docs/server_args.md")) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_prose_names_existing_flags(page):
    assert prose_problems(page.read_text(encoding="utf-8")) == []


def test_twin_a_wrong_program_flag_or_value_in_a_command_is_reported():
    readme = _read("README.md")
    assert "--batch_sizes 1,64,256" in readme
    misspelt = readme.replace("--batch_sizes 1,64,256", "--batch_size 1,64,256")
    assert command_problems(misspelt) == ["lightllm.tools.bench_throughput: no flag --batch_size"]
    pd = _read("docs/pd.md").replace("--run_mode decode  ", "--run_mode decoder ")
    assert command_problems(pd) == [f"{SERVER} --run_mode: decoder not one of normal, prefill, decode, pd_master"]
    moe = _read("docs/moe.md")
    assert "--cases fused_moe" in moe and "[--grid full|quick|prefill]" in moe
    assert command_problems(moe.replace("--cases fused_moe", "--case fused_moe").replace("|quick|", "|slow|")) == [
        "lightllm.tools.tune_fused_moe --grid: slow not one of full, quick, prefill",
        "test/gpu/memcheck_kernels.py: no flag --case",
    ]
    assert command_problems("    python -m lightllm.tools.bench_throughputs --modes replay\n") == [
        "no program lightllm.tools.bench_throughputs"
    ]


def test_twin_a_missing_extra_or_repeated_row_is_reported():
    doc = _read("docs/server_args.md")
    row = next(line for line in doc.splitlines() if line.startswith("| `--max_queue_len` |"))
    assert table_problems(doc.replace(row + "\n", "")) == ["no row for --max_queue_len"]
    made_up = "| `--max_queue_length` | `1024` | A made-up flag. |"
    assert table_problems(doc.replace(row, f"{row}\n{made_up}\n{row}")) == [
        "a row for --max_queue_length, which the server lacks",
        "2 rows for --max_queue_len",
    ]


def test_twin_a_made_up_flag_in_prose_is_reported():
    readme = _read("README.md").replace("`--ssm_state_mode`", "`--ssm_mode`", 1)
    assert prose_problems(readme) == ["no flag --ssm_mode"]
    # a program's flag counts on a page that runs or names that program, not on another
    assert prose_problems("`--serving_model`") == ["no flag --serving_model"]
    assert prose_problems("`lightllm.tools.bench_throughput` with `--serving_model`") == []
    assert prose_problems("`test/gpu/pd_bench.py`: `--tiny` dry-runs it") == []
