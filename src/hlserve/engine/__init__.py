"""The core: the scheduler, its policies and presets, the KV cache manager, the engine loop,
and the runner interface (`engine/batch.py`) that the real and simulated runners implement."""
