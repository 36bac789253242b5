"""Pipeline parallelism as a layer runner: GPipe and circular schedules on the `pipeline` axis.

The layer stack is stored in one canonical shape, [num_layers, ...], sharded over `pipeline`
along the layer dim, so checkpoints do not depend on the pipeline layout. At run time, inside
the jitted step, the runner views it as [stages, repeats, layers_per_group, ...]: stage s holds
the layer groups s, S + s, 2S + s, ... (group g = layers [g*K, (g+1)*K)). With one repeat this
view is free (each device already holds its contiguous block); with several repeats XLA moves
the groups to their stages once per step, like an FSDP gather of the layer weights.

The schedule is one `lax.scan` over R*M + S - 1 ticks (S stages, R repeats, M microbatches).
At tick t, stage s works on virtual microbatch v = t - s: microbatch v mod M, repeat v div M.
All stages run at once as a `vmap` over the stage dim (sharded over `pipeline`, so each device
computes only its own stage), then the outputs shift one stage up with `jnp.roll`, which XLA
lowers to a collective-permute between neighbouring devices. Stage 0 takes a fresh microbatch
in the first repeat and, in later repeats, the last stage's output for that microbatch from the
previous repeat (kept in a buffer: M >= S makes it ready in time). Autodiff through the scan
gives the backward pass: all forwards, then all backwards (GPipe), per repeat interleaved.
The layers' router statistics (MoE) are summed over the stages' real work (a stage idling in
the bubble computes on zeros; its statistics are masked out) and averaged over microbatches.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec

from model.moe import STATS
from sharding.rules import Rules
from sharding.ticks import COSTS

Array = jax.Array
# (sub-stack, x, positions, segment_ids) -> (x, router statistics summed over the sub-stack)
StageFn = Callable[[nnx.Module, Array, Array, "Array | None"], tuple[Array, Array]]


def bubble_fraction(stages: int, repeats: int, microbatches: int, schedule: str = "gpipe") -> float:
    """Idle share of the schedule: (S - 1) / (R * M + S - 1), or for zero_bubble
    (S - 1)(F + B) / ((M + S - 1)(F + B) + M W) with sharding/ticks.py's costs (F 1, B 2, W 3)."""
    S, R, M = stages, repeats, microbatches
    if schedule == "zero_bubble":
        c = COSTS["zero_bubble"]
        return (S - 1) * (c["F"] + c["B"]) / ((M + S - 1) * (c["F"] + c["B"]) + M * c["W"])
    return (S - 1) / (R * M + S - 1)


def bubble_formula(schedule: str, stages: int, repeats: int, microbatches: int) -> str:
    """`bubble_fraction` as a schedule's formula with its numbers, for the planner's printout.
    GPipe (with repeats: circular) and 1F1B idle the same S - 1 ticks of forwards and of
    backwards; 1F1B runs each stage's layers once (R = 1), so its formula has no R. Zero-bubble
    idles S - 1 ticks of F and of B, and none of W (costs: sharding/ticks.py)."""
    S, R, M = stages, repeats, microbatches
    if schedule == "1f1b":
        return f"(S - 1) / (M + S - 1) = {S - 1} / ({M} + {S - 1})"
    if schedule == "zero_bubble":
        c = COSTS["zero_bubble"]
        return (f"(S - 1)(F + B) / ((M + S - 1)(F + B) + M W), F {c['F']} B {c['B']} W {c['W']} = "
                f"{S - 1} x {c['F'] + c['B']} / ({M + S - 1} x {c['F'] + c['B']} + {M} x {c['W']})")
    return f"(S - 1) / (R x M + S - 1) = {S - 1} / ({R} x {M} + {S - 1})"


def to_stages(a: Array, stages: int, repeats: int) -> Array:
    """[L, ...] -> [S, R, K, ...] with stage s, repeat r holding layer group r*S + s."""
    per_group = a.shape[0] // (stages * repeats)
    staged = a.reshape(repeats, stages, per_group, *a.shape[1:]).swapaxes(0, 1)
    spec = PartitionSpec("pipeline", *([PartitionSpec.UNCONSTRAINED] * (staged.ndim - 1)))
    return jax.lax.with_sharding_constraint(staged, spec)


def to_microbatches(x: Array, m: int) -> Array:
    """[B, ...] -> [M, B/M, ...]; microbatch i takes rows i, i+M, ... so that a device's
    contiguous block of rows holds whole groups and splitting moves no data. The one split of a
    batch into micro-batches: the pipeline schedule's and gradient accumulation's."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def from_microbatches(x: Array) -> Array:
    """The inverse of `to_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def pipeline_runner(
    stages: int, repeats: int, microbatches: int, stage_fn: StageFn, stage_rules: Rules
) -> Callable[[nnx.Module, Array, Array, "Array | None"], tuple[Array, Array]]:
    """A layer runner (see model.LayerRunner) that pipelines the stack over `pipeline`.

    stage_fn(sub_stack, x, positions, segment_ids) applies a stack of K layers (the model's
    scan, with its remat policy). stage_rules are the activation rules inside a stage, where
    `batch` must not use the `pipeline` axis (it indexes stages there)."""
    S, R, M = stages, repeats, microbatches

    def run(layers: nnx.Module, x: Array, positions: Array, segment_ids: Array | None) -> tuple[Array, Array]:
        graphdef, stack = nnx.split(layers)
        staged = jax.tree.map(lambda a: to_stages(a, S, R), stack)
        with nn.logical_axis_rules(stage_rules):
            x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
            xs = to_microbatches(x, M)  # [M, mb, T, D]
            pos = to_microbatches(positions, M)
            seg = None if segment_ids is None else to_microbatches(segment_ids, M)

            def stage(params: nnx.State, r: Array, h: Array, p: Array, sg: Array | None) -> tuple[Array, Array]:
                sub = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), params)
                return stage_fn(nnx.merge(graphdef, sub), h, p, sg)

            stage_ids = jnp.arange(S)
            all_stages = jax.vmap(stage, spmd_axis_name="pipeline")

            def tick(carry: tuple[Array, Array, Array], t: Array) -> tuple[tuple[Array, Array, Array], None]:
                act, buf, total = carry  # act [S, mb, T, D]: what enters each stage; buf [M, mb, T, D]
                first = jnp.where(t < M, xs[jnp.minimum(t, M - 1)], buf[t % M])
                act = jnp.where((stage_ids == 0)[:, None, None, None], first[None], act)
                v = t - stage_ids  # each stage's virtual microbatch
                r = jnp.clip(v // M, 0, R - 1)
                m = v % M
                out, stats = all_stages(staged, r, act, pos[m], None if seg is None else seg[m])
                working = (v >= 0) & (v < R * M)
                total = total + jnp.sum(jnp.where(working[:, None], stats, 0.0), axis=0)
                done = t - (S - 1)  # the virtual microbatch leaving the last stage
                keep = (done >= 0) & (done < R * M)
                buf = jnp.where(keep, jax.lax.dynamic_update_index_in_dim(buf, out[S - 1], done % M, 0), buf)
                return (jnp.roll(out, 1, axis=0), buf, total), None

            act0 = jnp.zeros((S,) + xs.shape[1:], xs.dtype)
            init = (act0, jnp.zeros_like(xs), jnp.zeros(len(STATS), jnp.float32))
            (_, buf, total), _ = jax.lax.scan(tick, init, jnp.arange(R * M + S - 1))
            return from_microbatches(buf), total / M

    return run
