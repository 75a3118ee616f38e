"""Every package of lightllm has a README.md, and every Python file in it is named by a README of its folder or of
a folder above it within the package (docs/architecture.md promises the listing)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lightllm"


def unlisted_files(root: Path) -> list[str]:
    """Paths (relative to `root`) of the packages without a README.md and of the .py files no README names."""
    missing = []
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        if not (package / "README.md").is_file():
            missing.append(f"{package.relative_to(root)}/README.md")
        for path in sorted(package.rglob("*.py")):
            if path.name == "__init__.py":
                continue
            folders = [path.parent, *path.parent.parents]
            readmes = [f / "README.md" for f in folders[: folders.index(package) + 1] if (f / "README.md").is_file()]
            if not any(path.name in r.read_text() for r in readmes):
                missing.append(str(path.relative_to(root)))
    return missing


def test_every_package_file_is_listed():
    assert unlisted_files(ROOT) == []


def _tree(tmp_path: Path, readme: str) -> Path:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "README.md").write_text(readme)
    (package / "listed.py").write_text("")
    (package / "sub" / "deep.py").write_text("")
    return tmp_path


def test_a_listed_tree_passes(tmp_path):
    assert unlisted_files(_tree(tmp_path, "`listed.py`, `sub/`: `deep.py`")) == []


def test_twin_an_unnamed_file_and_a_missing_readme_are_reported(tmp_path):
    root = _tree(tmp_path, "`listed.py`")
    (root / "bare").mkdir()
    (root / "bare" / "__init__.py").write_text("")
    (root / "bare" / "mod.py").write_text("")
    assert unlisted_files(root) == ["bare/README.md", "bare/mod.py", "pkg/sub/deep.py"]
