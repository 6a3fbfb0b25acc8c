"""Test-session setup: 4 forced host devices so sharding tests run on any CPU machine.

This must take effect before JAX runs its first computation, hence at conftest import.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
