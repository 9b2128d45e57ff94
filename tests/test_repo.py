"""Checks of the repository itself: generated code, lint, and the README's commands."""

from __future__ import annotations

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
    """kernels/ imports nothing of engine/ or registry/; registry/ imports nothing of engine/; the adapter
    format (loraformat/) imports neither service nor the shell."""
    forbidden = {
        "kernels": ("engine", "registry"),
        "registry": ("engine",),
        "loraformat": ("engine", "registry", "loramux", "kernels"),
    }
    for package, banned in forbidden.items():
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                for name in banned:
                    assert not stripped.startswith((f"import {name}", f"from {name}")), f"{path}: {stripped}"
