"""Start a server as a child process in its own process group and wait until it answers
``/health``; tear the group down after.

``hlserve serve`` itself (:class:`ServerProcess`, for tests and benchmarks) or any
OpenAI-compatible server command (:class:`ExternalServer`, for ``hlserve sweep`` and the peer
benchmarks)."""

from __future__ import annotations

import contextlib
import os
import shlex
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


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) != 0


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a job runner, ``kill``) into SystemExit in the main thread,
    so that a server being started or used in a ``with`` block is torn down, group and all.
    Python's default SIGTERM ends the process at once and left a vLLM server and its engine
    processes running without a parent."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class ExternalServer:
    """Any server command in its own process group: started, waited for on ``/health``,
    stopped with SIGINT, SIGTERM, then SIGKILL to the whole group (engine workers and all),
    and only then reported stopped once its port is free again."""

    def __init__(self, cmd: list[str], host: str, port: int, log_path: Path | None = None,
                 env: dict[str, str] | None = None, health_timeout: float = 600.0,
                 stop_timeout: float = 20.0) -> None:
        self.cmd, self.host, self.port = cmd, host, port
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.health_timeout = health_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_text(self) -> str:
        """Everything the server has written so far (empty without a log file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used so far by the server's process group, all its
        processes: on a machine shared with other jobs, tokens per server CPU-second is a
        fairer comparison than tokens per wall-second. Linux only; None elsewhere."""
        if self.proc is None or not Path("/proc").is_dir():
            return None
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp: the group started with the server
                total += int(fields[11]) + int(fields[12])  # utime + stime
        return total / tick

    def start(self) -> ExternalServer:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")  # noqa: SIM115
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        try:  # interrupted (Ctrl-C, SIGTERM via stop_on_sigterm) or failed: no orphans
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before "
                                   f"answering /health; command: {shlex.join(self.cmd)}; log "
                                   f"tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not answer /health within {self.health_timeout}s; "
                           f"log tail:\n{self.log_tail()}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        for sig, wait in ((signal.SIGINT, self.stop_timeout), (signal.SIGTERM, 10.0)):
            if self.proc.poll() is not None:
                break
            if pgid is not None:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        # then the whole group: the server if it is still up, and children left behind
        # (engine workers, ...)
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
        deadline = time.monotonic() + 15
        while not port_free(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ExternalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ExternalServer):
    """``with ServerProcess(model, ["--max-model-len", "256"]) as srv: srv.url ...``: an
    ``hlserve serve`` of ``model`` on a free port, its output in ``log_path`` (or discarded)."""

    def __init__(self, model: str | Path, args: Sequence[str] = (), host: str = "127.0.0.1",
                 port: int | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 stop_timeout: float = 15.0) -> None:
        port = port or free_port(host)
        cmd = [sys.executable, "-m", "hlserve.cli", "serve", str(model), "--host", host,
               "--port", str(port), *args]
        super().__init__(cmd, host, port, Path(log_path) if log_path else None, env,
                         health_timeout=start_timeout, stop_timeout=stop_timeout)
