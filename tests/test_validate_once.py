"""The run config is validated once, at the entry points, and travels down typed (issue 26).

`train.py` and `evaluate.py` call `config.validate` once and hand the `RunConfig` to everything
below them (the study checks each arm's run config in `study/config.py` and runs `train` as
subprocesses). A module below that floor that imported ml_collections or `validate` would read
the ml-collections config again, or validate it a second time: the static checks here fail on
either. Also here: the sandbox keys `sandbox.hang_grace_s` and `sandbox.infra_retries`, checked
at start-up and reaching the Sandbox."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from cleaner_jax import session as session_mod
from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.tools.sandbox import Sandbox
from _configs import load_config

PACKAGE = Path(__file__).resolve().parents[1] / "cleaner_jax"
# the entry floor (and the config package, which defines `validate` and the ml-collections config)
ENTRY = ("train.py", "evaluate.py")
ABOVE_OR_CONFIG = ("study", "config")


def _below_the_entry_floor() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if str(rel) in ENTRY or rel.parts[0] in ABOVE_OR_CONFIG:
            continue
        out.append(path)
    return out


def _offences(path: Path) -> list[str]:
    """What in `path` reads the ml-collections run config or validates it again."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "ml_collections"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if module.split(".")[0] == "ml_collections":
                found.append(f"from {module} import ...")
            elif module == "cleaner_jax.config" and names & {"validate", "base_config"}:
                found.append(f"from cleaner_jax.config import {', '.join(sorted(names & {'validate', 'base_config'}))}")
            elif module == "cleaner_jax" and "config" in names:
                found.append("from cleaner_jax import config (the module: config.validate)")
        elif isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None \
                and "ConfigDict" in ast.unparse(node.annotation):
            found.append(f"a ConfigDict annotation at line {node.lineno}")
    return found


def test_the_walk_finds_the_modules_below_the_entry_floor():
    names = {str(p.relative_to(PACKAGE)) for p in _below_the_entry_floor()}
    assert {"wiring.py", "session.py", "toy/warm_start.py", "toy/warm_cache.py"} <= names
    assert not names & {"train.py", "evaluate.py", "study/config.py", "config/__init__.py"}


def test_nothing_below_the_entry_floor_reads_the_ml_collections_config():
    bad = {str(p.relative_to(PACKAGE)): o for p in _below_the_entry_floor() if (o := _offences(p))}
    assert not bad, f"take the RunConfig the entry point validated instead: {bad}"


def test_the_check_fails_on_what_it_guards(tmp_path):
    """The offences it must see (so that the test above cannot pass by seeing nothing)."""
    path = tmp_path / "m.py"
    path.write_text("import ml_collections\nfrom cleaner_jax.config import RunConfig, validate\n"
                    "def f(c: ml_collections.ConfigDict) -> None: ...\n")
    assert len(_offences(path)) == 3


@pytest.mark.parametrize("entry", ENTRY)
def test_each_entry_point_validates_once(entry):
    tree = ast.parse((PACKAGE / entry).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "validate"]
    assert len(calls) == 1, f"{entry}: validate is called {len(calls)} times; once, then pass the RunConfig"


# ----------------------------------------------------------------------------- the sandbox keys


@pytest.mark.parametrize("key, bad, pattern", [
    ("hang_grace_s", 0.0, r"^config\.sandbox\.hang_grace_s: 0\.0 .*> 0\.0"),
    ("hang_grace_s", -5.0, r"^config\.sandbox\.hang_grace_s: -5\.0 "),
    ("infra_retries", -1, r"^config\.sandbox\.infra_retries: -1 .*>= 0"),
])
def test_a_bad_sandbox_value_is_rejected_at_start_up_naming_the_key(key, bad, pattern):
    c = load_config("toy")
    with c.unlocked():
        c.sandbox[key] = bad
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_the_sandbox_defaults_are_the_constructors():
    r = validate(load_config("toy"))
    params = inspect.signature(Sandbox).parameters
    assert (r.sandbox.hang_grace_s, r.sandbox.infra_retries) == (30.0, 1)
    assert (params["hang_grace_s"].default, params["infra_retries"].default) == (30.0, 1)
    inspect.signature(Sandbox).bind(**wiring.sandbox_options(r))  # every option is a Sandbox argument


class _Stop(Exception):
    pass


def test_the_sandbox_keys_reach_the_sandbox_the_session_starts(monkeypatch, tmp_path):
    """Through `Session` as train and evaluate build it: the real pool's settings are the config's.
    The session stops at the scorer (after the sandbox, before the tokenizer), and closes the pool."""
    c = load_config("toy")
    c.sandbox.workers, c.sandbox.timeout_s = 1, 3.0
    c.sandbox.hang_grace_s, c.sandbox.infra_retries = 7.5, 3
    seen = []

    def scorer(sandbox, **_):
        seen.append(sandbox)
        raise _Stop

    monkeypatch.setattr(session_mod, "Scorer", scorer)
    with pytest.raises(_Stop):
        with session_mod.Session(validate(c), tmp_path):
            pass
    (sb,) = seen
    assert (sb.workers, sb.timeout_s, sb.hang_grace_s, sb.infra_retries) == (1, 3.0, 7.5, 3)
    assert sb._closed  # the session closed what it had opened
