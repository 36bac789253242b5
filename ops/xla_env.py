"""XLA flags the stack sets for itself, so users do not have to know them.

They go into `XLA_FLAGS` before JAX starts its backend; a flag the user already set wins. Every
flag here is also accepted (and ignored) by the CPU backend, so tests run with them.
- latency-hiding scheduler: orders collectives so their transfer overlaps independent compute
  (the FSDP all-gathers and gradient reduce-scatters of the layer scan).

Also here: the CPU device count a mesh needs (a CPU-only machine gets as many CPU devices as
the config's mesh names, so `mesh.data=2 mesh.fsdp=2 mesh.tensor=2` runs without the user knowing
`--xla_force_host_platform_device_count`) with a thread pool that several CPU devices' collectives
cannot exhaust and collectives kept in their loops (XLA:CPU deadlocks on hoisted ones), and the
persistent compilation cache (`run.compile_cache`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import pkgutil
import sys

from configs import Config
from configs.schema import MESH_AXES
from configs.writable import check_writable
from sharding.distributed import process_layout
from sharding.hardware import GPU_MEMORY_RESERVE

FORCE_COUNT = "--xla_force_host_platform_device_count"
# XLA:CPU runs all CPU devices on one thread pool (NPROC sets its size), and a collective holds
# its thread until every peer arrives: with one thread per device, two collectives in flight on
# one device can leave a peer no thread, and XLA aborts after 40 s. Waiting threads cost no CPU.
POOL_THREADS_PER_DEVICE = 4
# XLA:CPU runs a device's collectives in program order within a loop body, but not against one
# that loop-invariant code motion hoisted out of it: devices then wait in different collectives
# and XLA aborts after 40 s, or hangs. Without the pass they stay in the loop, in order.
KEEP_COLLECTIVES_IN_LOOPS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"

GPU_DEFAULTS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
}


# JAX takes 75% of a GPU's memory by default; the planner's verdicts assume all but its reserve.
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_default_flags(env: dict[str, str] | None = None) -> list[str]:
    """Adds the defaults the user has not set to XLA_FLAGS, and JAX's GPU memory share to what the
    planner budgets (all but sharding.hardware.GPU_MEMORY_RESERVE) unless the user set it: under
    JAX's own 75%, a step the planner says fits on an H200 ran out of memory. Returns the XLA flags
    added."""
    env = os.environ if env is None else env
    env.setdefault(MEM_FRACTION, f"{1 - GPU_MEMORY_RESERVE:.2f}")
    current = env.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in GPU_DEFAULTS.items() if f"--{name}" not in current]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def set_cpu_collective_env(local_devices: int, env: dict[str, str] | None = None) -> None:
    """Makes `local_devices` CPU devices safe to run collectives on: XLA:CPU's thread pool sized
    at POOL_THREADS_PER_DEVICE threads each unless the user set NPROC, and collectives kept inside
    the loops that issue them (KEEP_COLLECTIVES_IN_LOOPS) unless the user's XLA_FLAGS name passes
    to disable. Must run before JAX starts its backend, in a process that compiles for the CPU
    only (the flag would change a real GPU/TPU program too)."""
    env = os.environ if env is None else env
    if local_devices <= 1:
        return
    if "NPROC" not in env:
        env["NPROC"] = str(max(os.cpu_count() or 1, POOL_THREADS_PER_DEVICE * local_devices))
    flags = env.get("XLA_FLAGS", "")
    if "--xla_disable_hlo_passes" not in flags:
        env["XLA_FLAGS"] = f"{flags} {KEEP_COLLECTIVES_IN_LOOPS}".strip()


def mesh_device_count(cfg: Config) -> int:
    """The devices the mesh names: the product of its fixed sizes (a -1 axis takes what is left,
    so it asks for none beyond them)."""
    return math.prod(size for size in (getattr(cfg.mesh, a) for a in MESH_AXES) if size > 0)


def _accelerator_plugin() -> str:
    """The name of an installed JAX GPU/TPU plugin ("" if none): with one, JAX may pick an
    accelerator, whose device count no flag changes."""
    if importlib.util.find_spec("libtpu") is not None:
        return "libtpu"
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        for module in pkgutil.iter_modules(spec.submodule_search_locations):
            return module.name
    for entry in importlib.metadata.entry_points(group="jax_plugins"):
        return entry.name
    return ""


def not_cpu_only(env: dict[str, str] | None = None) -> str:
    """Why JAX may run on something other than the CPU in this process ("": CPU only)."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms not in ("", "cpu"):
        return f"JAX_PLATFORMS={platforms} is not CPU-only"
    plugin = "" if platforms == "cpu" else _accelerator_plugin()
    if plugin:
        return f"an accelerator plugin ({plugin}) is installed, so JAX may not run on the CPU (JAX_PLATFORMS=cpu forces it)"
    return ""


def backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # already imported with jax: no start-up cost

    return xla_bridge.backends_are_initialized()


def set_cpu_device_count(cfg: Config, env: dict[str, str] | None = None, notices: list[str] | None = None) -> str:
    """On a CPU-only machine, asks XLA for as many CPU devices as the mesh names (per process), if
    JAX has not started yet and the user's XLA_FLAGS name no count (the processes, set in `dist.*`
    or by `srun`/`mpirun`, share the mesh); one line says so (on process 0), printed, or added to
    `notices` for the caller to print once the run's checks have passed.
    Returns "" when the count is set or not needed, else why it could not be set (for the hint
    of `device_count_hint`)."""
    env = os.environ if env is None else env
    processes, index = process_layout(cfg.dist, env)
    wanted = mesh_device_count(cfg)
    if wanted <= processes or wanted % processes:
        return ""
    local = wanted // processes
    if FORCE_COUNT in env.get("XLA_FLAGS", ""):
        return f"XLA_FLAGS already sets {FORCE_COUNT}, and the user's flag wins"
    why_not = not_cpu_only(env)
    if why_not:
        return why_not
    if backend_started():
        return "JAX had already started in this process"
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), f"{FORCE_COUNT}={local}"]).strip()
    set_cpu_collective_env(local, env)
    if index == 0:
        each = " per process" if processes > 1 else ""
        line = (f"the mesh names {wanted} devices: running {local} CPU devices{each} on this CPU-only machine "
                f"(XLA_FLAGS {FORCE_COUNT}={local}, set by train.py)")
        if notices is None:
            print(line, flush=True)
        else:
            notices.append(line)
    return ""


def device_count_hint(cfg: Config, platform: str, available: int, why_not: str) -> str:
    """What to do when the mesh names another device count than there is, in one clause ("" when
    the sizes themselves are malformed: their own error says enough)."""
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    if any(size == 0 or size < -1 for size in sizes) or sizes.count(-1) > 1:
        return ""
    wanted = mesh_device_count(cfg)
    if platform == "cpu" and wanted > available:
        local = wanted // process_layout(cfg.dist)[0]
        return (f"for {wanted} CPU devices start the process with XLA_FLAGS={FORCE_COUNT}={local}"
                + (f" (train.py sets it itself on a CPU-only machine, but here {why_not})" if why_not else ""))
    return (f"this process sees {available} {platform} device(s): make the mesh sizes multiply to "
            f"{available}, or leave one at -1")


def use_compile_cache(path: str) -> None:
    """Points XLA's persistent compilation cache at `path` ("": leave JAX's own setting, which
    the JAX_COMPILATION_CACHE_DIR variable also controls). Must run before the first compile of
    the process: JAX opens the cache once. Raises ConfigError, creating nothing, for a path that
    cannot be written."""
    if path:
        import jax  # here, not at the top: set_default_flags must be able to run before JAX loads

        check_writable(path, "run.compile_cache")

        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
