"""Checks of the repository itself: generated code, lint, and the README's commands."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_grpc_code_is_fresh():
    proc = subprocess.run([sys.executable, "tools/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ruff_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line)
    assert command in readme


def test_layout_has_no_back_edges():
    """lorakernels/ imports nothing of engine/ or registry/; registry/ imports nothing of engine/; the adapter
    format (loraformat/) imports neither service nor the shell; the engine takes the adapter format from
    loraformat/ and talks to the registry over gRPC, so it imports nothing of registry/."""
    forbidden = {
        "lorakernels": ("engine", "registry"),
        "registry": ("engine",),
        "loraformat": ("engine", "registry", "loramux", "lorakernels"),
        "engine": ("registry",),
    }
    for package, banned in forbidden.items():
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                for name in banned:
                    assert not stripped.startswith((f"import {name}", f"from {name}")), f"{path}: {stripped}"


def _first_party_imports() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere in its body (lazy imports included)."""
    files = {}
    for package in ("loramux", "loraformat", "registry", "engine", "lorakernels"):
        for path in (ROOT / package).rglob("*.py"):
            if not {"v1", "migrations"} & set(path.relative_to(ROOT).parts):
                files[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = (imported & files.keys()) - {name}
    return graph


def test_no_module_imports_itself_in_a_circle():
    """A circle (even through a lazy import) means two modules share a role: the shell and the service
    host, or the host and its metrics, once did."""
    graph = _first_party_imports()
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None
    shell_users = {m for m, deps in graph.items() if not m.startswith("loramux.shell") and any(d.startswith("loramux.shell") for d in deps)}
    assert not shell_users, f"only the shell may import the shell: {sorted(shell_users)}"
