"""Loading the repository's config files and scripts the way `--config configs/x.py` does (they
are files, not importable modules)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import ml_collections

ROOT = Path(__file__).resolve().parents[1]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_config(name: str) -> ml_collections.ConfigDict:
    """`configs/<name>.py`'s `get_config()`."""
    return load_module(ROOT / "configs" / f"{name}.py").get_config()
