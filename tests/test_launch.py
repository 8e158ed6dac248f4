"""A benchmark stopped with SIGTERM while a server it started is still coming up (a vLLM
start takes minutes) tears that server's whole process group down: no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# the "server": writes its pid and a child's, then never answers /health
SERVER = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{__import__('os').getpid()} {child.pid}")
    time.sleep(600)
""")

# the benchmark: starts it the way run_peers.py and `hlserve sweep` do
RUNNER = textwrap.dedent("""
    import sys
    from hlserve.server.runtime.launch import ExternalServer, free_port, stop_on_sigterm
    stop_on_sigterm()
    port = free_port()
    with ExternalServer([sys.executable, "-c", sys.argv[1], sys.argv[2]], "127.0.0.1", port,
                        health_timeout=600, stop_timeout=5):
        pass
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie is gone for our purpose
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_sigterm_during_a_server_start_stops_the_server_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, SERVER, str(pids)])
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    server, child = map(int, pids.read_text().split())
    assert alive(server) and alive(child)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while (alive(server) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server), "the server outlived the benchmark that started it"
    assert not alive(child), "the server's child process outlived the benchmark"
