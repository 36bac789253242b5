"""Devices of hardware this host does not have, from that hardware's own compiler.

XLA's GPU compiler (the `jax-cuda12-plugin` + `jax-cuda12-pjrt` wheels, given a GPU target
description from planner/gpu_specs/) and the TPU compiler (`libtpu`) both run on a CPU-only
host: `jax.experimental.topologies.get_topology_desc` hands out devices of the target, a mesh
is built on them, and `jit(...).lower(...).compile()` emits the real program (sm_90 code, TPU
bundles) with its real memory figures and collectives. No driver, no device.

The compilers live outside the virtual environment's site-packages, in `<venv>/compilers`
(`make test` installs them there; `MESHLM_COMPILERS` names another folder). Only the planner's
compiling child process puts that folder on its path, so `train.py` and every other CPU run
never load the plugins: no plugin warnings, no slower start. A compiler found on the ordinary
path (a TPU VM's libtpu, say) is used as well.

    python -m planner.targets --requirements   # the wheels, pinned to the installed jax
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import sys

from configs.schema import ConfigError
from sharding.hardware import Hardware

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
# libtpu's accelerator names, one per generation: they only quiet its start-up log here.
_TPU_ACCELERATOR = {"v5e": "v5litepod-4", "v5p": "v5p-8", "v6e": "v6e-4"}


def compilers_dir() -> str:
    return os.environ.get("MESHLM_COMPILERS") or os.path.join(sys.prefix, "compilers")


def requirements() -> list[str]:
    """The compiler wheels at the versions the installed jax pins (its `cuda12-local` and `tpu` extras)."""
    jax_version = importlib.metadata.version("jax")
    tpu = [r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or [] if r.startswith("libtpu")]
    return [f"jax-cuda12-plugin=={jax_version}", f"jax-cuda12-pjrt=={jax_version}", *tpu]


def _findable(*parts: str) -> bool:
    return any(os.path.exists(os.path.join(p, *parts)) for p in [compilers_dir(), *sys.path] if p)


def has_compiler(hw: Hardware) -> bool:
    """Whether `hw`'s own compiler can be loaded by a child process (without loading it here)."""
    if hw.platform == "cuda":
        return _findable("jax_plugins", "xla_cuda12", "xla_cuda_plugin.so") and _findable("jax_cuda12_plugin")
    return _findable("libtpu")


def compiler_name(hw: Hardware | None) -> str:
    """What the plan says produced it."""
    if hw is None:
        return "XLA CPU compiler on fake CPU devices (fallback: no GPU/TPU figure is real)"
    if hw.platform == "cuda":
        return f"XLA GPU compiler (CUDA plugin {importlib.metadata.version('jax')}, target {hw.spec})"
    return f"TPU compiler (libtpu, {hw.spec})"


def child_env(hw: Hardware | None, env: dict[str, str]) -> dict[str, str]:
    """The environment of a process that compiles for `hw` (None: fake CPU devices)."""
    env = dict(env, JAX_PLATFORMS="cpu")  # the host's own backend stays the CPU; targets come from topologies
    if hw is None:
        return env
    env["PYTHONPATH"] = os.pathsep.join(p for p in (compilers_dir(), env.get("PYTHONPATH", "")) if p)
    if hw.platform == "tpu":
        env.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_WORKER_HOSTNAMES="localhost",
                   TPU_ACCELERATOR_TYPE=_TPU_ACCELERATOR.get(hw.spec, "v5litepod-4"))
    return env


def tpu_slice_shape(hw: Hardware, chips: int) -> str:
    """The slice shape libtpu names for `chips` chips: the most nearly cubic (v5p) or square
    (v5e, v6e) shape of powers of two, e.g. v5p 64 -> 4x4x4, v6e 256 -> 16x16."""
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(f"--devices: a TPU {hw.spec} slice has a power-of-two number of chips, got {chips}; "
                          "pass --topology")
    dims = [1] * hw.torus_dims
    for _ in range(int(math.log2(chips))):
        dims[dims.index(min(dims))] *= 2
    # libtpu names a slice with a dimension of 1 last ("2x2x1", the v5p host), others ascending.
    return "x".join(str(d) for d in sorted(dims, reverse=1 in dims and hw.torus_dims == 3 and chips > 1))


