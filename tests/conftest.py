"""Test-session setup: 4 forced host devices so sharding tests run on any CPU machine (this must
take effect before JAX runs its first computation, hence at conftest import), one XLA
compilation cache for the whole test run, the session's one small real study
(tests/_study_common.py), shared by every test file that asks for it, and the grouping of the
tests on xdist's workers.
"""
import os
import shutil
import tempfile
import uuid
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache for the run: every xdist worker and every trainer, rollout
# server and helper process a test starts (they inherit the environment) loads the programs an
# earlier test compiled instead of compiling them again; most of a tiny toy run's time is
# compilation. JAX keys an entry by the program, the compile options and the versions, so a hit is
# the very executable a compile would give. A test that sets its own directory
# (train.compilation_cache_dir, --compilation-cache-dir) still uses its own, and one that starts a
# process with a scrubbed environment starts cold; a JAX_COMPILATION_CACHE_DIR of the user's is
# left as it is. The controller (or a run without xdist) picks the directory before the workers
# start, they inherit it, and the controller removes it at the end.
if "CLEANER_JAX_TESTS_XLA_CACHE" not in os.environ:
    os.environ["CLEANER_JAX_TESTS_XLA_CACHE"] = str(Path(tempfile.gettempdir()) / f"cleaner_jax_tests_xla_{uuid.uuid4().hex}")
TEST_XLA_CACHE = Path(os.environ["CLEANER_JAX_TESTS_XLA_CACHE"])
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(TEST_XLA_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # a toy's programs compile fast, and many
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_study(tmp_path_factory):
    """The small study (2 arms x 2 seeds, killed and continued), run once per test session: here,
    not in _study_common, so that the files using it share one run instead of one each."""
    from _study_common import run_small_study

    return run_small_study(tmp_path_factory.mktemp("small_study"))


# ---------------------------------------------------------------- the suite on several workers
# `.ci/run` runs the suite with pytest-xdist (`-n 2`). A group of tests runs whole on one worker:
# by default its module (so module-scoped fixtures are built once), and the modules that share one
# session-wide expensive fixture form one group (else each worker would build it). Groups are
# handed out in the order below, the longest first, so that the workers finish together instead of
# one waiting for the last long file; the costs are measured with `--durations=0`
# (bench/RESULTS.md, "CI on two workers"), and a module missing from the list only runs later.
SHARED_FIXTURE_GROUPS = {
    "small_study": ("test_notebooks.py", "test_study_e2e.py"),  # conftest.small_study
    "console_run": ("test_console.py", "test_metric_names.py", "test_viz_browser.py"),  # test_console.console_run
    # test_train_toy.reference_run: the uninterrupted 3-step toy run both files compare against, made once per worker
    "toy_reference": ("test_train_toy.py", "test_trainer_kill.py"),
}
LONGEST_FIRST = (
    "test_multihost_train.py", "console_run", "test_seeds.py", "toy_reference", "test_soak.py",
    "small_study", "test_evaluate_e2e.py", "test_weight_sync_faults.py", "test_gpu_check.py",
    "test_rollout_faults.py", "test_loss_scaling.py", "test_rl_bucketing.py", "test_qwen_scan.py",
    "test_rollout_server.py",
)


def group_of(nodeid: str) -> str:
    """The group of a test id (`tests/test_x.py::test_y[...]`): its module's, or a shared one."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    for group, modules in SHARED_FIXTURE_GROUPS.items():
        if module in modules:
            return group
    return module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    # a stable sort: within a group the tests keep their file order (their module fixtures rely on it)
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduler (work units in collection order with --no-loadscope-reorder), with
    `group_of` as the unit: the way xdist's own loadfile scheduler narrows it."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), after every worker
        if TEST_XLA_CACHE.exists():
            shutil.rmtree(TEST_XLA_CACHE)
