"""The CPU matmul kernel (`model.cpu_matmul`): the blocks' projections and the query-blocked
attention's products on CPU through MKL's sgemm, called from the compiled step as an XLA FFI
custom call (`cpu_matmul.cc`), instead of XLA:CPU's own matmuls.

Why: on the default model's CPU step, XLA:CPU's matmuls (YNNPACK) ran the block shapes 10-25%
below MKL on a core, and the attention blocks' small batched products on one thread while the
other core waited; with this kernel the step took about a sixth less time (BENCHMARKS.md, "The
CPU step"). The kernel splits each call's work over XLA's own thread pool, so it adds no threads.

Float32 only: `takes` says whether a call can go through it (the kernel on, float32 operands, an
einsum that is a batched matmul), and the callers (model/quant.py `qeinsum`, model/attention.py
`heads_first_attention`) fall back to `jnp.einsum` otherwise. The trainer turns it on with
`cpu_matmul(True)` while the step traces, for one-device CPU programs only: XLA's partitioner
cannot split a custom call over a mesh (trainer/layout.py `cpu_matmul`). The products and sums are
the einsum's, in MKL's order of summation: equal to float32 rounding (tests/test_cpu_matmul.py).

The shared library is built once, by `make venv` (`scripts/build_cpu_matmul.py`), with the C++
compiler against jaxlib's FFI headers and the `mkl` package's libraries (the `cpu` extra); where
either is missing the step keeps XLA's matmuls and `unavailable()` says why.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ctypes
import functools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp

Array = jax.Array

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
# Where `make venv` builds it; MESHLM_CPU_MATMUL_LIB names another (one built elsewhere).
LIBRARY = Path(os.environ.get("MESHLM_CPU_MATMUL_LIB") or Path(__file__).with_name("_cpu_matmul.so"))
TARGET = "meshlm_cpu_matmul"
# MKL's single-threaded interface (the kernel splits the work over XLA's pool itself).
MKL_LIBRARIES = ("mkl_intel_lp64", "mkl_sequential", "mkl_core")
_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("cpu_matmul", default=False)


def mkl_libraries(prefix: str = sys.prefix) -> list[Path]:
    """The MKL libraries the kernel links, as the `mkl` package installs them in `prefix`/lib
    (`libmkl_core.so.3` and so on); [] if one is missing."""
    found = []
    for name in MKL_LIBRARIES:
        versions = sorted((Path(prefix) / "lib").glob(f"lib{name}.so.[0-9]"))
        if not versions:
            return []
        found.append(versions[-1])
    return found


def build(out: Path = LIBRARY, prefix: str = sys.prefix) -> str:
    """Compiles SOURCE into `out`, linked to the MKL of `prefix`; returns "" or why it could not."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    libraries = mkl_libraries(prefix)
    if not libraries:
        return f"MKL is not installed in {prefix} (the cpu extra: pip install -e '.[cpu]')"
    lib_dir = libraries[0].parent
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE),
           "-o", str(tmp), f"-L{lib_dir}", *(f"-l:{p.name}" for p in libraries), f"-Wl,-rpath,{lib_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        return f"{cxx} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    os.replace(tmp, out)  # whole or not at all: a parallel loader never sees half a library
    return ""


def unavailable() -> str:
    """"" once the kernel (LIBRARY) is loaded and registered with XLA for the CPU platform, else why not."""
    return _load(LIBRARY)


@functools.cache
def _load(library: Path) -> str:
    if not library.exists():
        return f"{library} is not built (`make venv` builds it: scripts/build_cpu_matmul.py)"
    if library.stat().st_mtime < SOURCE.stat().st_mtime:
        return f"{library} is older than {SOURCE.name}: rebuild it (`make venv`, or scripts/build_cpu_matmul.py)"
    try:
        handle = ctypes.cdll.LoadLibrary(str(library))
    except OSError as e:
        return f"{library} does not load: {e}"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.MeshlmCpuMatmul), platform="cpu")
    return ""


