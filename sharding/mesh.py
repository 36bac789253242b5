"""The device mesh from config: axes `pipeline, data, fsdp, tensor` (outermost first).

One size may be -1 and takes the devices left over; the product must equal the device count.
Axes are `Auto` so XLA propagates shardings from the logical-axis constraints (a plain Flax
model does not run under Explicit axes).

A hybrid mesh (`mesh.nodes` > 1) spans several GPU hosts or TPU slices joined by a slower link
(InfiniBand, DCN): `mesh_utils.create_hybrid_device_mesh` lays the devices out so that only the
axis `mesh.across` crosses them and every other axis stays inside one node's fast links.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
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
    if sizes[mesh_cfg.across] % mesh_cfg.nodes:
        raise ConfigError(f"mesh.nodes={mesh_cfg.nodes} does not divide mesh.{mesh_cfg.across}={sizes[mesh_cfg.across]}, "
                          f"the axis that crosses nodes (mesh.across={mesh_cfg.across})")
    return sizes


def node_index(device: jax.Device) -> int:
    """The node a device sits in: its TPU slice, or its process (one process per GPU host)."""
    return device.slice_index if device.platform == "tpu" else device.process_index


def check_nodes(devices: list, nodes: int) -> None:
    """Raises ConfigError unless the devices sit in exactly `nodes` nodes (mesh.nodes > 1)."""
    found = len({node_index(d) for d in devices})
    if nodes > 1 and found != nodes:
        where = "TPU slices" if devices[0].platform == "tpu" else "processes (one per node)"
        raise ConfigError(f"mesh.nodes={nodes}, but the {len(devices)} devices sit in {found} {where}")


def make_mesh(sizes: dict[str, int], devices: list | None = None, nodes: int = 1, across: str = "data") -> Mesh:
    """The mesh of `sizes` over `devices` (default: all). With `nodes` > 1, only the axis
    `across` spans nodes; raises ConfigError if the devices do not sit in that many nodes."""
    devices = jax.devices() if devices is None else devices
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if nodes == 1:
        try:
            return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
        except NotImplementedError:  # a TPU axis that is no product of whole torus dims (8 on 4x4x4)
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
            return Mesh(grid, MESH_AXES, axis_types=axis_types)
    check_nodes(devices, nodes)
    inside = tuple(s // nodes if a == across else s for a, s in zip(MESH_AXES, shape))
    between = tuple(nodes if a == across else 1 for a in MESH_AXES)
    grid = mesh_utils.create_hybrid_device_mesh(inside, between, devices, process_is_granule=devices[0].platform != "tpu",
                                                allow_split_physical_axes=True)
    return Mesh(np.asarray(grid), MESH_AXES, axis_types=axis_types)
