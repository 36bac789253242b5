"""Loss and gradients under a hand-written pipeline schedule (`pipeline.schedule` other than gpipe).

GPipe is a layer runner: the step differentiates the loss through it. The 1F1B schedules run the
backward of one microbatch beside the forward of the next, so they compute the gradients
themselves (sharding.schedules); this file hands them the model's pieces: the embedding, a
stage's slice of the layer stack, and the final norm, head and loss.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from model import scan_layers
from sharding import Rules
from sharding.pipeline import to_microbatches, to_stages
from sharding.schedules import one_f_one_b
from trainer.step import GradFn, head_loss, model_inputs

Array = jax.Array


def make_scheduled_grad_fn(
    graphdef: nnx.GraphDef,
    stages: int,
    repeats: int,
    microbatches: int,
    remat_policy: str,
    stage_rules: Rules,
    loss_chunk: int = 0,
    cast: Callable[[dict], dict] | None = None,
    schedule: str = "1f1b",
    length_shards: int = 1,
) -> GradFn:
    """grad_fn(params, batch) -> ((loss sum, target count), gradients), as
    `jax.value_and_grad(loss_fn, has_aux=True)` gives them, computed by `schedule`: 1f1b,
    interleaved_1f1b (`repeats` > 1) or zero_bubble. `length_shards`: how many shards the
    activations' `length` dim has (mesh.context), for the head's split over the stages."""

    def grad_fn(params: dict, batch: dict[str, Array]) -> tuple[tuple[Array, Array], dict]:
        # Gradients with respect to the compute-dtype view are those of the float32 parameters
        # (the cast is the identity to autodiff); they add up in float32.
        cparams = params if cast is None else cast(params)
        outer = {k: v for k, v in cparams.items() if k != "layers"}
        stack = cparams["layers"]
        layers_graphdef, _ = nnx.split(nnx.merge(graphdef, cparams).layers)
        model = lambda o: nnx.merge(graphdef, {**o, "layers": stack})  # noqa: E731
        inputs = model_inputs(batch)
        if "positions" not in inputs:
            inputs["positions"] = jnp.broadcast_to(jnp.arange(inputs["inputs"].shape[1], dtype=jnp.int32),
                                                   inputs["inputs"].shape)
        micro = jax.tree.map(lambda a: to_microbatches(a, microbatches), inputs)

        def embed_fn(o: dict, mb: dict) -> Array:
            return model(o).embed(mb["inputs"])

        def stage_fn(p: dict, x: Array, mb: dict) -> Array:
            return scan_layers(nnx.merge(layers_graphdef, p), x, mb["positions"], mb.get("segment_ids"),
                               remat_policy=remat_policy)[0]  # dense only: MoE refuses 1f1b

        def head_fn(o: dict, x: Array, mb: dict) -> tuple[Array, Array]:
            m = model(o)
            # No gather for the targets' logits: it runs in the pieces' vmap (sharding/schedules.py).
            return (head_loss(m, m.final_norm(x), mb["targets"], mb["weights"], loss_chunk, gather=False),
                    jnp.sum(mb["weights"]))

        staged = jax.tree.map(lambda a: to_stages(a, stages, repeats), stack)  # [S, R, K, ...]
        # The head and loss are per position: each pipeline device takes L / S of them where
        # that piece is whole in the `length` shards and in the loss's chunks.
        length = inputs["inputs"].shape[1]
        piece = length // stages
        head_split = length % (stages * length_shards) == 0 and (not loss_chunk or piece % loss_chunk == 0)
        (total, count), (g_outer, g_staged) = one_f_one_b(
            stages, repeats, embed_fn, stage_fn, head_fn, outer, staged, micro, stage_rules, schedule, head_split
        )
        # [S, R, K, ...] -> [R, S, K, ...] -> [L, ...]: layer group rS + s back in its place.
        g_stack = jax.tree.map(lambda g: g.swapaxes(0, 1).reshape(-1, *g.shape[3:]), g_staged)
        return (total, count), {**g_outer, "layers": g_stack}

    return grad_fn

