"""The embedding lookup of a layout whose stored table splits its `embed` dim (FSDP).

Left to the partitioner, the lookup either gathers the whole table first (its bytes, and its
whole gradient reduced again, on every step) or, with the table kept as stored, rematerializes
the looked-up rows in full when the batch is also split over other axes than the table's (data
x fsdp, with or without tensor: "Involuntary full rematerialization"). Stated in three
constraints it does what MaxText's does: the tokens (small integers) are gathered over the
table's `embed` axes, each device looks up its own slice of `embed` for them, and an all-to-all
trades the rows back to the batch split. The vocab split (tensor) is gathered first, so the
lookup never needs a masked gather and an all-reduce of the rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from model.kernels import LookupFn
from sharding.rules import Rules, axes_size, mesh_axes

Array = jax.Array


def traded_lookup(param_rules: Rules, act_rules: Rules, sizes: dict[str, int]) -> LookupFn | None:
    """(table [vocab, embed], tokens [batch, length]) -> rows [batch, length, embed], split as
    `act_rules` split activations; None (the model's own lookup) when the stored table keeps
    its `embed` dim whole on this mesh, or the activations split their `length`."""
    embed = tuple(a for a in mesh_axes("embed", param_rules) if sizes[a] > 1)
    # Under a sequence split the partitioner cannot trade the rows back (it rematerializes them).
    if axes_size(embed, sizes) == 1 or axes_size(mesh_axes("length", act_rules), sizes) > 1:
        return None

    def without_embed(logical: str) -> tuple[str, ...] | None:
        axes = tuple(a for a in mesh_axes(logical, act_rules) if a not in embed)
        return axes or None

    batch, length = without_embed("batch"), without_embed("length")

    def lookup(table: Array, tokens: Array) -> Array:
        table = jax.lax.with_sharding_constraint(table, PartitionSpec(None, embed))
        tokens = jax.lax.with_sharding_constraint(tokens, PartitionSpec(batch, length))
        rows = jnp.take(table, tokens, axis=0)
        return jax.lax.with_sharding_constraint(rows, PartitionSpec(batch, length, embed))

    return lookup
