"""A mixture-of-experts feed-forward (`model.moe.*`): router, top-k routing, grouped expert matmuls.

Each token's router logits (float32, whatever the compute dtype) pick `experts_per_token` of
`num_experts` SwiGLU experts; the token's output is the weighted sum of theirs (plus, with
`shared_experts`, an always-on SwiGLU). Expert weights are [expert, embed, mlp]-shaped with the
logical dim `expert`, which the rules may shard over the `expert` mesh axis.

Dropless (`capacity_factor` 0): the (token, expert) assignments are sorted by expert and the
experts run as grouped matmuls, every assignment computed: `jax.lax.ragged_dot`, or a kernel the
trainer picks for the platform (`megablox_matmul`, TPU) and binds into the dispatcher. Capacity mode:
each expert takes its first `capacity` assignments in token order; later ones are dropped (their
weight counts 0) and counted, and the experts run as one batched matmul over [expert, capacity]
slots. Under expert parallelism the trainer binds a dispatcher
(`model.kernels`, built in sharding/experts.py) that moves the rows to the experts' devices;
it calls the same `capacity_keep` and `expert_rows` as the local path, so the math is one.

The routing itself (softmax or DeepSeek-V3's sigmoid with its load-steered bias) and the
layer's router statistics (the balance loss, the z-loss, the dropped share, the imbalance, the
bias's load signal: `STATS`) are in model/router.py. They are computed over the whole batch the
layer sees, outside any dispatcher, so they do not depend on the layout.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model import kernels
from model.kernels import Experts
from model.layers import MLP, constrain, param
from model.router import RouterBias, route, router_stats

Array = jax.Array
# (rows [m, k] sorted by group, weights [G, k, n], group sizes [G] int32) -> [m, n]; rows past
# the groups (sum of sizes .. m), and their gradients, may come back as anything: `expert_rows` masks them.
GroupedMatmul = Callable[[Array, Array, Array], Array]
MEGABLOX_TILES = (512, 256, 128)  # the tile sizes megablox_matmul picks from, largest first

def capacity(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Assignments one expert takes from `tokens` tokens (0: unbounded, dropless)."""
    return 0 if factor == 0 else max(1, math.ceil(factor * tokens * k / num_experts))


def capacity_keep(ids: Array, num_experts: int, cap: int) -> Array:
    """ids [a] (assignments in token order) -> kept [a]: the first `cap` of each expert's."""
    if cap == 0:
        return jnp.ones(ids.shape, bool)
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32)  # [a, E]
    rank = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)  # earlier assignments to the same expert
    return rank < cap


def megablox_tile(size: int) -> int:
    """The largest of MEGABLOX_TILES that divides `size` (0: none does)."""
    return next((t for t in MEGABLOX_TILES if size % t == 0), 0)


def megablox_matmul(lhs: Array, rhs: Array, sizes: Array, *, interpret: bool = False) -> Array:
    """`jax.lax.ragged_dot` as the megablox Pallas kernel (TPU; `interpret`: any platform, as
    slow reference code). Its grid visits only the row tiles a group touches, so the work is the
    rows given, not every group over every row. Every dim must be a multiple of 128 (the tiles,
    trainer/layout.py checks the config)."""
    # Imported here: loading Pallas and its TPU kernels costs every other run start-up time.
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    tiles = (megablox_tile(lhs.shape[0]), megablox_tile(lhs.shape[1]), megablox_tile(rhs.shape[2]))
    assert all(tiles), f"megablox tiles of 128 do not divide rows x k x n = {lhs.shape} x {rhs.shape[2]}"
    return gmm(lhs, rhs, sizes.astype(jnp.int32), lhs.dtype, tiles, interpret=interpret)


