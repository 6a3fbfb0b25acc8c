"""Float32 attention over a KV cache on CPU (csrc/cpu_kernels.cc), called through XLA FFI: the
rollout engine's decode steps (one query token per row) and prefill chunks (a chunk of them).

At decode time attention's dots (the 2-8 query heads sharing a KV head, against the KV cache)
are tiny batched GEMMs, and XLA:CPU packs their operands into a scratch layout on every call,
over every cache slot whether it holds a token yet or not; a prefill chunk's XLA attention
scores every query against every slot too, a cost that grows with the cache however short the
prompt. `cache_attention` reads the cache [B, KV, S, hd] once, as it lies, and stops at each
query's last valid slot. (The few-row matmuls
are left to XLA: hand-written ones gained nothing on a quiet box and lost on a busy one;
bench/RESULTS.md, 2026-12-01.)

Only the rollout engine's `cpu_kernels` decode backend (`decode_backend.py`) uses it; the
model and the learner never import this module.

`load(compiler)` compiles the C++ source against the installed jaxlib's FFI headers (a few
seconds) with `-march=native`, caches the library under `cache_dir` (default
`$XDG_CACHE_HOME/cleaner_jax/cpu_kernels/`) keyed by the source, jaxlib's version, the compiler
command and the CPU's feature flags, and registers the FFI target. Call it before tracing a
program that uses the kernel; it raises `CpuKernelBuildError` with the compiler's message.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cc"
DEFAULT_COMPILER = "c++"
_TARGETS = {"cj_cache_attention": "CjCacheAttention"}  # FFI target name -> the library's symbol

log = logging.getLogger(__name__)
_lock = threading.Lock()
_outcomes: dict[tuple[str, str], Path | Exception] = {}  # (compiler, cache dir) -> library or build error
_registered: list[Path] = []  # the library whose targets are registered in this process


class CpuKernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded."""


def default_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cleaner_jax" / "cpu_kernels"


def load(compiler: str = DEFAULT_COMPILER, cache_dir: Path | None = None) -> Path:
    """Build (or find cached) and register the kernels; returns the shared library's path.

    The outcome is remembered per (compiler, cache_dir): a failed build raises the same
    `CpuKernelBuildError` again without rerunning the compiler."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = (compiler, str(cache_dir))
    with _lock:
        if key not in _outcomes:
            try:
                lib = _build(compiler, cache_dir)
                if not _registered:
                    _register(lib)
                    _registered.append(lib)
                _outcomes[key] = lib
            except CpuKernelBuildError as e:
                _outcomes[key] = e
        outcome = _outcomes[key]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _compile_command(compiler: str, out: Path) -> list[str]:
    arch = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
    return [compiler, "-O3", arch, "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
            str(SOURCE), "-o", str(out)]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, cache_dir: Path) -> Path:
    """The shared library for this source, jaxlib, compiler and CPU, compiled if not cached."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(),
                 " ".join(_compile_command(compiler, Path("x"))).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    lib = cache_dir / key.hexdigest()[:16] / "libcj_cpu_kernels.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never see a partial library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = _compile_command(compiler, Path(tmp))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise CpuKernelBuildError(f"could not run {compiler!r} to build {SOURCE.name} ({e}); install a C++17 "
                                  "compiler or pass another one as `compiler`") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise CpuKernelBuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[:3000]}")
    os.replace(tmp, lib)
    log.info("built the CPU decode attention kernel: %s", lib)
    return lib


def _register(path: Path) -> None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:
        raise CpuKernelBuildError(f"could not load {path}: {e}; delete it to rebuild") from e


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """GQA attention of T query tokens per row over a KV cache, float32 (call `load()` first).

    q [B, T, KV, G, hd] (the G query heads of each KV head); k, v [B, KV, S, hd]; mask [B, T, S]
    bool -> [B, T, KV, G, hd]. A query with no valid slot gets uniform weights over all S, as
    XLA's finite mask value gives. Not differentiable: `decode_backend.CpuKernelOps.attention`
    wraps it.
    """
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("cj_cache_attention", out, vmap_method="sequential")(
        q, k, v, mask, scale=np.float32(scale)
    )
