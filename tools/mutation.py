"""Mutation testing of the core modules, one module at a time.

    python tools/mutation.py drain            # mutate engine/drain.py, run only the tests that cover it
    python tools/mutation.py --list           # the modules and their tests

Each mutant is one small change to the module's syntax tree (a flipped comparison or boolean operator, an
arithmetic operator swapped, a constant moved by one, `not` dropped, a statement replaced by `pass`, a
returned value replaced by None). A mutant is killed when the module's own tests fail (or hang) with it.

Why not mutmut or cosmic-ray: both start a fresh interpreter per mutant, and importing torch alone takes
seconds on a shared 2-core machine (mutmut 2.5.1 also aborted mid-run on this code with "Attribute
Mutant.line is required"). Here one process imports the heavy dependencies once and forks a child per
mutant; the child installs the mutated module under its real name and runs pytest in-process. Runs under
`nice -n 19`, in a scratch copy of the tree, never in CI. Results: docs/testing.md.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANT_TIMEOUT_S = 120
VERBOSE = bool(os.environ.get("MUTATION_VERBOSE"))  # show the tests' output (to see why a baseline fails)

# module -> (source file, the tests that cover it: pytest arguments)
MODULES: dict[str, tuple[str, list[str]]] = {
    "scheduler": ("engine/scheduler.py", ["tests/engine/test_scheduler.py", "tests/engine/test_fair_share.py"]),
    "drain": ("engine/drain.py", ["tests/engine/test_drain.py", "-k", "not flow"]),
    "adapter_slots": ("engine/adapter_slots.py", ["tests/engine/test_lora_slots.py", "tests/engine/test_drain.py",
                                                 "tests/engine/test_scheduler.py", "-k", "not flow"]),
    "lora_pool": ("engine/lora_pool.py", ["tests/engine/test_lora_slots.py", "tests/engine/test_lora_meta.py"]),
    "radix_cache": ("engine/radix_cache.py", ["tests/engine/test_radix_cache.py", "tests/engine/test_scheduler.py"]),
    "request_kv": ("engine/request_kv.py", ["tests/engine/test_scheduler.py"]),
    "text": ("engine/text.py", ["tests/engine/test_text.py"]),
    "sampling": ("engine/sampling.py", ["tests/engine/test_sampling.py"]),
    "peft_compile": ("loraformat/peft_compile.py", ["tests/loraformat/test_peft_compile.py"]),
    "catalog": ("registry/catalog.py", ["tests/registry/test_catalog.py"]),
    "tuned": ("lorakernels/tuned.py", ["tests/lorakernels/test_tuned.py"]),
}

SWAPS: dict[type, type] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    index: int  # the n-th candidate node in walk order (stable for one source)
    line: int
    what: str  # "original -> mutated", one line


def mutants(tree: ast.Module) -> Iterator[tuple[Mutant, ast.Module]]:
    """Every single-change mutant of tree, with its mutated copy."""
    for index in range(len(_candidates(tree))):
        mutated = copy.deepcopy(tree)
        node = _candidates(mutated)[index]
        before = _show(node)
        line = getattr(node, "lineno", 0)
        after = _mutate(mutated, node)
        yield Mutant(index, line, f"{before} -> {_show(after)}"), ast.fix_missing_locations(mutated)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first))
    return found


def _candidates(tree: ast.Module) -> list[ast.AST]:
    skip = _docstrings(tree)
    annotations = {id(n) for a in ast.walk(tree) for n in ast.walk(getattr(a, "annotation", None) or ast.Pass())
                   if isinstance(a, ast.arg | ast.AnnAssign)} | {
        id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.returns
        for n in ast.walk(f.returns)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in annotations:
            continue
        if (isinstance(node, ast.BinOp | ast.BoolOp) and type(node.op) in SWAPS) or (isinstance(node, ast.Compare) and type(node.ops[0]) in SWAPS) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)) or (isinstance(node, ast.Constant) and type(node.value) in (int, bool)) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")) or (isinstance(node, ast.Return) and node.value is not None and not _is_none(node.value)) or (isinstance(node, ast.Expr | ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Raise) and _in_function(tree, node)):
            found.append(node)
    return found


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _in_function(tree: ast.Module, target: ast.AST) -> bool:
    """Statements inside functions only: deleting a module or class attribute is an import error, not a test."""
    return any(target in ast.walk(f) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef))


def _mutate(tree: ast.Module, node: ast.AST) -> ast.AST:
    """Applies the one change of node's kind; returns what now stands where node stood."""
    if isinstance(node, ast.BinOp | ast.BoolOp):
        node.op = SWAPS[type(node.op)]()
    elif isinstance(node, ast.Compare):
        node.ops[0] = SWAPS[type(node.ops[0])]()
    elif isinstance(node, ast.UnaryOp):
        _replace(tree, node, node.operand)
        return node.operand
    elif isinstance(node, ast.Constant):
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    elif isinstance(node, ast.Call):
        node.func.id = "max" if node.func.id == "min" else "min"
    elif isinstance(node, ast.Return):
        node.value = ast.Constant(None)
    else:
        _replace(tree, node, ast.Pass())
        return ast.Pass()
    return node