def expert_rows(rows: Array, ids: Array, experts: Experts, cap: int = 0,
                matmul: GroupedMatmul = jax.lax.ragged_dot) -> Array:
    """rows [m, d], ids [m] in [0, G] (G experts; id G: padding, output 0) -> [m, d]:
    row i through SwiGLU expert ids[i]. Dropless (cap 0): grouped matmuls over the rows sorted
    by expert. cap > 0, when no expert has more than `cap` rows: one batched matmul over
    [G, cap] slots (GShard's layout), so the work is G x cap rows whatever the compiler makes
    of a grouped matmul (XLA's GPU compiler computes every group over every row). `matmul`: the
    dropless grouped matmul."""
    gate, up, down = experts
    groups = gate.shape[0]
    if cap:
        one_hot = jax.nn.one_hot(ids, groups, dtype=jnp.int32)  # padding: a row of zeros
        slot = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
        x = jnp.zeros((groups, cap, rows.shape[-1]), rows.dtype).at[ids, slot].set(rows, mode="drop")
        h = jax.nn.silu(jnp.einsum("gcd,gdf->gcf", x, gate)) * jnp.einsum("gcd,gdf->gcf", x, up)
        y = jnp.einsum("gcf,gfd->gcd", h, down)
        return jnp.where((ids < groups)[:, None], y[jnp.minimum(ids, groups - 1), jnp.minimum(slot, cap - 1)], 0)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=groups + 1)[:groups].astype(jnp.int32)  # padding sorts last, beyond every group
    # Rows past the groups (padding) are 0 going in and out of each matmul, and so are their
    # gradients: a kernel may leave anything there (megablox interpreted leaves NaN), both ways.
    valid = (jnp.arange(rows.shape[0]) < jnp.sum(sizes))[:, None]
    mask = lambda a: jnp.where(valid, a, 0)  # noqa: E731
    x = mask(rows[order])
    h = mask(jax.nn.silu(matmul(x, gate, sizes)) * matmul(x, up, sizes))
    y = mask(matmul(h, down, sizes))
    return jnp.zeros_like(y).at[order].set(y)


def local_dispatch(x: Array, ids: Array, weights: Array, experts: Experts, capacity_factor: float,
                   matmul: GroupedMatmul = jax.lax.ragged_dot) -> tuple[Array, Array]:
    """The dispatcher without expert parallelism: every expert on every device."""
    b, l, d = x.shape
    k, num_experts = ids.shape[-1], experts.gate.shape[0]
    flat = ids.reshape(-1)
    cap = capacity(b * l, num_experts, k, capacity_factor)
    kept = capacity_keep(flat, num_experts, cap)
    rows = jnp.repeat(x.reshape(b * l, d), k, axis=0)  # assignment a is token a // k
    y = expert_rows(rows, jnp.where(kept, flat, num_experts), experts, cap, matmul).reshape(b, l, k, d)
    return combine(y, weights, kept.reshape(ids.shape)), kept.reshape(ids.shape)


def combine(y_blkd: Array, weights: Array, kept: Array) -> Array:
    """Each token's expert outputs [b, l, k, d] weighted (dropped ones 0) and summed -> [b, l, d]."""
    w = jnp.where(kept, weights, 0.0).astype(y_blkd.dtype)
    return jnp.einsum("blkd,blk->bld", y_blkd, w)


class MoE(nnx.Module):
    """Router + `num_experts` SwiGLU experts (+ `shared_experts` always-on ones)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e = cfg.moe
        d, f = cfg.d_model, e.d_ff or cfg.d_ff
        init = nnx.initializers.normal(cfg.init_std)
        self.router = param(rngs, init, (d, e.num_experts), ("embed", None))
        self.gate = param(rngs, init, (e.num_experts, d, f), ("expert", "embed", "mlp"))
        self.up = param(rngs, init, (e.num_experts, d, f), ("expert", "embed", "mlp"))
        self.down = param(rngs, init, (e.num_experts, f, d), ("expert", "mlp", "embed"))
        if e.shared_experts:
            self.shared = MLP(cfg, rngs=rngs, d_ff=e.shared_experts * f)
        if e.router_bias:
            self.router_bias = RouterBias(jnp.zeros((e.num_experts,), jnp.float32), eager_sharding=False,
                                          out_sharding=(None,))
        self.cfg = e

    def __call__(self, x: Array) -> tuple[Array, Array]:
        """x [b, l, d] -> (y [b, l, d], router stats [len(model.router.STATS)] float32)."""
        e, dt = self.cfg, x.dtype
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        logits = constrain(logits, ("batch", "length", None))
        bias = self.router_bias[...] if e.router_bias else None
        ids, weights = route(logits, e, bias)
        dispatch = kernels.current().dispatch or local_dispatch
        experts = Experts(self.gate[...].astype(dt), self.up[...].astype(dt), self.down[...].astype(dt))
        y, kept = dispatch(x, ids, weights, experts, e.capacity_factor)
        if e.shared_experts:
            y = y + self.shared(x)
        return constrain(y, ("batch", "length", "embed")), router_stats(logits, ids, kept, e.router, bias)
