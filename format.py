"""Format and lint the tree: `python format.py` (ruff format, then ruff check --fix)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def main() -> int:
    fmt = subprocess.run([sys.executable, "-m", "ruff", "format", str(ROOT)])
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", str(ROOT)])
    return fmt.returncode or lint.returncode


if __name__ == "__main__":
    raise SystemExit(main())
