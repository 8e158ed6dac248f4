"""hlserve's throughput mode inside SGLang (docs/sglang.md).

- ``harness``: SGLang 0.5.23's scheduler driven on the CPU, its forward replaced by a
  stand-in that returns made-up tokens (SGLang's scheduling code in, a runner's outputs out).
- ``hooks``: the plugin, registered under SGLang's entry-point group ``sglang.srt.plugins``
  (name ``hlserve``; ``SGLANG_PLUGINS=hlserve`` allow-lists it).

Both import SGLang; this package's ``__init__`` does not, so hlserve imports without it.
"""
