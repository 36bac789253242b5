"""Expert parallelism: the MoE dispatcher that moves routed tokens to their experts' devices.

With `mesh.expert` = P > 1 the expert weights are split over the `expert` mesh axis on their
`expert` dim (each device holds E / P experts) and the batch is split over it too. Under
`shard_map`, each device:
1. takes its tokens' (token, expert) assignments, drops those over capacity (capacity mode:
   `capacity_factor` applies to each device's own tokens), sorts the rest by expert, so each
   destination device's rows are contiguous, and writes them into a send buffer
   [P, R, embed] (R rows per destination: every assignment when dropless, since all of them
   may choose one device; E/P x capacity in capacity mode);
2. all-to-all over `expert`: device j receives the rows for its experts from every device;
3. runs its experts on them as grouped matmuls (model.moe.expert_rows, padding rows masked);
4. all-to-all back, and each token sums its experts' outputs by its router weights.
The routing itself (router, top-k, losses) runs before, in the model, on the global batch.
With P = 1 (any multi-device layout without `mesh.expert`) the all-to-alls move nothing and
each device sorts and computes its own tokens' assignments against all the experts.

Inside the shard_map the expert weights are whole except for their `expert` dim: the
partitioner gathers their FSDP and tensor shards at its boundary, and the devices of a tensor
group compute the same rows (no tensor parallelism inside an expert yet).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from model.kernels import DispatchFn, Experts
from model.moe import GroupedMatmul, capacity, capacity_keep, combine, expert_rows
from sharding.rules import Rules, logical_to_spec, mesh_axes

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Shards:
    """The static half of one device's dispatch: the `expert` mesh axis, how many devices it
    has, the capacity factor and the dropless experts' grouped matmul."""

    axis: str
    shards: int
    capacity_factor: float
    matmul: GroupedMatmul


def _dispatch_local(x: Array, ids: Array, weights: Array, experts: Experts, on: _Shards) -> tuple[Array, Array]:
    """One device's part (inside shard_map): x [b, l, d], ids and weights [b, l, k] local,
    experts this device's (gate/up [E/P, d, f], down [E/P, f, d])."""
    axis, shards = on.axis, on.shards
    b, l, d = x.shape
    k, local = ids.shape[-1], experts.gate.shape[0]
    num_experts = local * shards
    flat = ids.reshape(-1)
    n = flat.shape[0]
    cap = capacity(b * l, num_experts, k, on.capacity_factor)
    kept = capacity_keep(flat, num_experts, cap)
    dest = jnp.where(kept, flat // local, shards)  # `shards`: dropped, written nowhere
    order = jnp.argsort(jnp.where(kept, flat, num_experts), stable=True)
    counts = jnp.bincount(dest, length=shards + 1)[:shards]
    starts = jnp.cumsum(counts) - counts
    slot = jnp.zeros(n, jnp.int32).at[order].set(
        jnp.arange(n, dtype=jnp.int32) - starts[jnp.minimum(dest[order], shards - 1)])
    rows = n if cap == 0 else min(n, local * cap)
    tokens = x.reshape(b * l, d)[jnp.arange(n) // k]
    send = jnp.zeros((shards, rows, d), x.dtype).at[dest, slot].set(tokens, mode="drop")
    send_ids = jnp.full((shards, rows), local, jnp.int32).at[dest, slot].set(flat % local, mode="drop")
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [source device, rows, d]
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)
    # No expert receives more than `cap` rows from each of the `shards` devices.
    y = expert_rows(recv.reshape(shards * rows, d), recv_ids.reshape(-1), experts, shards * cap, on.matmul)
    back = jax.lax.all_to_all(y.reshape(shards, rows, d), axis, 0, 0)  # [destination device, rows, d]
    y = back[jnp.minimum(dest, shards - 1), slot].reshape(b, l, k, d)
    kept = kept.reshape(ids.shape)
    return combine(y, weights, kept), kept


def expert_parallel(rules: Rules, shards: int, matmul: GroupedMatmul = jax.lax.ragged_dot) -> DispatchFn:
    """The MoE dispatcher for `shards` devices on the mesh axis of the `expert` dim (rules: the
    activation rules inside the layer stack, which split `batch` over it too); `matmul`: the
    dropless experts' grouped matmul (a Pallas kernel runs per device here, as it must)."""
    axis = mesh_axes("expert", rules)
    assert len(axis) == 1, f"the expert dim must map to one mesh axis, got {axis}"
    x_spec = logical_to_spec(("batch", "length", "embed"), rules)
    route_spec = logical_to_spec(("batch", "length", None), rules)
    w_spec = PartitionSpec(axis[0])

    def dispatch(x: Array, ids: Array, weights: Array, experts: Experts, capacity_factor: float) -> tuple[Array, Array]:
        fn = functools.partial(_dispatch_local, on=_Shards(axis[0], shards, capacity_factor, matmul))
        # check_vma off, as for the sequence split's kernels (sharding/context.py): under the
        # pipeline's vmap the stage axis joins some operands' varying axes and not others'.
        return jax.shard_map(fn, in_specs=(x_spec, route_spec, route_spec, Experts(w_spec, w_spec, w_spec)),
                             out_specs=(x_spec, route_spec), check_vma=False)(x, ids, weights, experts)

    return dispatch
