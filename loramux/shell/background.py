"""`loramux up --detach` and `loramux down`: one stack per data dir, found through a pid file.

The foreground `loramux up` writes `<data_dir>/loramux.pid` while it runs (and refuses to start when a
live one is there). `--detach` starts that same foreground command as a new session with its output in
`<data_dir>/loramux.out` (the ready lines and hints) and `loramux.log` (the logs), echoes the output up
to the ready line, and returns. `down` sends the pid SIGINT (the same graceful stop as Ctrl-C) and waits.
Nothing here matches processes by name: only the pid this data dir recorded, and only while that
process is a loramux.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PID_FILE = "loramux.pid"
OUT_FILE = "loramux.out"
LOG_FILE = "loramux.log"
READY_PREFIX = "loramux is up"
START_TIMEOUT_S = 900.0  # the first start writes the demo model and warms the engine up
STOP_TIMEOUT_S = 60.0


def running_pid(data_dir: Path) -> int | None:
    """The pid of the live `loramux up` of data_dir, or None (a stale file is ignored)."""
    try:
        pid = int((data_dir / PID_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _is_loramux(pid) else None


def _is_loramux(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid file
    return b"loramux" in cmdline


@contextlib.contextmanager
def holding_pid_file(data_dir: Path) -> Iterator[None]:
    """Record this process as data_dir's `loramux up` while the block runs."""
    other = running_pid(data_dir)
    if other is not None:
        raise OSError(
            f"loramux up is already running for {data_dir} (pid {other}); stop it with `loramux down --data-dir {data_dir}`"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / PID_FILE
    tmp = path.with_suffix(f".{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(path)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int(path.read_text()) == os.getpid():
                path.unlink()


def detach(argv: list[str], data_dir: Path) -> int:
    """Start `loramux up` (argv without --detach) in the background; echo its output until it is up."""
    if running_pid(data_dir) is not None:
        raise OSError(f"loramux up is already running for {data_dir} (pid {running_pid(data_dir)})")
    data_dir.mkdir(parents=True, exist_ok=True)
    out_path = data_dir / OUT_FILE
    with out_path.open("w") as out, (data_dir / LOG_FILE).open("a") as log:
        child = subprocess.Popen(
            _self_command(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=log, start_new_session=True
        )
    shown = 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        lines = out_path.read_text().splitlines(keepends=True)
        complete = lines if (lines and lines[-1].endswith("\n")) else lines[:-1]
        for line in complete[shown:]:
            if line.startswith(READY_PREFIX):
                print(f"loramux is up in the background (pid {child.pid}; logs in {data_dir / LOG_FILE})")
                print(f"stop it with: {cli_name()} down --data-dir {data_dir}")
                return 0
            print(line, end="", flush=True)
        shown = len(complete)
        if child.poll() is not None:
            tail = (data_dir / LOG_FILE).read_text().splitlines()[-1:]
            raise OSError(f"loramux up exited with {child.returncode}: {' '.join(tail) or 'see ' + str(data_dir / LOG_FILE)}")
        if time.monotonic() > deadline:
            raise OSError(f"loramux up was not ready within {START_TIMEOUT_S:g}s; see {data_dir / LOG_FILE}")
        time.sleep(0.1)


def stop(data_dir: Path, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGINT the `loramux up` of data_dir and wait for it to exit; returns its pid."""
    pid = running_pid(data_dir)
    if pid is None:
        raise OSError(f"no loramux up is running for {data_dir}")
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while _is_loramux(pid):
        if time.monotonic() > deadline:
            raise OSError(f"loramux up (pid {pid}) did not stop within {timeout:g}s")
        time.sleep(0.1)
    return pid


def _self_command(argv: list[str]) -> list[str]:
    """This same `loramux`, as the user ran it (so its hints name the same executable)."""
    exe = sys.argv[0]
    if os.path.basename(exe) == "loramux" and os.access(exe, os.X_OK):
        return [exe, *argv]
    return [sys.executable, "-m", "loramux.shell.cli", *argv]


def cli_name() -> str:
    """How to call loramux in a hint: `loramux` when that is on PATH and is this one, else the path run."""
    exe = sys.argv[0]
    if os.path.basename(exe) != "loramux":
        return "loramux"
    import shutil

    on_path = shutil.which("loramux")
    if on_path and Path(on_path).resolve() == Path(exe).resolve():
        return "loramux"
    return exe
