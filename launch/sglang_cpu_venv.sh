#!/usr/bin/env bash
# Install real SGLang 0.5.23 into a separate CPU-only venv (outside the repo), for the
# conformance recording in launch/record_sglang_fixtures.py. Never a project dependency.
#
# This is the "light" recipe of docs/sglang_api.md §1.2 (attempt A4): the CPU torch 2.13.0
# wheel, sglang with --no-deps (its declared deps are CUDA-only), the pure/CPU deps it imports,
# triton (imported unconditionally), and a stand-in `torchvision` package (PyPI's torchvision
# links CUDA libs; a text model never calls it). pip reports violated pins (torch, xgrammar,
# sentencepiece); nothing breaks for a text model. ~2.8 GB, several minutes.
#
# Usage: bash launch/sglang_cpu_venv.sh [VENV_DIR]   (default /work/sglang-venv)
set -euo pipefail
VENV="${1:-/work/sglang-venv}"
PY="${PYTHON:-python3.11}"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install --no-input)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "sglang==0.5.23"
"${PIP[@]}" "torch==2.13.0" "transformers==5.19.0" "tokenizers==0.23.2" aiohttp fastapi \
  "uvicorn>=0.51" uvloop orjson pyzmq psutil setproctitle requests sentencepiece numpy scipy \
  pydantic msgspec pybase64 python-multipart prometheus-client packaging einops tqdm xxhash \
  zstandard partial_json_parser interegular pillow IPython "openai==2.8.0" \
  "openai-harmony==0.0.4" anthropic llguidance distro easydict "blobfile==3.0.0" tiktoken \
  watchfiles python-dateutil gguf "apache-tvm-ffi==0.1.11" triton dill compressed-tensors \
  jsonschema xgrammar soundfile

# Stand-in torchvision: any `import torchvision[.x.y]` succeeds and any attribute is a stub.
STUB="$VENV/stub_torchvision/torchvision"
mkdir -p "$STUB"
cat > "$STUB/__init__.py" <<'PYEOF'
"""Import-time stand-in for torchvision (CPU SGLang conformance venv only; text models only)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"


class _Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
PYEOF
echo "installed; run servers with PYTHONPATH=$VENV/stub_torchvision"
