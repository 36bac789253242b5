"""GPipe and its circular form (`pipeline.repeats` > 1): a layer runner whose autodiff is the
schedule.

The runner views the layer stack as [stages, repeats, layers per group, ...] (pipeline/stages.py)
and runs one `lax.scan` over R*M + S - 1 ticks (S stages, R repeats, M microbatches). At tick
t, stage s works on virtual microbatch v = t - s: microbatch v mod M, repeat v div M. All stages
run at once as a `vmap` over the stage dim (sharded over `pipeline`, so each device computes
only its own stage), then the outputs shift one stage up with `jnp.roll`, which XLA lowers to a
collective-permute between neighbouring devices. Stage 0 takes a fresh microbatch in the first
repeat and, in later repeats, the last stage's output for that microbatch from the previous
repeat (kept in a buffer: M >= S makes it ready in time). Autodiff through the scan gives the
backward pass: all forwards, then all backwards (GPipe), per repeat interleaved; it keeps every
tick's stage inputs until the backward, so memory grows with M.
The layers' router statistics (MoE) are summed over the stages' real work (a stage idling in
the bubble computes on zeros; its statistics are masked out) and averaged over microbatches.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from model import LayerRunner, TokenInputs
from model.router import STATS
from pipeline.registry import Phase, Schedule, register
from pipeline.stages import from_microbatches, to_microbatches, to_stages
from sharding.rules import Rules

Array = jax.Array
# (sub-stack, x, inputs, first=) -> (x, router statistics summed over the sub-stack):
# model.scan_layers with its remat policy; `first` is the sub-stack's first global index.
StageFn = Callable[..., tuple[Array, Array]]


def pipeline_runner(stages: int, repeats: int, microbatches: int, stage_fn: StageFn, stage_rules: Rules) -> LayerRunner:
    """A layer runner (see model.LayerRunner) that pipelines the stack over `pipeline`.

    stage_fn(sub_stack, x, inputs, first=) applies a stack of K layers to a microbatch and its
    per-token inputs (model/inputs.py; the model's scan, with its remat policy: each layer sees
    the inputs of its global index, from `first`). stage_rules are the activation rules inside
    a stage, where `batch` must not use the `pipeline` axis (it indexes stages there)."""
    S, R, M = stages, repeats, microbatches

    def run(layers: nnx.Module, x: Array, inputs: TokenInputs) -> tuple[Array, Array]:
        graphdef, stack = nnx.split(layers)
        staged = jax.tree.map(lambda a: to_stages(a, S, R), stack)
        K = jax.tree.leaves(staged)[0].shape[2]  # layers (or groups) per stage and repeat
        with nn.logical_axis_rules(stage_rules):
            x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
            xs = to_microbatches(x, M)  # [M, mb, T, D]
            micro = inputs.map(lambda a: to_microbatches(a, M))  # each field [M, mb, T]

            def stage(params: nnx.State, s: Array, r: Array, h: Array, mb: TokenInputs) -> tuple[Array, Array]:
                sub = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), params)
                # Stage s, repeat r holds layer group r S + s: its layers' global indices start there.
                return stage_fn(nnx.merge(graphdef, sub), h, mb, first=(r * S + s) * K)

            stage_ids = jnp.arange(S)
            all_stages = jax.vmap(stage, spmd_axis_name="pipeline")

            def tick(carry: tuple[Array, Array, Array], t: Array) -> tuple[tuple[Array, Array, Array], None]:
                act, buf, total = carry  # act [S, mb, T, D]: what enters each stage; buf [M, mb, T, D]
                first = jnp.where(t < M, xs[jnp.minimum(t, M - 1)], buf[t % M])
                act = jnp.where((stage_ids == 0)[:, None, None, None], first[None], act)
                v = t - stage_ids  # each stage's virtual microbatch
                r = jnp.clip(v // M, 0, R - 1)
                m = v % M
                out, stats = all_stages(staged, stage_ids, r, act, micro.map(lambda a: a[m]))
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


@register
class GPipe(Schedule):
    """All forwards, then all backwards, by autodiff of the runner's scan; any number of repeats
    (circular with more than one). Each stage input of every tick lives until its backward."""

    name = "gpipe"
    costs = {"F": 1, "B": 2}

    def phases(self, S: int, R: int, M: int) -> list[Phase]:
        U = R * M
        return [(0, U + S - 1, "F"), (U + S - 1, 2 * (U + S - 1), "B")]

    def item(self, kind: str, t: int, s: int, S: int, R: int, M: int) -> int | None:
        # Stage s runs virtual microbatch t - s; the backward scan mirrors the forward one.
        tt = t if kind == "F" else 2 * (R * M + S - 1) - 1 - t
        return tt - s if 0 <= tt - s < R * M else None

    def formula(self, S: int, R: int, M: int) -> str:
        return f"(S - 1) / (R x M + S - 1) = {S - 1} / ({R} x {M} + {S - 1})"

    def in_flight(self, S: int, R: int, M: int) -> int:
        return R * M + S - 1  # one stage input per tick of the forward scan (the remat policy's residuals aside)

    def layer_runner(self, S: int, R: int, M: int, stage_fn: StageFn, stage_rules: Rules) -> LayerRunner:
        return pipeline_runner(S, R, M, stage_fn, stage_rules)
