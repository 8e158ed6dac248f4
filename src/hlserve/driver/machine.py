"""Where a measurement ran, for its result JSON (``machine`` in a sweep's ``sweep.json`` and a
bench result): the CPU's model name (what ``lscpu`` prints as "Model name", read from
/proc/cpuinfo so that no tool need be installed), its logical CPUs, the OS and Python."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first ``model name`` of /proc/cpuinfo (x86; ARM kernels have none), else the
    platform's processor string, else ``unknown``."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and val.strip():
                return val.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host() -> dict[str, Any]:
    """This machine, as a result records it."""
    return {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}
