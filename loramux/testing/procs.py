"""Starting loramux commands as real processes and waiting for their ready line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LOCAL_ENV = {"NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"}


def loramux_exe() -> str:
    """The console script installed next to this interpreter."""
    return str(Path(sys.executable).parent / "loramux")


def run_cli(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [loramux_exe(), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **LOCAL_ENV}
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"loramux {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


class Service:
    """A server process; `address` comes from its `<name> listening on HOST:PORT` line."""

    def __init__(self, args: list[str], name: str, timeout: float = 120):
        self.proc = subprocess.Popen(
            [loramux_exe(), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **LOCAL_ENV},
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._ready = threading.Event()
        self.address = ""
        self._pattern = re.compile(rf"^{name} listening on (\S+:\d+)$")
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{name} did not become ready: {''.join(self.stderr)[-3000:]}")

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            match = self._pattern.match(line.strip())
            if match and not self._ready.is_set():
                self.address = match.group(1)
                self._ready.set()

    @staticmethod
    def _drain(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def interrupt(self, timeout: float = 30) -> int:
        """Ctrl-C, then wait for a graceful exit; returns the exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
