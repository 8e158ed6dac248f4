"""hlserve's policies inside other serving engines (optional extras).

- ``hlserve.integrations.vllm``: ``ThroughputScheduler``, a vLLM scheduler plugin
  (``--scheduler-cls hlserve.integrations.vllm.ThroughputScheduler``; needs vLLM installed).
- ``hlserve.integrations.plugin_policy``: that plugin's half that does not need vLLM (its
  options as an ``EngineConfig``, each step's plan from hlserve's policy core in
  ``hlserve.engine.policies``, the start-up block, the trace), tested without it.
"""
