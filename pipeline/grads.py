"""Loss and gradients under a 1F1B-family schedule: the model's pieces handed to its step.

GPipe is a layer runner: the step differentiates the loss through it. The 1F1B schedules run the
backward of one microbatch beside the forward of the next, so they compute the gradients
themselves (pipeline/one_f_one_b.py); this module hands them the model's pieces: the embedding,
a stage's slice of the layer stack, and the final norm, head and loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model import TokenInputs, scan_layers
from model.loss import GradFn, head_loss, model_inputs
from pipeline.registry import Schedule
from pipeline.stages import GradSpec, from_stages, to_microbatches, to_stages

Array = jax.Array


def head_split(length: int, stages: int, length_shards: int, loss_chunk: int) -> bool:
    """Whether the head and loss (per position) split over the pipeline devices, L / S positions
    each: where that piece is whole in the `length` shards and in the loss's chunks."""
    piece = length // stages
    return length % (stages * length_shards) == 0 and (not loss_chunk or piece % loss_chunk == 0)


def make_scheduled_grad_fn(schedule: Schedule, graphdef: nnx.GraphDef, spec: GradSpec) -> GradFn:
    """grad_fn(params, batch) -> ((loss sum, target count), gradients), as
    `jax.value_and_grad(loss_fn, has_aux=True)` gives them, computed by `schedule`'s step (a
    1F1B-family schedule: its `step` class) on the pipeline shape and settings of `spec`."""
    stages, repeats, microbatches = spec.stages, spec.repeats, spec.microbatches
    remat_policy, loss_chunk, cast = spec.remat_policy, spec.loss_chunk, spec.cast

    def grad_fn(params: dict, batch: dict[str, Array]) -> tuple[tuple[Array, Array], dict]:
        # Gradients with respect to the compute-dtype view are those of the float32 parameters
        # (the cast is the identity to autodiff); they add up in float32.
        cparams = params if cast is None else cast(params)
        outer = {k: v for k, v in cparams.items() if k != "layers"}
        stack = cparams["layers"]
        layers_graphdef, _ = nnx.split(nnx.merge(graphdef, cparams).layers)
        model = lambda o: nnx.merge(graphdef, {**o, "layers": stack})  # noqa: E731
        b = model_inputs(batch)
        # The layers' per-token inputs travel with the microbatches as one pytree (model/inputs.py),
        # the step's LoRA dropout noise among them when it has one.
        token_inputs = TokenInputs.of(b["inputs"], b.get("positions"), b.get("segment_ids"), b.get("noise"))
        inputs = {"inputs": b["inputs"], "targets": b["targets"], "weights": b["weights"], "token_inputs": token_inputs}
        micro = jax.tree.map(lambda a: to_microbatches(a, microbatches), inputs)

        def embed_fn(o: dict, mb: dict) -> Array:
            return model(o).embed(mb["inputs"])

        def stage_fn(p: dict, x: Array, mb: dict) -> Array:
            first = mb["group"] * jax.tree.leaves(p)[0].shape[0]  # the group's first layer, by global index
            return scan_layers(nnx.merge(layers_graphdef, p), x, mb["token_inputs"], remat_policy=remat_policy,
                               first=first)[0]  # dense only: MoE refuses the 1F1B schedules

        def head_fn(o: dict, x: Array, mb: dict) -> tuple[Array, Array]:
            m = model(o)
            # No gather for the targets' logits: it runs in the pieces' vmap (pipeline/one_f_one_b.py).
            return (head_loss(m, m.final_norm(x), mb["targets"], mb["weights"], loss_chunk, gather=False),
                    jnp.sum(mb["weights"]))

        staged = jax.tree.map(lambda a: to_stages(a, stages, repeats), stack)  # [S, R, K, ...]
        split = head_split(inputs["inputs"].shape[1], stages, spec.length_shards, loss_chunk)
        step = schedule.step(schedule, stages, repeats, embed_fn, stage_fn, head_fn, outer, staged, micro,
                             spec.stage_rules, split)
        (total, count), (g_outer, g_staged) = step.run()
        return (total, count), {**g_outer, "layers": jax.tree.map(from_stages, g_staged)}

    return grad_fn
