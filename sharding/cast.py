"""Parameters in the compute dtype, cast while still sharded.

Parameters are stored in float32 and the model casts each weight to the compute dtype where it
uses it. Left to the partitioner, that cast can land after the FSDP all-gather (the CPU
compiler does this for every weight, and every compiler for the embedding table, whose lookup
wants it whole), so the gather moves float32: twice the bytes. Casting each matmul weight
first and pinning the cast copy to the parameter's own (stored) sharding puts the gather after
the cast, and, by transposition, the gradient's reduce-scatter before the cast back to float32:
both move the compute dtype, on every compiler. Norm scales (one vector per layer) stay
float32: they are tiny, and their statistics are kept in float32 on purpose; so does the MoE
router ([embed, None]: one sharded dim), whose logits and top-k are float32 math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def is_matmul_weight(names: tuple[str | None, ...]) -> bool:
    """A weight with two or more named dims besides the stacked `layers` dim (norm scales have
    one; the MoE router names only its `embed` dim)."""
    return sum(n not in ("layers", None) for n in names) >= 2


def cast_for_compute(params: dict, axes: dict, dtype: str, shardings: dict) -> dict:
    """`params` with every matmul weight cast to `dtype` and pinned to its stored sharding."""
    target = jnp.dtype(dtype)

    def cast(p: jax.Array, names: tuple, sharding: NamedSharding) -> jax.Array:
        if p.dtype == target or not is_matmul_weight(names):
            return p
        return jax.lax.with_sharding_constraint(p.astype(target), sharding)

    return jax.tree.map(cast, params, axes, shardings)
