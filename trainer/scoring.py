"""The run's side of the lm-evaluation-harness adapter (evaluation/harness.py): the scoring
forward of requests and the `Evaluator` of a program, on the run's mesh and layout."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from evaluation.harness import Evaluator, buckets_for
from trainer.compute import Compute
from trainer.forward import forward
from trainer.program import Program

Array = jax.Array


def make_score_fn(graphdef: nnx.GraphDef, compute: Compute) -> Callable:
    """score(params, inputs, targets, weights) -> (the weighted sum of the targets' log-probabilities
    per row [batch] float32, whether every weighted target is the argmax [batch] bool), through the
    training forward as `compute` says it runs (cast, layer runner, kernels, sequence order)."""

    def score(params: dict, inputs: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
        # Sums over positions: a sequence split's order permutes the rows as a whole.
        out = forward(graphdef, compute, params, {"inputs": inputs, "targets": targets, "weights": weights})
        # Reductions of the logits only (no second [batch, length, vocab] array of log-probabilities).
        logits = out.model.logits(out.x).astype(jnp.float32)
        hit = jnp.take_along_axis(logits, out.targets[..., None], axis=-1)[..., 0]
        logp = hit - jax.nn.logsumexp(logits, axis=-1)
        greedy = (jnp.argmax(logits, axis=-1) == out.targets) | (out.weights == 0)
        return jnp.sum(logp * out.weights, axis=1), jnp.all(greedy, axis=1)

    return score


def evaluator_of(program: Program, params: dict) -> Evaluator:
    """The `Evaluator` of a program and parameters sharded as its state's."""
    cfg, layout = program.spec.cfg, program.spec.layout
    fixed = layout.pipelined or program.compute.order is not None
    return Evaluator(params, program.spec.model.graphdef, make_score_fn(program.spec.model.graphdef, program.compute),
                     program.batch_sh, cfg.train.global_batch,
                     cfg.model.seq_len, buckets_for(cfg.model.seq_len, fixed), program.tracing)
