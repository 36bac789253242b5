"""The model's own loss terms beside the next-token loss, by name, each with its weight.

A mixture of experts adds its router losses (`router`: the weighted balance and z losses and
the routing bias's load, model/router.py); multi-token prediction (`mtp`, model/mtp.py) adds
`model.mtp_loss_coef` times the mean over its depths of each depth's cross-entropy. Both are the
model's business: the objective that trains it adds each term's weight x value x its own count
of targets (tokens, or pairs) and logs the term's metrics, knowing no term by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model.flops import moe_layer_count
from model.inputs import TokenInputs
from model.mtp import mtp_losses, mtp_targets
from model.router import STATS, router_loss

Array = jax.Array

# The router statistics the training loss takes (the rest are logged only).
LOSS_STATS = ("aux_loss", "z_loss", "bias_load")
# The logged MoE statistics, each a per-token mean; the last, `bias_load`, is zero by construction.
MOE_METRICS = tuple(f"moe_{name}" for name in STATS[:4])


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One term of the training loss: its per-target mean over a batch and its weight."""

    value: Array  # float32 scalar, a per-target mean
    weight: float  # the loss adds weight x value x the batch's target count
    metrics: dict[str, Array]  # per-target means logged under these names


def metric_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The names of the metrics `loss_terms` gives a model of config `cfg`, in order."""
    return (MOE_METRICS if cfg.moe.enabled else ()) + (("mtp_loss",) if cfg.mtp_depth else ())


def term_targets(cfg: ModelConfig, inputs: Array, targets: Array, weights: Array) -> dict[str, Array]:
    """What the terms need of a batch in sequence order, before a sequence split reorders it
    (each [depth, batch, length]): the tokens ahead of each position that multi-token
    prediction scores; {} without it."""
    return mtp_targets(inputs, targets, weights, cfg.mtp_depth) if cfg.mtp_depth else {}


def loss_terms(model: nnx.Module, x: Array, stats: Array, inputs: TokenInputs, ahead: dict[str, Array],
               loss_chunk: int = 0) -> dict[str, LossTerm]:
    """The model's terms from its final normed hidden states x [b, l, d], the router statistics
    of its stack (`STATS` averaged over the MoE layers) and `term_targets`' arrays in x's order."""
    cfg, terms, mtp = model.cfg, {}, None
    if cfg.mtp_depth:
        means, mtp_stats = mtp_losses(model, x, inputs, ahead, loss_chunk)
        mtp = means.mean()
        if cfg.moe.enabled:
            # Each module's block is one more MoE layer in the loss terms' mean (its router
            # losses, its bias's load); the logged dropped share and imbalance, maxima over
            # a batch that a pipeline splits differently for the modules, stay the stack's.
            layers = moe_layer_count(cfg)
            merged = (stats * layers + mtp_stats) / (layers + cfg.mtp_depth)
            stats = jnp.where(jnp.array([s in LOSS_STATS for s in STATS]), merged, stats)
    if cfg.moe.enabled:
        terms["router"] = LossTerm(router_loss(stats, cfg.moe), 1.0, dict(zip(MOE_METRICS, stats[:4])))
    if mtp is not None:
        terms["mtp"] = LossTerm(mtp, cfg.mtp_loss_coef, {"mtp_loss": mtp})
    return terms
