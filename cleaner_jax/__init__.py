"""cleaner_jax: CLEANER (SAAR-purified agentic RL) for Qwen2/Qwen3 in JAX/Flax NNX."""

__version__ = "0.1.0"
