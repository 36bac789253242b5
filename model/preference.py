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
from flax import nnx

Array = jax.Array


def _token_logps_fwd(logits: Array, targets: Array) -> tuple[Array, tuple[Array, Array, Array]]:
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - lse, (logits, lse, targets)


def _token_logps_bwd(res: tuple[Array, Array, Array], g: Array) -> tuple[Array, None]:
    logits, lse, targets = res
    # exp(logits - lse), not the forward's exp(logits - max): a different expression, so XLA
    # cannot merge the two and the forward's exp stays private to its sum.
    probs = jnp.exp(logits - lse[..., None])
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return g[..., None] * (onehot - probs), None


@jax.custom_vjp
def token_logps(logits: Array, targets: Array) -> Array:
    """log softmax(logits)[target] per token ([batch, length]), computed as the same program
    whether differentiated or not, so a policy's and a reference's log-probs of equal weights
    are equal bitwise.
    Autodiff of logsumexp keeps exp(logits - max) for the backward pass, so XLA materializes it
    in an elementwise kernel, where a forward-only program fuses the exp into its sum (XLA:CPU
    hands that fusion to YNNPACK, whose exp rounds differently in about 2% of elements). Here
    the backward pass computes its own softmax from the logits and the logsumexp, and the
    forward pass is one dataflow in both programs."""
    return _token_logps_fwd(logits, targets)[0]


token_logps.defvjp(_token_logps_fwd, _token_logps_bwd)


def sequence_logps(model: nnx.Module, x: Array, targets: Array, weights: Array) -> Array:
    """Per row, the weighted sum of the targets' log-probabilities (float32 [batch]) from the final
    hidden states x [batch, length, embed]."""
    logits = model.logits(x).astype(jnp.float32)
    return jnp.sum(token_logps(logits, targets) * weights, axis=-1)


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
