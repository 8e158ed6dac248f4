"""Llama/Qwen2/Qwen3 in plain PyTorch (paged attention, safetensors loading) and the
embedded random-weight tiny model."""
