"""Preference losses (DPO and IPO) from sequence log-probabilities of a policy and a reference.

A pair's margin is how much more the policy prefers the chosen response over the rejected one
than the reference does: (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)).
`sigmoid` is the DPO paper's loss, -log sigmoid(beta * margin); `ipo` (Azar et al.) regresses the
margin of per-token mean log-probabilities onto 1 / (2 beta). The rewards are beta times each
response's log-ratio, as DPO defines them (and TRL logs them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Array = jax.Array


def sequence_logps(model: nnx.Module, x: Array, targets: Array, weights: Array) -> Array:
    """Per row, the weighted sum of the targets' log-probabilities (float32 [batch]) from the final
    hidden states x [batch, length, embed]."""
    logits = model.logits(x).astype(jnp.float32)
    return -jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights, axis=-1)


def preference_loss(policy: Array, reference: Array, beta: float, variant: str) -> tuple[Array, Array, Array]:
    """(per-pair loss, chosen reward, rejected reward), each float32 [pairs], from the log-probs
    `policy` and `reference` [pairs, 2] (chosen, rejected): sums for `sigmoid`, per-token means for
    `ipo`."""
    ratios = policy - reference  # [pairs, 2]
    margin = ratios[:, 0] - ratios[:, 1]
    if variant == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * margin)
    elif variant == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {variant!r}")
    rewards = beta * jax.lax.stop_gradient(ratios)
    return losses, rewards[:, 0], rewards[:, 1]
