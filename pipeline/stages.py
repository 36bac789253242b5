"""The pipeline's views of the layer stack and the batch: stages, repeats and microbatches.

The layer stack is stored in one canonical shape, [num_layers, ...], sharded over `pipeline`
along the layer dim, so checkpoints do not depend on the pipeline layout. At run time, inside
the jitted step, a schedule views it as [stages, repeats, layers_per_group, ...]: stage s holds
the layer groups s, S + s, 2S + s, ... (group g = layers [g*K, (g+1)*K)). With one repeat this
view is free (each device already holds its contiguous block); with several repeats XLA moves
the groups to their stages once per step, like an FSDP gather of the layer weights.

`GradSpec` is the pipeline shape and the step's settings a schedule that computes its own
gradients needs (`Schedule.grad_fn`), handed over as one value.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import PartitionSpec

from sharding.rules import Rules

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GradSpec:
    """What a 1F1B-family schedule's gradient function is built from, beside the model's graph:
    one value, so a new setting is a field here and changes no schedule's signature."""

    stages: int  # S: pipeline stages (mesh.pipeline)
    repeats: int  # R: layer groups per stage
    microbatches: int  # M: microbatches per step
    remat_policy: str  # model.remat, for each stage's layer scan
    stage_rules: Rules  # the activation rules inside a stage
    loss_chunk: int = 0  # model.loss_chunk: the head and loss this many positions at a time (0: all)
    cast: Callable[[dict], dict] | None = None  # float32 parameters -> their compute-dtype view
    length_shards: int = 1  # shards of the activations' `length` dim (mesh.context), for the head's split


def pin_stages(a: Array) -> Array:
    """Pins the leading stage dim of `a` to `pipeline`, the rest to what the partitioner picks."""
    spec = PartitionSpec("pipeline", *([PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))
    return jax.lax.with_sharding_constraint(a, spec)


def per_stage(mask: Array, a: Array) -> Array:
    """mask [S] broadcast against a [S, ...] array."""
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))


def to_stages(a: Array, stages: int, repeats: int) -> Array:
    """[L, ...] -> [S, R, K, ...] with stage s, repeat r holding layer group r*S + s."""
    per_group = a.shape[0] // (stages * repeats)
    staged = a.reshape(repeats, stages, per_group, *a.shape[1:]).swapaxes(0, 1)
    return pin_stages(staged)


def from_stages(g: Array) -> Array:
    """The inverse of `to_stages`: [S, R, K, ...] -> [R, S, K, ...] -> [L, ...], layer group
    rS + s back in its place."""
    return g.swapaxes(0, 1).reshape(-1, *g.shape[3:])


def to_microbatches(x: Array, m: int) -> Array:
    """[B, ...] -> [M, B/M, ...]; microbatch i takes rows i, i+M, ... so that a device's
    contiguous block of rows holds whole groups and splitting moves no data. The one split of a
    batch into micro-batches: the pipeline schedule's and gradient accumulation's."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def from_microbatches(x: Array) -> Array:
    """The inverse of `to_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
