"""hlserve's policies inside other serving engines (optional extras).

- ``hlserve.integrations.vllm``: ``ThroughputScheduler``, a vLLM scheduler plugin
  (``--scheduler-cls hlserve.integrations.vllm.ThroughputScheduler``; needs vLLM installed).
- ``hlserve.integrations.plugin_policy``: that plugin's decisions that do not need vLLM
  (options, per-step caps, backpressure, the start-up block), tested without it.
"""