@contextlib.contextmanager
def cpu_matmul(on: bool) -> Iterator[None]:
    """While tracing under it with `on`, the float32 matmuls `takes` accepts run the kernel."""
    if on and unavailable():
        raise RuntimeError(f"the CPU matmul kernel is unavailable: {unavailable()}")
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def _split(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    return a, b, out


@functools.cache
def matmul_dims(spec: str) -> tuple[int, int, int] | None:
    """(batch, free, contracted) dim counts when `spec` is a batched matmul: batch dims leading in
    all three, then x's free dims and the contracted ones, the contracted ones and y's free dims,
    the free dims of x and y ("bld,df->blf": (0, 2, 1); "bkqd,bkds->bkqs": (2, 1, 1)); else None."""
    a, b, out = _split(spec)
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    nb = 0
    while nb < min(len(a), len(b), len(out)) and a[nb] == b[nb] == out[nb]:
        nb += 1
    ra, rb, ro = a[nb:], b[nb:], out[nb:]
    nk = sum(1 for d in ra if d in rb and d not in ro)
    nm = len(ra) - nk
    if nk == 0 or nm == 0 or len(rb) == nk or ra[nm:] != rb[:nk] or ro != ra[:nm] + rb[nk:]:
        return None
    return nb, nm, nk


def takes(spec: str, x: Array, y: Array) -> bool:
    """Whether `einsum(spec, x, y)` runs the kernel here: it is on, both operands are float32 and
    `spec` is a batched matmul (`matmul_dims`)."""
    return _ON.get() and x.dtype == y.dtype == jnp.float32 and matmul_dims(spec) is not None


def matmul(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
    """op(a) @ op(b) over the leading batch dims, op the transpose of the last two dims where
    asked; float32 arrays of one rank (2 or more), on the CPU."""
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    # Under vmap both operands get the mapped dim (broadcast where one lacks it): one more batch dim.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*a.shape[:-2], m, n), jnp.float32),
                            vmap_method="broadcast_all")
    return call(a, b, trans_a=trans_a, trans_b=trans_b)


def _as_matrices(spec: str, x: Array, y: Array) -> tuple[Array, Array, tuple[int, ...]]:
    """x as [batch..., M, K] and y as [batch..., K, N] (free reshapes of row-major arrays) and
    the einsum's output shape."""
    nb, nm, nk = matmul_dims(spec)
    batch, free_x, contracted, free_y = x.shape[:nb], x.shape[nb:nb + nm], x.shape[nb + nm:], y.shape[nb + nk:]
    k = math.prod(contracted)
    return (x.reshape(*batch, math.prod(free_x), k), y.reshape(*batch, k, math.prod(free_y)),
            (*batch, *free_x, *free_y))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x: Array, y: Array) -> Array:
    """`jnp.einsum(spec, x, y)` through the kernel (`matmul_dims(spec)` not None, float32)."""
    return _einsum_fwd(spec, x, y)[0]


def _einsum_fwd(spec: str, x: Array, y: Array) -> tuple[Array, tuple[Array, Array]]:
    x2, y2, shape = _as_matrices(spec, x, y)
    with jax.named_scope(spec):  # profiles name the call by its einsum, as they do XLA's dots
        return matmul(x2, y2).reshape(shape), (x, y)


def _einsum_bwd(spec: str, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    # dx = g . y^T and dy = x^T . g, each operand read transposed by the kernel in place (a
    # weight gradient sums over the tokens merged into one dim, as `flat_weight_grads` has it).
    x, y = res
    x2, y2, _ = _as_matrices(spec, x, y)
    g2 = g.reshape(x2.shape[:-1] + y2.shape[-1:])
    with jax.named_scope(f"transpose({spec})"):
        return matmul(g2, y2, trans_b=True).reshape(x.shape), matmul(x2, g2, trans_a=True).reshape(y.shape)


einsum.defvjp(_einsum_fwd, _einsum_bwd)


def main(argv: list[str] | None = None) -> int:
    """Builds the kernel (scripts/build_cpu_matmul.py, which `make venv` runs)."""
    parser = argparse.ArgumentParser(description=f"Build the CPU matmul kernel ({LIBRARY}).")
    parser.add_argument("--strict", action="store_true", help="exit 1 when it cannot be built")
    args = parser.parse_args(argv)
    why = build()
    if why:
        print(f"the CPU matmul kernel was not built ({why}): CPU steps keep XLA's matmuls", file=sys.stderr)
        return 1 if args.strict else 0
    print(f"built {LIBRARY} (MKL: {mkl_libraries()[0].parent})")
    return 0
