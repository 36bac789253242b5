"""Mesh from config, logical->mesh rules as data, and the shardings that follow from them."""

from sharding.mesh import make_mesh, resolve_mesh_shape
from sharding.rules import (
    Rules,
    activation_rules,
    axes_size,
    batch_sharding,
    logical_axes,
    logical_to_spec,
    mesh_axes,
    shardings,
    stored_rules,
    to_rules,
    with_axis,
)

__all__ = [
    "Rules",
    "activation_rules",
    "axes_size",
    "batch_sharding",
    "logical_axes",
    "logical_to_spec",
    "make_mesh",
    "mesh_axes",
    "resolve_mesh_shape",
    "shardings",
    "stored_rules",
    "to_rules",
    "with_axis",
]
