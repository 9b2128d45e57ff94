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
    """A server process, ready once it printed `<name> listening on HOST:PORT` for each name.

    `addresses[name]` holds each address; `address` the first name's.
    """

    def __init__(self, args: list[str], name: str, timeout: float = 120, also: tuple[str, ...] = ()):
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
        self.names = (name, *also)
        self.addresses: dict[str, str] = {}
        self._pattern = re.compile(r"^(\w+) listening on (\S+:\d+)$")
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
            if match:
                self.addresses[match.group(1)] = match.group(2)
                if all(n in self.addresses for n in self.names):
                    self._ready.set()

    @property
    def address(self) -> str:
        return self.addresses[self.names[0]]

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
