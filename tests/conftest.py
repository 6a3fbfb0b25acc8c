"""Test-session setup: 4 forced host devices so sharding tests run on any CPU machine (this must
take effect before JAX runs its first computation, hence at conftest import), and the session's
one small real study (tests/_study_common.py), shared by every test file that asks for it.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_study(tmp_path_factory):
    """The small study (2 arms x 2 seeds, killed and continued), run once per test session: here,
    not in _study_common, so that the files using it share one run instead of one each."""
    from _study_common import run_small_study

    return run_small_study(tmp_path_factory.mktemp("small_study"))
