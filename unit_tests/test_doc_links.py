"""The user-facing pages (README.md and docs/*.md) point at things that exist: every relative link reaches a file
and, with `#anchor`, a heading of it; every repository path a page names in a code span exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)
# a path under one of the repository's top folders; `<name>` placeholders and globs are not paths
PATH = re.compile(r"`((?:lightllm|unit_tests|test|docs|constraints|\.ci)/[\w./-]*)`")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def link_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """Relative links of `text` (the text of `page`) to missing files or headings, and named paths that are
    missing under `root`."""
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file")
        elif fragment and file.suffix == ".md":
            body = text if file == page else file.read_text(encoding="utf-8")
            if fragment not in {anchor(h) for h in HEADING.findall(body)}:
                problems.append(f"{target}: no heading")
    problems += [f"`{p}`: no such path" for p in PATH.findall(text) if not (root / p.rstrip("/")).exists()]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_resolve(page):
    assert link_problems(page, page.read_text(encoding="utf-8")) == []


def test_twin_a_broken_link_anchor_or_path_is_reported():
    page = ROOT / "docs" / "pd.md"
    text = page.read_text(encoding="utf-8")
    for good in (
        "(security.md#deploying-pd-across-hosts)",
        "(tensor_parallel.md)",
        "`lightllm/server/pd/transport.py`",
    ):
        assert good in text
    broken = (
        text.replace("(security.md#deploying-pd-across-hosts)", "(security.md#deploying-pd)")
        .replace("(tensor_parallel.md)", "(server_flags.md)")
        .replace("`lightllm/server/pd/transport.py`", "`lightllm/server/pd/transports.py`")
    )
    assert sorted(link_problems(page, broken)) == [
        "`lightllm/server/pd/transports.py`: no such path",
        "security.md#deploying-pd: no heading",
        "server_flags.md: no file",
    ]


def test_anchor_follows_github():
    assert anchor("Prefill/decode nodes with `--dp`") == "prefilldecode-nodes-with---dp"
    assert anchor("Per replica: `/dp/replicas` and metrics") == "per-replica-dpreplicas-and-metrics"
