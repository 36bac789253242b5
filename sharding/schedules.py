"""The 1F1B pipeline schedule: explicit ticks, each stage's backward by hand, activations bounded.

GPipe (sharding/pipeline.py) is the autodiff of a forward scan: every microbatch's activations
live until the backward pass starts, so memory grows with the number of microbatches M. In 1F1B
the forward of one microbatch and the backward of an earlier one share a tick, which autodiff of
a forward scan cannot express; so this module writes the ticks itself and computes the loss and
every gradient by hand: the step calls it instead of differentiating a loss.

How, and why this way:
- Lockstep ticks, as in the GPipe runner: all stages run at once as a `vmap` over the stage dim
  (sharded over `pipeline` by `spmd_axis_name`, so each device computes only its stage), and
  activations and gradients move between neighbours with `jnp.roll` (a collective-permute).
  The partitioner keeps doing `fsdp`, `tensor` and `data` inside a stage from the same logical
  constraints; `shard_map` with `ppermute` would make `pipeline` manual and need the other axes'
  collectives written out inside the stage (or a partially manual mesh), for no gain here.
- A stage's backward is `jax.vjp` of its forward, recomputed from the stage's stashed *input*:
  the stash holds one [microbatch, length, embed] activation per microbatch in flight, the
  smallest state a microbatch can leave behind (the cost is one more stage forward per
  microbatch, what the `full` remat policy pays anyway). Parameter gradients add up in float32.
- Three scans: warm-up (S - 1 ticks, forwards only), steady (M ticks, one forward and one
  backward per stage) and cool-down (S - 1 ticks, backwards only). Stage s runs the forward of
  microbatch t - s and the backward of microbatch t - (2S - 2 - s) at tick t; the last stage
  feeds each microbatch it finishes through the head and loss in the same tick and starts its
  backward at once. Stage s therefore holds at most 2(S - 1 - s) + 1 microbatches (the round
  trip to the last stage and back, one tick per hop), whatever M: the stash has 2S - 1 slots.
  Time: (S - 1) F + M (F + B) + (S - 1) B = (M + S - 1)(F + B), GPipe's bubble,
  (S - 1) / (M + S - 1), at a memory that no longer grows with M.
- The embedding runs where a microbatch enters (before stage 0) and the head and loss where it
  leaves (after stage S - 1), outside the stage `vmap`: every pipeline device computes them for
  one microbatch per tick (the head's share of the step is small next to the layers').
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from sharding.rules import Rules

Array = jax.Array
Micro = dict[str, Array]  # one microbatch's inputs; with a leading [M] dim: all of them
EmbedFn = Callable[[Any, Micro], Array]  # (outer params, microbatch) -> x [mb, length, embed]
StageFn = Callable[[Any, Array, Micro], Array]  # (one stage's layer params, x, microbatch) -> x
HeadFn = Callable[[Any, Array, Micro], tuple[Array, Array]]  # (outer, x, microbatch) -> (loss sum, targets)


def _pin_stages(a: Array) -> Array:
    """Pins the leading stage dim of a carry to `pipeline`, the rest to what the partitioner picks."""
    spec = PartitionSpec("pipeline", *([PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))
    return jax.lax.with_sharding_constraint(a, spec)


def _per_stage(mask: Array, a: Array) -> Array:
    """mask [S] broadcast against a [S, ...] array."""
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))


def one_f_one_b(
    stages: int,
    embed_fn: EmbedFn,
    stage_fn: StageFn,
    head_fn: HeadFn,
    outer: Any,
    staged: Any,
    micro: Micro,
    stage_rules: Rules,
) -> tuple[tuple[Array, Array], tuple[Any, Any]]:
    """((loss sum, target count), (gradients of `outer`, gradients of `staged`)) over all M
    microbatches of `micro` (leaves [M, mb, ...]) under the 1F1B schedule.

    `staged` holds the layer stack as [S, K, ...] (stage s: layers [sK, (s+1)K)), sharded over
    `pipeline` along its first dim; `outer` holds every other parameter. Gradients come back in
    float32, with the trees and shapes of `outer` and `staged`."""
    S = stages
    M = jax.tree.leaves(micro)[0].shape[0]
    W = 2 * S - 1  # stash slots: the most microbatches a stage (stage 0) holds at once
    ids = jnp.arange(S)
    pick = lambda m: jax.tree.map(lambda a: a[jnp.clip(m, 0, M - 1)], micro)  # noqa: E731 one [mb] or per-stage [S, mb]

    def backward(p: Any, x: Array, mb: Micro, g: Array) -> tuple[Any, Array]:
        _, vjp = jax.vjp(lambda p, x: stage_fn(p, x, mb), p, x)
        return vjp(g)

    forward_all = jax.vmap(stage_fn, spmd_axis_name="pipeline")
    backward_all = jax.vmap(backward, spmd_axis_name="pipeline")
    stash_put = jax.vmap(
        lambda st, x, i, on: jax.lax.dynamic_update_index_in_dim(
            st, jnp.where(on, x, jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False)), i, 0
        ),
        spmd_axis_name="pipeline",
    )
    stash_get = jax.vmap(lambda st, i: jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False), spmd_axis_name="pipeline")
    add = lambda acc, g: acc + g.astype(jnp.float32)  # noqa: E731

    def tick(carry: dict, t: Array, forward: bool, backward: bool) -> tuple[dict, None]:
        c = dict(carry)
        if forward:
            m_f = t - ids  # each stage's forward microbatch
            on_f = (m_f >= 0) & (m_f < M)
            inp = c["fwd"].at[0].set(embed_fn(outer, pick(t)))
            c["stash"] = stash_put(c["stash"], inp, m_f % W, on_f)
            out = forward_all(staged, inp, pick(m_f))
            c["fwd"] = jnp.roll(out, 1, axis=0)
        if forward and backward:  # the last stage's microbatch t - (S - 1) leaves through the head
            done = pick(t - (S - 1))
            total, head_vjp, count = jax.vjp(lambda o, h: head_fn(o, h, done), outer, out[S - 1], has_aux=True)
            g_outer, g_x = head_vjp(jnp.ones_like(total))
            c["loss"], c["count"] = c["loss"] + total, c["count"] + count
            c["g_outer"] = jax.tree.map(add, c["g_outer"], g_outer)
            c["bwd"] = c["bwd"].at[S - 1].set(g_x)
        if backward:
            m_b = t - (2 * S - 2) + ids  # each stage's backward microbatch
            on_b = (m_b >= 0) & (m_b < M)
            g_p, g_in = backward_all(staged, stash_get(c["stash"], m_b % W), pick(m_b), c["bwd"])
            c["g_staged"] = jax.tree.map(
                lambda acc, g: acc + jnp.where(_per_stage(on_b, g), g, 0).astype(jnp.float32), c["g_staged"], g_p
            )
            _, embed_vjp = jax.vjp(lambda o: embed_fn(o, pick(m_b[0])), outer)
            (g_embed,) = embed_vjp(g_in[0])
            c["g_outer"] = jax.tree.map(lambda acc, g: acc + jnp.where(on_b[0], g, 0).astype(jnp.float32),
                                        c["g_outer"], g_embed)
            c["bwd"] = jnp.roll(g_in, -1, axis=0)  # stage s takes the input gradient of stage s + 1
        return c, None

    with nn.logical_axis_rules(stage_rules):
        x_shape = jax.eval_shape(embed_fn, outer, pick(0))
        acts = _pin_stages(jnp.zeros((S,) + x_shape.shape, x_shape.dtype))
        f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
        carry = {
            "fwd": acts,
            "bwd": acts,
            "stash": _pin_stages(jnp.zeros((S, W) + x_shape.shape, x_shape.dtype)),
            "loss": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.float32),
            "g_outer": f32_zeros(outer),
            "g_staged": jax.tree.map(_pin_stages, f32_zeros(staged)),
        }
        for first, last, fwd, bwd in [(0, S - 1, True, False), (S - 1, M + S - 1, True, True),
                                      (M + S - 1, M + 2 * S - 2, False, True)]:
            body = lambda c, t, fwd=fwd, bwd=bwd: tick(c, t, fwd, bwd)  # noqa: E731
            carry, _ = jax.lax.scan(body, carry, jnp.arange(first, last))
    return (carry["loss"], carry["count"]), (carry["g_outer"], carry["g_staged"])