def tpu_wraparound(hw: Hardware, shape: str) -> tuple[bool, bool, bool]:
    """Which dims of a `shape` slice have wraparound links, as the real slice has them: every dim
    of a v4/v5p slice of whole 4x4x4 cubes (smaller slices are open meshes), and each full-pod
    dim (16) of a v5e/v6e slice. libtpu's torus collectives (an all-gather on the major dim)
    need them; told of none, it writes every gather over a whole torus as an all-reduce."""
    dims = [int(d) for d in shape.split("x")]
    if hw.torus_dims == 3:
        cubes = len(dims) == 3 and all(d >= 4 and d % 4 == 0 for d in dims)
        return (cubes,) * 3
    edge = [d == 16 for d in dims] + [False] * (3 - len(dims))
    return edge[0], edge[1], edge[2]


def gpu_spec(hw: Hardware) -> str:
    with open(os.path.join(SPECS_DIR, hw.spec)) as f:
        return f.read()


def dnn_version(spec_text: str) -> int:
    """cuDNN's integer version (9.8.0 -> 90800) from a target description's dnn_version_info."""
    block = re.search(r"dnn_version_info\s*\{([^}]*)\}", spec_text)
    fields = {k: int(v) for k, v in re.findall(r"(major|minor|patch):\s*(\d+)", block.group(1) if block else "")}
    return fields.get("major", 0) * 10000 + fields.get("minor", 0) * 100 + fields.get("patch", 0)


def target_devices(hw: Hardware, n: int, slices: int = 1, topology: str = "") -> list:
    """`n` devices of `hw` from its compiler (call only in the compiling child process).

    GPU: nodes of `devices_per_node` GPUs (fewer GPUs: one node). TPU: `slices` slices of
    n / slices chips each, shaped by `topology` or by tpu_slice_shape."""
    from jax.experimental import topologies

    if hw.platform == "cuda":
        per_node = min(n, hw.devices_per_node)
        if n % per_node:
            raise ConfigError(f"--devices={n}: GPUs come in nodes of {hw.devices_per_node}")
        spec = gpu_spec(hw)
        _answer_cudnn_questions(dnn_version(spec), compute_capability(spec))
        return list(topologies.get_topology_desc(hw.name, "cuda", target_config=spec,
                                                 topology=f"1x{n // per_node}x{per_node}").devices)
    if n % slices:
        raise ConfigError(f"--devices={n} is not divisible by {slices} slices")
    shape = topology or tpu_slice_shape(hw, n // slices)
    devices = list(topologies.get_topology_desc(topology_name=f"{hw.spec}:{shape}", platform="tpu",
                                                num_slices=slices, wrap=tpu_wraparound(hw, shape)).devices)
    if len(devices) != n:
        raise ConfigError(f"--topology={shape}: {slices} slice(s) of it hold {len(devices)} chips, not --devices={n}")
    return devices


def compute_capability(spec_text: str) -> tuple[int, int]:
    """(major, minor) of a target description's cuda_compute_capability."""
    block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", spec_text)
    fields = {k: int(v) for k, v in re.findall(r"(major|minor):\s*(\d+)", block.group(1) if block else "")}
    return fields.get("major", 0), fields.get("minor", 0)


def _answer_cudnn_questions(version: int, capability: tuple[int, int]) -> None:
    """JAX asks the cuDNN library for its version, and the local GPU for its compute capability
    (cuDNN's packed documents need a Hopper), while tracing cuDNN attention; with no GPU there is
    nothing to ask. The target description states both, so the questions are answered from it
    instead of installing a 1 GB cuDNN wheel that would only say its own version (not the
    target's). Private JAX API: checked against jax 0.10-0.11."""
    from jax._src.cudnn import fused_attention_stablehlo

    def at_least(wanted: str) -> bool:
        return capability >= tuple(int(x) for x in wanted.split("."))

    fused_attention_stablehlo.check_cudnn_version = lambda: version
    fused_attention_stablehlo.check_compute_capability = at_least
    fused_attention_stablehlo.is_cuda_compute_capability_equal = lambda wanted: capability == tuple(
        int(x) for x in wanted.split("."))


def node_of(devices: list, hw: Hardware | None, fallback_per_node: int) -> list[int]:
    """The node (GPU host, TPU slice) of each device, in the order given."""
    if hw is not None and hw.platform == "tpu":
        return [getattr(d, "slice_index", 0) for d in devices]
    if hw is not None:
        return [d.process_index for d in devices]
    return [i // fallback_per_node for i in range(len(devices))]


if __name__ == "__main__":
    if sys.argv[1:] == ["--requirements"]:
        print(" ".join(requirements()))
    else:
        sys.exit("usage: python -m planner.targets --requirements")
