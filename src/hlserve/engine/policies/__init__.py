"""Scheduler policies: small objects the scheduler composes, one module per knob.

Each knob is an abstract base with one or two methods; the scheduler asks, the policy
answers, and none of them knows about tensors or clocks. ``order`` / ``lpm`` (the waiting
queue's order), ``mixing`` (prefill beside decode, the two-stage switch), ``admission`` (who
starts now, and the pass over the queue with backfill), ``retraction`` (who yields its KV),
``budget`` (tokens per iteration), and ``caps`` (the caps of one step and the start-up block
that lists them). Each knob's module owns the registry of its names (name -> constructor),
which the command line's help, the config check (``names.py``) and the vLLM plugin read, and
its ``make_*`` builds the knob an ``EngineConfig`` names; presets (``engine/presets.py``) pick
the values. hlserve's scheduler and the vLLM plugin
(``hlserve.integrations``) both run these, each on its own view of its queue and pool.
"""
