"""XLA flags the stack sets for itself, so users do not have to know them.

They go into `XLA_FLAGS` before JAX starts its backend; a flag the user already set wins. Every
flag here is also accepted (and ignored) by the CPU backend, so tests run with them.
- latency-hiding scheduler: orders collectives so their transfer overlaps independent compute
  (the FSDP all-gathers and gradient reduce-scatters of the layer scan).

Also here: the persistent compilation cache (`run.compile_cache`).
"""

from __future__ import annotations

import os

GPU_DEFAULTS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
}


def set_default_flags(env: dict[str, str] | None = None) -> list[str]:
    """Adds the defaults the user has not set to XLA_FLAGS; returns the flags added."""
    env = os.environ if env is None else env
    current = env.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in GPU_DEFAULTS.items() if f"--{name}" not in current]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def use_compile_cache(path: str) -> None:
    """Points XLA's persistent compilation cache at `path` ("": leave JAX's own setting, which
    the JAX_COMPILATION_CACHE_DIR variable also controls). Must run before the first compile of
    the process: JAX opens the cache once."""
    if path:
        import jax  # here, not at the top: set_default_flags must be able to run before JAX loads

        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
