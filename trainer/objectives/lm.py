"""`train.objective=lm`: next-token prediction over every target of a batch of token rows.

The loss is a sum over target tokens with their count (the mean is their ratio, so the sums of
several batches divided once give the mean over all their tokens, however unevenly the tokens
fall into them). A batch is {"tokens"} [rows, seq_len + 1], plus "segment_ids" and "positions"
under document packing (attention stays within a document, and padding and targets across a
document boundary carry no loss), plus a "loss_mask" where the corpus marks the trained tokens
(trainer/objectives/sft.py). In training the model's own loss terms (model/terms.py: an MoE's
router losses, multi-token prediction) join the sum, each weight x per-token mean x the target
count, so micro-batches weigh by tokens as the cross-entropy does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import Config
from model.loss import LossFn, head_loss, model_inputs
from model.terms import LossTerm, metric_names
from trainer.compute import Compute
from trainer.forward import forward
from trainer.objectives.registry import EvalFn, Objective, register

Array = jax.Array


def add_terms(loss: Array, count: Array, terms: dict[str, LossTerm],
              metrics: list[Array]) -> tuple[Array, list[Array]]:
    """The loss sum with each term's weight x per-target mean x `count`, and `metrics` with each
    term's metric sums (mean x count) after it, in the terms' order."""
    for term in terms.values():
        loss = loss + term.weight * term.value * count
        metrics = metrics + [value * count for value in term.metrics.values()]
    return loss, metrics


def make_loss_fn(graphdef: nnx.GraphDef, compute: Compute = Compute(), *, model_terms: bool = False) -> LossFn:
    """loss(params, batch) -> (sum of the per-token losses, number of target tokens), both float32
    scalars; with `model_terms` (training) and a model that has any (model/terms.py), the sum gains
    them and aux becomes (count, [the sums of "lm_loss" and the terms' metrics])."""

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, Any]:
        out = forward(graphdef, compute, params, model_inputs(batch), model_terms)
        ce, count = head_loss(out.model, out.x, out.targets, out.weights, compute.loss_chunk), jnp.sum(out.weights)
        if not out.terms:
            return ce, count
        loss, metrics = add_terms(ce, count, out.terms, [ce])
        return loss, (count, jnp.stack(metrics))

    return loss_fn


def terms_console(cfg: Config, r: dict[str, float], own: list[str]) -> list[str]:
    """The console text of a logged step: the router's health (an MoE model), the objective's
    own parts `own`, then multi-token prediction's mean over its depths (model/terms.py)."""
    moe = cfg.model.moe.enabled
    parts = [f"lm_loss {r['lm_loss']:.4f} aux {r['moe_aux_loss']:.3f} z {r['moe_z_loss']:.3f} "
             f"imbalance {r['moe_imbalance']:.2f} dropped {100 * r['moe_dropped']:.1f}%"] if moe else []
    parts += own
    if cfg.model.mtp_depth:
        lm = "" if moe else f"lm_loss {r['lm_loss']:.4f} "
        parts.append(f"{lm}mtp_loss {r['mtp_loss']:.4f}")
    return parts


@register
class LM(Objective):
    name = "lm"
    data_format = "lm"

    def loss_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> LossFn:
        return make_loss_fn(graphdef, compute, model_terms=True)

    def eval_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> EvalFn:
        loss_fn = make_loss_fn(graphdef, compute)
        return lambda params, ref_params, batch: loss_fn(params, batch)

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        if not isinstance(aux, tuple):  # the cross-entropy alone
            return {}
        count = jnp.maximum(aux[0], 1.0)
        names = ("lm_loss",) + metric_names(self.cfg.model)
        return {name: value / count for name, value in zip(names, aux[1])}

    def eval_metrics(self, sums: np.ndarray) -> tuple[float, dict[str, float], str]:
        loss = float(sums[0] / max(sums[1], 1.0))
        perplexity = math.exp(min(loss, 700.0))
        return loss, {"perplexity": perplexity}, f"perplexity {perplexity:.2f}"

    def console(self, record: dict[str, float]) -> list[str]:
        return terms_console(self.cfg, record, [])
