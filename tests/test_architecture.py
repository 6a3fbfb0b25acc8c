"""The folder layering declared in `.importlinter` holds for the real import graph, and the
check itself fails when an upward import is added (so it cannot pass vacuously)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(package_parent: Path) -> subprocess.CompletedProcess[str]:
    if not LINT.exists():
        pytest.fail(f"{LINT} not found: install the dev extra (pip install -e '.[dev]'), which brings import-linter")
    return subprocess.run([str(LINT), "--no-logo", "--no-cache", str(ROOT / ".importlinter")], cwd=package_parent,
                          env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "cleaner_jax", tmp_path / "cleaner_jax", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


def test_layering_contracts_hold() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout


@pytest.mark.parametrize("module, upward", [
    ("trajectory.py", "from cleaner_jax.agent import loop"),  # the ground floor reaching the agent
    ("saar/purify.py", "from cleaner_jax.rollout import engine"),  # pure SAAR running a model
    ("models/qwen.py", "from cleaner_jax.rl import losses"),  # the model reaching the learner
    ("rl/losses.py", "from cleaner_jax.testing import http"),  # production code using test helpers
])
def test_an_upward_import_breaks_the_check(tmp_path: Path, module: str, upward: str) -> None:
    parent = _copy_package(tmp_path)
    target = parent / "cleaner_jax" / module
    target.write_text(target.read_text() + f"\n{upward}  # deliberately upward\n")
    out = _lint(parent)
    assert out.returncode != 0, out.stdout
    assert "BROKEN" in out.stdout
    imported = upward.split()[1]
    assert imported in out.stdout, out.stdout
