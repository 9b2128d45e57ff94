"""Mutation testing of the core modules, one module at a time (mutmut 2, the `mutation` extra).

    python tools/mutation.py drain            # mutate engine/drain.py, run only the tests that cover it
    python tools/mutation.py --list           # the modules and their tests

Each run works in a scratch copy of the tree (mutmut edits files in place), runs the module's own test
files with the global interpreter (never an editable install that would import the unmutated tree),
under `nice -n 19`, and prints the kill rate and every surviving mutant's diff. Not part of CI: a
module takes minutes to an hour. Results and the surviving mutants judged equivalent: docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = "python -m pytest -x -q -p no:cacheprovider --timeout 120"

# module -> (source file, the tests that cover it: files and selection arguments)
MODULES: dict[str, tuple[str, str]] = {
    "scheduler": ("engine/scheduler.py", "tests/engine/test_scheduler.py"),
    "drain": ("engine/drain.py", "tests/engine/test_drain.py -k 'not flow'"),
    "adapter_slots": ("engine/adapter_slots.py", "tests/engine/test_lora_slots.py tests/engine/test_drain.py -k 'not flow'"),
    "lora_pool": ("engine/lora_pool.py", "tests/engine/test_lora_slots.py tests/engine/test_lora_meta.py"),
    "radix_cache": ("engine/radix_cache.py", "tests/engine/test_radix_cache.py tests/engine/test_scheduler.py"),
    "request_kv": ("engine/request_kv.py", "tests/engine/test_scheduler.py"),
    "text": ("engine/text.py", "tests/engine/test_text.py"),
    "sampling": ("engine/sampling.py", "tests/engine/test_sampling.py"),
    "peft_compile": ("loraformat/peft_compile.py", "tests/loraformat/test_peft_compile.py"),
    "catalog": ("registry/catalog.py", "tests/registry/test_catalog.py"),
}


def scratch_copy(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the tree, as they are now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_module(name: str, keep: bool) -> int:
    source, tests = MODULES[name]
    work = Path(tempfile.mkdtemp(prefix=f"mutation-{name}-"))
    scratch_copy(work)
    env = os.environ | {"PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    runner = f"nice -n 19 {sys.executable} -m {PYTEST.removeprefix('python -m ')} {tests}"
    cmd = ["nice", "-n", "19", sys.executable, "-m", "mutmut", "run", "--paths-to-mutate", source,
           "--runner", runner, "--no-progress", "--simple-output"]
    print(f"[{name}] mutating {source} in {work}; tests: {tests}", flush=True)
    subprocess.run(cmd, cwd=work, env=env, check=False)
    results = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=work, env=env, capture_output=True,
                             text=True, check=False).stdout
    survivors = _ids(results, "Survived") + _ids(results, "Suspicious") + _ids(results, "Timed out")
    total = _count(work)
    killed = total - len(survivors)
    print(f"[{name}] {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%)", flush=True)
    for mutant in survivors:
        shown = subprocess.run([sys.executable, "-m", "mutmut", "show", str(mutant)], cwd=work, env=env,
                               capture_output=True, text=True, check=False).stdout
        print(f"--- survivor {mutant}\n{shown}", flush=True)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _ids(results: str, heading: str) -> list[int]:
    """Mutant ids listed under one heading of `mutmut results` (e.g. 'Survived 🙁 (3)')."""
    match = re.search(rf"^{heading}.*?\n\n(.*?)(?:\n\n|\Z)", results, re.S | re.M)
    if not match:
        return []
    ids: list[int] = []
    for part in re.findall(r"\d+(?:-\d+)?", match.group(1).split(":", 1)[-1]):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


def _count(work: Path) -> int:
    import sqlite3

    with sqlite3.connect(work / ".mutmut-cache") as db:
        return db.execute("select count(*) from Mutant").fetchone()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"modules to mutate, one after another: {', '.join(MODULES)}")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (mutmut's cache) for inspection")
    args = parser.parse_args()
    unknown = set(args.modules) - set(MODULES)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; known: {', '.join(MODULES)}")
    if args.list or not args.modules:
        for name, (source, tests) in MODULES.items():
            print(f"{name:14} {source:30} {tests}")
        return 0
    for name in args.modules:
        run_module(name, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
