"""Start ``hlserve serve`` as a child process and wait until it answers (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(model, ["--max-model-len", "256"]) as srv: srv.url ...``

    The server's output goes to ``log_path`` (or is discarded); :meth:`stop` sends SIGINT,
    then SIGKILL if it has not exited within ``stop_timeout`` seconds.
    """

    def __init__(self, model: str | Path, args: Sequence[str] = (), host: str = "127.0.0.1",
                 port: int | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 stop_timeout: float = 15.0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.cmd = [sys.executable, "-m", "hlserve.cli", "serve", str(model), "--host", host,
                    "--port", str(self.port), *args]
        self.log_path = Path(log_path) if log_path else None
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hlserve serve exited with {self.proc.returncode} before "
                                   f"answering; log: {self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"hlserve serve did not answer within {self.start_timeout}s; log: "
                           f"{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        if self._log is not None:
            self._log.flush()
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
