"""hlserve's throughput mode inside vLLM, and vLLM's own scheduler driven without a model.

- ``ThroughputScheduler`` / ``ThroughputAsyncScheduler`` (``throughput``): hlserve's policies
  as a subclass of vLLM's v1 scheduler, named by ``--scheduler-cls`` (docs/vllm.md);
- ``seams``: each difference between the supported vLLM series, in one function;
- ``session_hold``: agent sessions' blocks held across tool calls inside vLLM's pool;
- ``step_harness``: vLLM's scheduler (stock or the plugin) driven on the CPU with a stand-in
  runner, a request stream in, its step decisions out (tests, and the study).

Importing this package checks vLLM's version first: a version whose internals moved fails
here with a message naming the supported ones, not with an ImportError from inside vLLM.
"""

from __future__ import annotations

import vllm

from hlserve.integrations.plugin_policy import check_vllm_version

check_vllm_version(vllm.__version__)

from hlserve.integrations.vllm.throughput import (  # noqa: E402
    BlockHashPrefixOrder,
    ThroughputAsyncScheduler,
    ThroughputScheduler,
)

__all__ = ["BlockHashPrefixOrder", "ThroughputAsyncScheduler", "ThroughputScheduler"]
