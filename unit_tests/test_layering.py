"""The package layering: server -> worker -> engine, models -> cache -> linear_att, kernels. Every import between
packages of lightllm goes down the layers, except the two lazy upward imports the architecture names; and the
modules of the package import each other without circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lightllm"
LAYER = {"tools": 6, "server": 5, "worker": 4, "engine": 3, "models": 3, "cache": 2, "linear_att": 1, "kernels": 1}
# (importing module, imported module), lazy on purpose: the demo checkpoint the server serves or builds; the offline
# API (`from lightllm import LLM, SamplingParams`)
ALLOWED_UPWARD = {
    ("lightllm.server.demo_checkpoint", "lightllm.tools.make_tiny_model"),
    ("lightllm.server.demo_checkpoint", "lightllm.tools.demo_model"),
    ("lightllm", "lightllm.server.llm"),
    ("lightllm", "lightllm.engine.sampling_params"),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("lightllm", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from lightllm import x` names a module; `from lightllm.a import b` the module a (b may be a name)
            found += [f"{node.module}.{a.name}" for a in node.names] if node.module == "lightllm" else [node.module]
    return [m for m in found if m == "lightllm" or m.startswith("lightllm.")]


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER else None


def layering_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        src_module = _module_name(path, root)
        src = _package(src_module)
        for target in _imports(path, top_level_only=False):
            dst = _package(target)
            if dst is None or dst == src or (src_module, target) in ALLOWED_UPWARD:
                continue
            # the package's own __init__ sits above every layer
            upward = src is None or LAYER[dst] > LAYER[src] or {src, dst} == {"engine", "models"}
            if upward:
                bad.append(f"{src_module} imports {target}")
    return bad


def _module_graph() -> dict[str, set[str]]:
    """Module -> the lightllm modules it imports when it is imported (top-level statements only)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imports(path, top_level_only=True):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # a package's __init__ that re-exports its own modules is not a circle of the architecture
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_imports_run_down_the_layers():
    assert layering_violations() == []


def test_no_import_circles_between_modules():
    assert find_cycle(_module_graph()) is None


def test_an_upward_import_is_caught(tmp_path):
    """Teeth: a cache module importing the worker is reported."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "bad.py").write_text("from lightllm.worker.runner import ModelRunner\n")
    assert layering_violations(tmp_path) == ["lightllm.cache.bad imports lightllm.worker.runner"]


@pytest.mark.parametrize("edges", [{"a": {"b"}, "b": {"c"}, "c": {"a"}}])
def test_a_circle_is_found(edges):
    assert find_cycle(edges) == ["a", "b", "c", "a"]
