"""The package's dependency direction: tq_hf never imports eval/, and no module imports itself back.

Imports are read from the source (every import statement, function-local ones too), so a cycle
hidden behind a late import still shows.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tq_hf", "eval")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "results" not in p.relative_to(ROOT).parts}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` loads a, a.b, a.b.c: keep the deepest known
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search with an explicit path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_tq_hf_never_imports_eval():
    graph = _graph()
    offenders = {name: sorted(t for t in deps if t.split(".")[0] == "eval")
                 for name, deps in graph.items() if name.split(".")[0] == "tq_hf"}
    assert not {k: v for k, v in offenders.items() if v}, "tq_hf must not import eval/ (eval runs from a checkout)"


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ importing its own submodules is how packages work, not a cycle, unless a
    # submodule imports the package back
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_importing_tq_hf_loads_no_eval_module():
    code = ("import sys, pkgutil, importlib, tq_hf\n"
            "for m in pkgutil.walk_packages(tq_hf.__path__, 'tq_hf.'): importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n == 'eval' or n.startswith('eval.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_eval_is_not_installed_and_core_needs_only_torch_triton_transformers():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["tq_hf*"]
    core = {dep.split(">")[0].split("=")[0].split(";")[0].strip() for dep in project["project"]["dependencies"]}
    assert core == {"torch", "triton", "transformers"}
    assert {"eval", "dev"} <= set(project["project"]["optional-dependencies"])
