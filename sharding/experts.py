"""Expert parallelism: the MoE dispatcher that moves routed tokens to their experts' devices.

With `mesh.expert` = P > 1 the expert weights are split over the `expert` mesh axis on their
`expert` dim (each device holds E / P experts) and the batch is split over it too. Under
`shard_map`, each device:
1. takes its tokens' (token, expert) assignments, drops those over capacity (capacity mode:
   `capacity_factor` applies to each device's own tokens) and sorts the rest by expert, so each
   destination device's rows are contiguous;
2. sends each device the rows for its experts. `model.moe.dispatch=ragged` (auto's choice on TPU
   and GPU) sends only those rows, each device's slice at its own length (a ragged all-to-all,
   sharding/ragged.py; a small all-gather of every device's per-expert counts first tells each
   where its slices land and what it receives). `dense` writes them into a buffer padded to the
   worst case, [P, R, embed] (R: every assignment when dropless, since all of them may choose one
   device; E/P x capacity in capacity mode), and all-to-alls it whole, whatever the routing;
3. runs its experts on what it received as grouped matmuls (model.moe.expert_rows, padding rows
   masked); both ways hold the same worst-case receive buffer, P x R rows;
4. sends the outputs back the same way, and each token sums its experts' outputs by its router weights.
The routing itself (router, top-k, losses) runs before, in the model, on the global batch.
With P = 1 (any multi-device layout without `mesh.expert`) nothing moves and each device sorts
and computes its own tokens' assignments against all the experts.

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
from sharding.ragged import Slices, exchange
from sharding.rules import Rules, logical_to_spec, mesh_axes

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Shards:
    """The static half of one device's dispatch: the `expert` mesh axis, how many devices it
    has, the capacity factor, the dropless experts' grouped matmul and how the rows move
    (`expert_parallel`'s `ragged`)."""

    axis: str
    shards: int
    capacity_factor: float
    matmul: GroupedMatmul
    ragged: str = ""


def _dispatch_local(x: Array, ids: Array, weights: Array, experts: Experts, on: _Shards) -> tuple[Array, Array]:
    """One device's part (inside shard_map): x [b, l, d], ids and weights [b, l, k] local,
    experts this device's (gate/up [E/P, d, f], down [E/P, f, d])."""
    b, l, d = x.shape
    k, local = ids.shape[-1], experts.gate.shape[0]
    num_experts = local * on.shards
    flat = ids.reshape(-1)
    cap = capacity(b * l, num_experts, k, on.capacity_factor)
    kept = capacity_keep(flat, num_experts, cap)
    tokens = x.reshape(b * l, d)[jnp.arange(flat.shape[0]) // k]  # assignment a is token a // k
    move = _ragged if on.ragged else _dense
    y = move(tokens, jnp.where(kept, flat, num_experts), experts, cap, on).reshape(b, l, k, d)
    kept = kept.reshape(ids.shape)
    return combine(y, weights, kept), kept


def _rows_from_each(n: int, local: int, cap: int) -> int:
    """The most rows one device can receive from each device, which both ways of moving them
    size their receive buffer by: all of a source's n assignments when dropless, at most its local
    experts' capacities otherwise."""
    return n if cap == 0 else min(n, local * cap)


def _dense(tokens: Array, key: Array, experts: Experts, cap: int, on: _Shards) -> Array:
    """Each assignment's expert output, the rows moved in buffers padded to the worst case: tokens
    [n, d], key [n] its global expert (E: dropped)."""
    axis, shards, local = on.axis, on.shards, experts.gate.shape[0]
    n, d = tokens.shape
    dest = key // local  # `shards`: dropped, written nowhere
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(dest, length=shards + 1)[:shards]
    starts = jnp.cumsum(counts) - counts
    slot = jnp.zeros(n, jnp.int32).at[order].set(
        jnp.arange(n, dtype=jnp.int32) - starts[jnp.minimum(dest[order], shards - 1)])
    rows = _rows_from_each(n, local, cap)
    send = jnp.zeros((shards, rows, d), tokens.dtype).at[dest, slot].set(tokens, mode="drop")
    send_ids = jnp.full((shards, rows), local, jnp.int32).at[dest, slot].set(key % local, mode="drop")
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [source device, rows, d]
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)
    # No expert receives more than `cap` rows from each of the `shards` devices.
    y = expert_rows(recv.reshape(shards * rows, d), recv_ids.reshape(-1), experts, shards * cap, on.matmul)
    back = jax.lax.all_to_all(y.reshape(shards, rows, d), axis, 0, 0)  # [destination device, rows, d]
    return back[jnp.minimum(dest, shards - 1), slot]


def _ragged(tokens: Array, key: Array, experts: Experts, cap: int, on: _Shards) -> Array:
    """As `_dense`, moving only the routed rows: the assignments sorted by expert (so by device),
    each device's slice sent at its own length. Every device learns every other's per-expert
    counts (one small all-gather), from which it knows where its slices land, how many rows it
    receives, and which of its experts each received row is for; the outputs go back the same way."""
    axis, shards, local = on.axis, on.shards, experts.gate.shape[0]
    n, d = tokens.shape
    order = jnp.argsort(key, stable=True)
    per_expert = jnp.bincount(key, length=local * shards + 1)[:-1].astype(jnp.int32)
    table = jax.lax.all_gather(per_expert, axis).reshape(shards, shards, local)  # [source, device, expert]
    me = jax.lax.axis_index(axis)
    rows = table.sum(-1)  # [source, device]
    sent_before = jnp.cumsum(rows, axis=1) - rows  # where a source's slice for each device starts in its sorted rows
    landed_before = jnp.cumsum(rows, axis=0) - rows  # where a source's slice starts in each device's buffer
    there = Slices(sent_before[me], rows[me], landed_before[me], rows[:, me])
    buffer = shards * _rows_from_each(n, local, cap)
    native = on.ragged == "native"
    recv = exchange(tokens[order], jnp.zeros((buffer, d), tokens.dtype), there, axis, native)
    # The buffer holds the sources' slices in order, each sorted by expert: segment (source, expert).
    ends = jnp.cumsum(table[:, me].reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(buffer), side="right")
    recv_ids = jnp.where(segment < shards * local, segment % local, local)
    y = expert_rows(recv, recv_ids, experts, shards * cap, on.matmul)
    back_slices = Slices(landed_before[:, me], rows[:, me], sent_before[:, me], rows[me])
    back = exchange(y, jnp.zeros((n, d), y.dtype), back_slices, axis, native)
    return jnp.zeros_like(back).at[order].set(back)  # dropped assignments sort last and get no rows back


def expert_parallel(rules: Rules, shards: int, matmul: GroupedMatmul = jax.lax.ragged_dot,
                    ragged: str = "") -> DispatchFn:
    """The MoE dispatcher for `shards` devices on the mesh axis of the `expert` dim (rules: the
    activation rules inside the layer stack, which split `batch` over it too); `matmul`: the
    dropless experts' grouped matmul (a Pallas kernel runs per device here, as it must).
    `ragged`: "" moves padded buffers; "native" only the routed rows by the platform's ragged
    all-to-all; "emulated" the same with the exchange built from a dense one (CPU devices)."""
    axis = mesh_axes("expert", rules)
    assert len(axis) == 1, f"the expert dim must map to one mesh axis, got {axis}"
    x_spec = logical_to_spec(("batch", "length", "embed"), rules)
    route_spec = logical_to_spec(("batch", "length", None), rules)
    w_spec = PartitionSpec(axis[0])

    def dispatch(x: Array, ids: Array, weights: Array, experts: Experts, capacity_factor: float) -> tuple[Array, Array]:
        fn = functools.partial(_dispatch_local, on=_Shards(axis[0], shards, capacity_factor, matmul, ragged))
        # check_vma off, as for the sequence split's kernels (sharding/context.py): under the
        # pipeline's vmap the stage axis joins some operands' varying axes and not others'.
        return jax.shard_map(fn, in_specs=(x_spec, route_spec, route_spec, Experts(w_spec, w_spec, w_spec)),
                             out_specs=(x_spec, route_spec), check_vma=False)(x, ids, weights, experts)

    return dispatch
