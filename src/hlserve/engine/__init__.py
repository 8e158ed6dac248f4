"""The core: the scheduler, its policies and presets, the KV cache manager, the engine loop,
the one engine factory (`engine/factory.py:build_engine`), and the runner interface
(`engine/batch.py`) that the real and simulated runners implement."""
