"""Offline fixtures: tiny random Qwen2/Qwen3 checkpoints and tokenizers (no hub access)."""