def _replace(tree: ast.Module, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[id(v) for v in value].index(id(old))] = new
                return
    raise AssertionError("node not found")


def _show(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, ast.Pass) else "pass"
    return text if len(text) <= 90 else text[:87] + "..."


def run_mutant(tree: ast.Module, source: Path, tests: list[str]) -> bool:
    """True when the tests fail (or hang) with the mutated module: the mutant is killed."""
    pid = os.fork()
    if pid == 0:  # child: the mutated module on disk (pytest imports it), then the tests in-process
        os.nice(19)
        source.write_text(ast.unparse(tree))
        import pytest

        if not VERBOSE:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
        os._exit(int(code))
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.alarm(MUTANT_TIMEOUT_S)
    _, status = os.waitpid(pid, 0)
    signal.alarm(0)
    return not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)


def run_module(name: str, limit: int | None, only: set[int]) -> tuple[int, int, list[Mutant]]:
    source_rel, tests = MODULES[name]
    work = Path(tempfile.mkdtemp(prefix=f"mutation-{name}-"))
    try:
        _scratch_copy(work)
        os.chdir(work)
        sys.path.insert(0, str(work))
        _preload()

        source = work / source_rel
        original = source.read_text()
        tree = ast.parse(original)
        source.write_text(ast.unparse(tree))  # the baseline runs the same unparsed text the mutants start from
        if run_mutant(tree, source, tests):
            raise SystemExit(f"[{name}] the tests fail without any mutation: fix them first")
        survivors, total = [], 0
        for mutant, mutated in mutants(tree):
            if limit is not None and total >= limit:
                break
            if only and mutant.index not in only:
                continue
            total += 1
            if not run_mutant(mutated, source, tests):
                survivors.append(mutant)
                print(f"[{name}] survived #{mutant.index} line {mutant.line}: {mutant.what}", flush=True)
        source.write_text(original)
        return total - len(survivors), total, survivors
    finally:
        os.chdir(ROOT)
        shutil.rmtree(work, ignore_errors=True)


# Third-party packages the tests import, imported once in the parent and shared by every forked child.
# Nothing of this repository: a module imported here would keep its unmutated code in the children.
PRELOAD = ("torch", "numpy", "pytest", "pytest_asyncio", "pytest_timeout", "grpc", "google.protobuf", "safetensors",
           "tokenizers", "sqlalchemy", "alembic", "boto3", "prometheus_client", "transformers", "peft")


def _preload() -> None:
    import contextlib
    import importlib

    if shutil.which("nvidia-smi") is None:  # the kernel tests' interpreter, set before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _scratch_copy(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the tree, as they are now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"modules to mutate, one after another: {', '.join(MODULES)}")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    parser.add_argument("--limit", type=int, help="stop after this many mutants (a quick look)")
    parser.add_argument("--only", default="", help="comma-separated mutant numbers (#N in the output) to run again")
    args = parser.parse_args()
    unknown = set(args.modules) - set(MODULES)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; known: {', '.join(MODULES)}")
    if args.list or not args.modules:
        for name, (source, tests) in MODULES.items():
            print(f"{name:14} {source:30} {' '.join(tests)}")
        return 0
    if len(args.modules) > 1:  # one fresh parent per module: nothing of one run leaks into the next
        limit = [] if args.limit is None else ["--limit", str(args.limit)]  # --only names one module's mutants
        for name in args.modules:
            subprocess.run([sys.executable, __file__, name, *limit], check=False)
        return 0
    os.nice(19)
    sys.dont_write_bytecode = True  # a mutant of the same size in the same second would reuse a stale .pyc
    (name,) = args.modules
    only = {int(n) for n in args.only.split(",") if n}
    killed, total, survivors = run_module(name, args.limit, only)
    print(f"[{name}] {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%), {len(survivors)} survived", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
