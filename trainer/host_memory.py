"""Host memory for CPU runs (`run.reuse_host_memory`): keep the memory a step frees for the next.

XLA:CPU allocates every temporary of a compiled step in one block per execution (the default
model's step: 547 MB) and frees it when the step ends. glibc's malloc serves a block that large
with a fresh `mmap` and gives it back with `munmap`, so every step faults its temporaries in
again, 4 KB at a time, each page zeroed by the kernel: 140,000 page faults and about 200 ms of
system time per step of the default model on one core (BENCHMARKS.md, "The CPU step"), a sixth
of the step. Eager PyTorch never meets this: its tensors are freed and reused one at a time, each
small enough for malloc's heap.

The fix is three of glibc's own `mallopt` settings, made before JAX starts its thread pool:
one arena for every thread (XLA allocates on its pool's threads, and a thread's own arena can
hold no block over 64 MB, so it would `mmap` even with the next setting), no `mmap` for large
blocks (they come from the main heap), and no trimming of the heap's free top below 2 GB (so a
freed block stays mapped and the next step reuses its pages). Freed memory is then kept by the
process instead of returned to the system. Now and then the next step's block is allocated before
the last one is freed (the runtime frees it on another thread), and the heap grows by a block:
the tiny preset at 8x its batch (0.2 GB of temporaries) faulted a whole block in 1 to 3 steps of
100 and held 1.1-1.5 GB resident after them, against 0.55-0.75 GB and a block every step without
(BENCHMARKS.md, "The CPU step").

"auto" does this for CPU-only processes (the GPU and TPU runtimes keep their own device memory;
their host allocations are small), "on" everywhere, "off" never; a user's own `MALLOC_*` or
`GLIBC_TUNABLES` settings win, and so does a process whose JAX has started (its pool threads
already have their arenas). Only glibc has `mallopt`; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import os

from trainer.xla_env import backend_started, not_cpu_only

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest free heap top kept, 2 GB
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                 "GLIBC_TUNABLES")


def reuse_host_memory(mode: str, env: dict[str, str] | None = None) -> str:
    """Applies `run.reuse_host_memory` (`mode`: auto, on, off) to this process; returns what was
    done, or why not, in one line ("" when off, or auto on a process that may use an accelerator)."""
    env = os.environ if env is None else env
    if mode == "off" or (mode == "auto" and not_cpu_only(env)):
        return ""
    user = [name for name in USER_SETTINGS if name in env]
    if user:
        return f"host memory: left to the user's {', '.join(user)}"
    if backend_started():  # said only when asked for by name: an in-process run after another is the usual case
        return "" if mode == "auto" else "host memory: not changed, JAX had already started in this process"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library this process runs on
    if mallopt is None:
        return "host memory: not changed, this C library has no mallopt"
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return ("host memory: freed step memory is kept for the next step (run.reuse_host_memory)" if ok
            else "host memory: glibc refused a mallopt setting")
