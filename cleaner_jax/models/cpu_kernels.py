"""Float32 CPU kernels for few-row decode (csrc/cpu_kernels.cc), called through XLA FFI.

At decode time every matmul has one row per sequence, and XLA:CPU runs such a dot as a GEMM
that packs the whole weight matrix into a scratch layout on every call; attention's dots (the
2-8 query heads sharing a KV head) pay the same, over every cache slot whether it holds a token
yet or not. These kernels read weights and cache once, as they lie:

- `small_matmul(x, w)`: x [M, K] @ w [K, N] (`nnx.Linear` kernels);
- `small_matmul_t(x, w_t)`: x [M, K] @ w_t[N, K]^T (a tied embedding as the lm head, untransposed);
- `decode_attention`: one new token per row, stopping at each row's last valid cache slot.

`layers.matmul`, `layers.matmul_t` and `layers.cached_attention` use them for float32 on CPU;
`bench/rollout.py` runs an engine without them in the same loop, `bench/small_matmul.py`
compares them with XLA's GEMM and row-wise dots.

The C++ source is compiled on first use against the installed jaxlib's FFI headers (a few
seconds; `CXX`, default `c++`) with `-march=native`, and cached under
`$XDG_CACHE_HOME/cleaner_jax/cpu_kernels/` keyed by the source, jaxlib's version, the compiler
command and the CPU's feature flags. `CLEANER_JAX_CPU_KERNELS` chooses:

- `auto` (default): build on first use; if that fails, log a warning with the compiler's error
  once and use XLA's ops (same results, slower decode);
- `on`: a failed build raises `CpuKernelBuildError`;
- `off`: never build; XLA's ops only.

GPUs never use them: `layers` checks `jax.default_backend() == "cpu"` first.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

ENV_VAR = "CLEANER_JAX_CPU_KERNELS"
MODES = ("auto", "on", "off")
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cc"
_TARGETS = {
    "cj_small_matmul": "CjSmallMatmul",
    "cj_small_matmul_t": "CjSmallMatmulT",
    "cj_decode_attention": "CjDecodeAttention",
}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once decided; "error": str when the build failed


class CpuKernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded."""


def mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(MODES)}")
    return value


@contextlib.contextmanager
def mode_while_tracing(value: str) -> Iterator[None]:
    """`ENV_VAR` set to `value` inside the block, restored after: programs traced inside use that
    mode (it is read at trace time; already compiled programs keep theirs)."""
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(MODES)}")
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved


def available() -> bool:
    """Whether the kernels are built and registered in this process (building them if needed)."""
    m = mode()
    if m == "off":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _register(_build())
                _state["ok"] = True
            except CpuKernelBuildError as e:
                _state["ok"], _state["error"] = False, str(e)
                if m == "auto":
                    log.warning("CPU decode kernels unavailable, using XLA's ops (slower decode; set %s=off "
                                "to silence, =on to make this an error): %s", ENV_VAR, e)
        if not _state["ok"] and m == "on":
            raise CpuKernelBuildError(str(_state["error"]))
        return bool(_state["ok"])


def _compile_command(out: Path) -> list[str]:
    arch = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
    return [
        os.environ.get("CXX", "c++"), "-O3", arch, "-std=c++17", "-shared", "-fPIC", "-w",
        f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out),
    ]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cleaner_jax" / "cpu_kernels"


def _build() -> Path:
    """The shared library for this source, jaxlib, compiler and CPU, compiled if not cached."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(_compile_command(Path("x"))).encode(),
                 _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    lib = _cache_dir() / key.hexdigest()[:16] / "libcj_cpu_kernels.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never see a partial library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = _compile_command(Path(tmp))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise CpuKernelBuildError(f"could not run {cmd[0]!r} to build {SOURCE.name} ({e}); install a C++17 "
                                  f"compiler or point CXX at one") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise CpuKernelBuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[:3000]}")
    os.replace(tmp, lib)
    log.info("built CPU decode kernels: %s", lib)
    return lib


def _register(path: Path) -> None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:
        raise CpuKernelBuildError(f"could not load {path}: {e}; delete it to rebuild") from e


def _ffi_matmul(target: str, transposed: bool):
    """A differentiable few-row matmul by FFI target `target`; the weight is [K, N], or [N, K]
    when `transposed`. Gradients are plain XLA dots (the kernels are forward-only)."""

    @jax.custom_vjp
    def op(x: jax.Array, w: jax.Array) -> jax.Array:
        n = w.shape[0] if transposed else w.shape[1]
        out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)

    def fwd(x, w):
        return op(x, w), (x, w)

    def bwd(res, g):  # g [M, N]
        x, w = res
        return (jnp.dot(g, w), jnp.dot(g.T, x)) if transposed else (jnp.dot(g, w.T), jnp.dot(x.T, g))

    op.defvjp(fwd, bwd)
    return op


small_matmul = _ffi_matmul("cj_small_matmul", transposed=False)
"""x [M, K] @ w [K, N] -> [M, N], float32, for a few rows (call `available()` first)."""

small_matmul_t = _ffi_matmul("cj_small_matmul_t", transposed=True)
"""x [M, K] @ w_t [N, K]^T -> [M, N], float32, for a few rows (call `available()` first)."""


def decode_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Single-token GQA attention over a KV cache, float32 (call `available()` first).

    q [B, KV, G, hd] (the G query heads of each KV head); k_t [B, KV, hd, S]; v [B, KV, S, hd];
    mask [B, S] bool -> [B, KV, G, hd]. Not differentiable: `layers.cached_attention` wraps it.
    """
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("cj_decode_attention", out, vmap_method="sequential")(
        q, k_t, v, mask, scale=np.float32(scale)
    )
