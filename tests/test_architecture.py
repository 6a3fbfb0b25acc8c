"""The folder layering declared in `.importlinter` holds for the real import graph, and no
folder (nor the top-level modules) holds an import circle; each check itself fails when an
upward import or a circle is added (so it cannot pass vacuously)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
ACYCLIC = "No import circles inside a folder"  # the acyclic_siblings contract's name in .importlinter


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
    ("viz/dumps.py", "from cleaner_jax.rl import step"),  # the viewer recomputing what the step wrote
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


def _circles_in(stdout: str) -> str:
    """The acyclic contract's part of the report (from its heading on)."""
    return stdout[stdout.rindex(ACYCLIC):]


def test_no_import_circle_inside_any_folder() -> None:
    out = _lint(ROOT)
    assert f"{ACYCLIC} KEPT" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("module, back, package, pair", [
    ("models/qwen.py", "from cleaner_jax.models import params", "cleaner_jax.models", ("qwen", "params")),  # model -> its loader
    ("rl/update.py", "from cleaner_jax.rl import learner", "cleaner_jax.rl", ("update", "learner")),  # pure step -> learner
    ("rl/learner_config.py", "from cleaner_jax.rl import update", "cleaner_jax.rl", ("learner_config", "update")),
    ("session.py", "from cleaner_jax import train", "cleaner_jax", ("session", "train")),  # top-level modules
    ("rollout/protocol.py", "from cleaner_jax.rollout import client", "cleaner_jax.rollout", ("protocol", "client")),
])
def test_an_import_circle_breaks_the_check(tmp_path: Path, module: str, back: str, package: str,
                                           pair: tuple[str, str]) -> None:
    """`module` already imports the other side of `pair`: the import added back closes a circle."""
    parent = _copy_package(tmp_path)
    target = parent / "cleaner_jax" / module
    target.write_text(target.read_text() + f"\n{back}  # deliberately circular\n")
    out = _lint(parent)
    assert out.returncode != 0, out.stdout
    assert f"{ACYCLIC} BROKEN" in out.stdout, out.stdout
    report = _circles_in(out.stdout)
    assert f"No cycles are allowed in {package}.\n" in report, report
    a, b = pair
    assert f".{a} -> .{b}" in report or f".{b} -> .{a}" in report, report


def test_the_circle_check_covers_every_folder(tmp_path: Path) -> None:
    """In a copy where the first two children of every package (the package itself, each folder)
    import each other, the check names every package: none is outside the contract. (A folder
    with one module cannot hold a circle and is skipped.)"""
    parent = _copy_package(tmp_path)
    packages = sorted(p.parent for p in (parent / "cleaner_jax").rglob("__init__.py"))
    expected = []
    for pkg in packages:
        children = sorted(c for c in pkg.iterdir()
                          if (c.suffix == ".py" and c.name != "__init__.py") or (c / "__init__.py").is_file())
        if len(children) < 2:
            continue
        name = ".".join(pkg.relative_to(parent).parts)
        first, second = children[:2]
        for child, other in ((first, second), (second, first)):
            source = child / "__init__.py" if child.is_dir() else child
            source.write_text(source.read_text() + f"\nimport {name}.{other.stem}  # deliberately circular\n")
        expected.append(name)
    assert {"cleaner_jax", "cleaner_jax.models", "cleaner_jax.rl"} <= set(expected), expected
    out = _lint(parent)
    assert f"{ACYCLIC} BROKEN" in out.stdout, out.stdout
    report = _circles_in(out.stdout)
    missing = [name for name in expected if f"No cycles are allowed in {name}.\n" not in report]
    assert not missing, report


def _private_imports(package: Path) -> list[str]:
    """`file:line name` for every import of a private name from another module, and of a private
    module from outside its own package (a module's underscore names are its own business)."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        own_package = ".".join(rel.with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cleaner_jax"):
                pairs = [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(a.name.rpartition(".")[0], a.name.rpartition(".")[2]) for a in node.names
                         if a.name.startswith("cleaner_jax.")]
            else:
                continue
            for module, name in pairs:
                parts = module.split(".")
                is_submodule = (package.parent / Path(*parts) / f"{name}.py").exists()
                if is_submodule and name.startswith("_") and module != own_package:
                    found.append(f"{rel}:{node.lineno} {module}.{name} (a private module of another package)")
                elif not is_submodule and name.startswith("_"):
                    found.append(f"{rel}:{node.lineno} {module}.{name} (a private name of another module)")
                for i, part in enumerate(parts):
                    if part.startswith("_") and ".".join(parts[:i]) != own_package:
                        found.append(f"{rel}:{node.lineno} {module} (a private module of another package)")
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    assert _private_imports(ROOT / "cleaner_jax") == []


@pytest.mark.parametrize("module, line", [
    ("rl/learner.py", "from cleaner_jax.rl.update import _unknown_helper"),  # a private name of another module
    ("rewards/math.py", "from cleaner_jax.tools import _linux"),  # another package's private module
    ("eval/runner.py", "import cleaner_jax.tools._linux"),
])
def test_the_private_import_check_fails_on_one(tmp_path: Path, module: str, line: str) -> None:
    parent = _copy_package(tmp_path)
    target = parent / "cleaner_jax" / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately private\n")
    found = _private_imports(parent / "cleaner_jax")
    assert len(found) >= 1 and all(str(Path(module)) in f for f in found), found


MAX_MODULE_LINES = 450  # the house rule: a module a reader can hold in mind
MAX_CLASS_LINES = 300


def _oversized(package: Path) -> list[str]:
    """`file: lines` for every module over MAX_MODULE_LINES and `file:line Class: lines` for
    every class over MAX_CLASS_LINES (a class counts from its decorators' line to its last)."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{rel}: {lines} lines (module limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = node.end_lineno - start + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{rel}:{start} {node.name}: {size} lines (class limit {MAX_CLASS_LINES})")
    return found


def test_no_module_or_class_over_the_size_limit() -> None:
    assert _oversized(ROOT / "cleaner_jax") == []


def test_the_size_check_fails_on_a_long_class(tmp_path: Path) -> None:
    parent = _copy_package(tmp_path)
    target = parent / "cleaner_jax" / "rl" / "plan.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_MODULE_LINES))  # over both limits
    target.write_text(target.read_text() + f"\n\nclass Long:\n{body}\n")
    found = _oversized(parent / "cleaner_jax")
    assert any("plan.py" in f and "Long" in f for f in found), found
    assert any("plan.py" in f and "module limit" in f for f in found), found


# one kind of thing in parallel folders, listed in docs/architecture.md ("Module names are unique")
SHARED_MODULE_NAMES = {"config.py", "runner.py", "plots.py", "livecodebench.py"}


def _repeated_module_names(package: Path) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(package.parent)))
    return {name: paths for name, paths in names.items() if len(paths) > 1}


def test_module_names_repeat_only_where_the_docs_say() -> None:
    repeated = _repeated_module_names(ROOT / "cleaner_jax")
    assert set(repeated) <= SHARED_MODULE_NAMES, {k: v for k, v in repeated.items() if k not in SHARED_MODULE_NAMES}
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{name}`" in doc for name in SHARED_MODULE_NAMES)


def test_the_name_check_sees_a_repeat(tmp_path: Path) -> None:
    parent = _copy_package(tmp_path)
    (parent / "cleaner_jax" / "eval" / "learner.py").write_text('"""A second learner.py."""\n')
    assert "learner.py" in _repeated_module_names(parent / "cleaner_jax")
