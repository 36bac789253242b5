"""The one forward pass every objective, the eval and the lm-evaluation-harness adapter run.

`forward` merges the parameters into the model in their compute dtype, puts every per-token
array in a sequence split's load-balanced order, binds the layout's kernels, runs the embedding,
the layers (the model's scan or a pipeline schedule's runner) and the final norm, and, when
asked, the model's own loss terms (model/terms.py). What to do with the hidden states (a
cross-entropy, log-probs of responses, a score) is the caller's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from flax import nnx

from model.inputs import TokenInputs
from model.kernels import use_kernels
from model.terms import LossTerm, loss_terms, term_targets
from pipeline.stages import from_microbatches, to_microbatches
from trainer.compute import Compute

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Pass:
    """A forward pass's results; every per-token array in the order of `x`'s positions."""

    model: nnx.Module  # merged in the compute dtype: its head (`logits`) scores x
    x: Array  # final normed hidden states [batch, length, embed]
    targets: Array  # [batch, length] int32
    weights: Array  # [batch, length] float32: 1 for a target that counts, 0 for none
    stats: Array  # the stack's router statistics (model/router.py STATS), zeros for a dense model
    terms: dict[str, LossTerm]  # the model's loss terms by name ({} unless asked)


def forward(graphdef: nnx.GraphDef, compute: Compute, params: dict, rows: dict[str, Array],
            with_terms: bool = False) -> Pass:
    """One forward pass of `rows` ({"inputs", "targets", "weights"} [batch, length], and any of
    the per-token inputs "positions", "segment_ids", "noise": model/inputs.py) as `compute` says
    (trainer/compute.py). `with_terms`: also the model's own loss terms (a training loss; an eval
    scores the next-token loss alone)."""
    model = nnx.merge(graphdef, params if compute.cast is None else compute.cast(params))
    tokens, targets, weights = rows["inputs"], rows["targets"], rows["weights"]
    inputs = TokenInputs.of(tokens, rows.get("positions"), rows.get("segment_ids"), rows.get("noise"))
    # The terms find tokens ahead in sequence order, before any reorder below.
    ahead = term_targets(model.cfg, tokens, targets, weights) if with_terms else {}
    tokens, targets, weights, inputs = compute.in_order((tokens, targets, weights, inputs))
    ahead = compute.in_order(ahead, axis=2)
    with use_kernels(compute.kernels):
        x, stats = model.features_and_stats(tokens, inputs, runner=compute.runner)
        terms = loss_terms(model, x, stats, inputs, ahead, compute.loss_chunk) if with_terms else {}
    return Pass(model, x, targets, weights, stats, terms)


def by_microbatch(fn: Callable[[dict[str, Array]], Array], batch: dict[str, Array], microbatches: int) -> Array:
    """`fn` of a batch computed one micro-batch at a time (the step's split), its outputs joined:
    a frozen model's pass before the step never holds more activations than the step does."""
    if microbatches == 1:
        return fn(batch)
    micro = jax.tree.map(lambda a: to_microbatches(a, microbatches), batch)
    return from_microbatches(jax.lax.map(fn, micro))
