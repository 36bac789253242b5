"""The device mesh from config: axes `pipeline, data, fsdp, tensor` (outermost first).

One size may be -1 and takes the devices left over; the product must equal the device count.
Axes are `Auto` so XLA propagates shardings from the logical-axis constraints (a plain Flax
model does not run under Explicit axes; see JAX-NOTES).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh

from configs.schema import MESH_AXES, ConfigError, MeshConfig


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis name -> size, with the -1 filled in. Raises ConfigError naming the key."""
    sizes = {axis: getattr(mesh_cfg, axis) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}: must be a positive size or -1, got {size}")
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in free)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.{free[0]}=-1: the other axes' product {fixed} does not divide the {num_devices} devices"
            )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(f"mesh: {shape} = {total} devices, but {num_devices} are available")
    return sizes


def make_mesh(sizes: dict[str, int], devices: list | None = None) -> Mesh:
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
