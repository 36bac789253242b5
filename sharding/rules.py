"""Logical-axis -> mesh-axis rules, as data, and what follows from them.

The config holds two tables (`sharding.params`, `sharding.activations`): stored parameters and
activations may map the same logical name differently (FSDP shards the parameters' `embed`
dim, never the activations'). A mesh axis is used at most once per array: the rules are taken
in table order (as Flax takes them), and a rule whose axes are already used leaves its dim whole.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec


Rules = tuple[tuple[str, Any], ...]

def to_rules(table: dict[str, Any]) -> Rules:
    """Config table {logical: axis | [axes] | None} -> Flax's ((logical, axes), ...) form."""
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in table.items())


def with_axis(rules: Rules, name: str, axis: str) -> Rules:
    """`rules` with `axis` appended to the mesh axes of the logical `name`."""
    return tuple((logical, as_axes(entry) + (axis,) if logical == name else entry) for logical, entry in rules)


def with_fallback_axis(rules: Rules, name: str, axis: str) -> Rules:
    """`rules` with each rule of the logical `name` tried first with `axis` appended, then as it
    was: an array whose other dims have already claimed `axis` falls back to the rule as given
    (Flax takes the first rule whose axes are all free). A rule already naming `axis` stays alone."""
    out: list[tuple[str, Any]] = []
    for logical, entry in rules:
        if logical == name and axis not in as_axes(entry):
            out.append((logical, as_axes(entry) + (axis,)))
        out.append((logical, entry))
    return tuple(out)


def stored_rules(table: dict[str, Any], sizes: dict[str, int]) -> Rules:
    """The rules of stored parameters (`sharding.params`) on a mesh of `sizes`. The devices of a
    context group hold different positions of the same rows, and those of an expert group
    different experts but the same weights outside them: what they would each hold whole is
    split over them as well, FSDP-style, on the `embed` dim. The experts' own weights, whose
    `expert` dim comes first in the table and takes the expert axis, keep the rule as given."""
    rules = to_rules(table)
    if sizes.get("context", 1) > 1:
        rules = with_axis(rules, "embed", "context")
    if sizes.get("expert", 1) > 1:
        rules = with_fallback_axis(rules, "embed", "expert")
    return rules


def logical_to_spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(axes), rules)


def logical_axes(abstract_state: nnx.State) -> dict:
    """Pure dict of the logical axis names each parameter was annotated with."""
    specs = nnx.get_partition_spec(abstract_state)  # no rules in context: the names themselves
    return nnx.to_pure_dict(jax.tree.map(lambda s: tuple(s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))


def mesh_axes(logical: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes `rules` map a logical name to, outermost first; () when it stays whole."""
    return as_axes(logical_to_spec((logical,), rules)[0])


def axes_size(axes: str | Sequence[str] | None, sizes: dict[str, int]) -> int:
    """How many shards a dim split over `axes` (one PartitionSpec entry) has: their sizes' product."""
    return math.prod(sizes[a] for a in as_axes(axes))


def as_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, one axis name, or several) as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def shardings(axes: dict, rules: Rules, mesh: Mesh) -> dict:
    """Pure dict of NamedShardings from the logical names and the rules."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, logical_to_spec(names, rules)),
        axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] input: the batch dim over the mesh axes the rules give it."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """The context under which the model is traced: its logical constraints bind to `mesh`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
