"""GRPO's math (group relative policy optimization, DeepSeekMath): group-normalized advantages,
the clipped policy-gradient loss against the sampling policy's log-probs, and the k3 estimator of
the KL divergence to a reference, over completion tokens only.

Pure functions of arrays, with no model, mesh or trainer: the objective (trainer side) computes
the per-token log-probs with the one forward pass and hands them here. A loss is returned as a
sum and its count, the contract of every objective's loss (trainer/objectives/registry.py): the
sums of several micro-batches divided once give the mean over all of them.

    advantages = group_advantages(rewards, group_size)            # [rows]
    mask = completion_mask(completion, end_id)                     # [rows, T] up to the end token
    loss, count, stats = policy_loss(logps, old_logps, ref_logps, advantages, mask, spec)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array

# Added to a group's standard deviation: a group whose rewards are all equal has advantages 0,
# not 0/0, and a nearly equal one is not blown up to huge advantages.
STD_EPS = 1e-4

# The sums policy_loss's `stats` hold, in order; each becomes a mean once divided by the count.
# All weighted like the loss, so they add up over micro-batches as the loss does.
STATS = ("pg_loss", "kl", "clip_fraction", "ratio")


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """The settings of the clipped loss (rl.clip, rl.kl_coef, rl.loss_averaging). Hashable, so
    it is static under jit."""

    clip: float = 0.2  # the ratio is clipped to [1 - clip, 1 + clip]
    kl_coef: float = 0.0  # weight of the k3 KL to the reference per token (0: no reference needed)
    # token: every completion token weighs the same over the batch (DAPO); sequence: each
    # completion's token mean, then the mean over completions (the GRPO paper).
    averaging: Literal["token", "sequence"] = "token"


def group_advantages(rewards: Array, group_size: int, eps: float = STD_EPS) -> Array:
    """rewards [rows] (groups of `group_size` consecutive rows, one prompt's completions) ->
    (reward - its group's mean) / (its group's standard deviation + eps), float32 [rows]. The
    standard deviation is the population one (ddof 0)."""
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    mean = jnp.mean(r, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(r - mean), axis=1, keepdims=True))
    return ((r - mean) / (std + eps)).reshape(-1)


def completion_mask(completion: Array, end_id: int) -> Array:
    """completion tokens [rows, T] -> float32 [rows, T]: 1 on each token up to and including the
    first `end_id` (the model learns to stop), 0 after it: tokens sampled past the end carry no loss."""
    is_end = (completion == end_id).astype(jnp.int32)
    ends_before = jnp.cumsum(is_end, axis=1) - is_end  # ends strictly before each token
    return (ends_before == 0).astype(jnp.float32)


def averaging_weights(mask: Array, averaging: str) -> tuple[Array, Array]:
    """(each token's weight [rows, T], the count the weighted sum is divided by) of a loss, or of
    any per-token statistic, averaged as `averaging` says (PolicyLoss.averaging)."""
    mask = mask.astype(jnp.float32)
    if averaging == "token":
        return mask, jnp.sum(mask)
    # Each completion's token mean: weights 1 / its length, one unit per completion.
    lengths = jnp.sum(mask, axis=1, keepdims=True)
    return mask / jnp.maximum(lengths, 1.0), jnp.sum(lengths > 0).astype(jnp.float32)


def k3_kl(logps: Array, ref_logps: Array) -> Array:
    """The k3 estimator of KL(policy || reference) per sampled token (Schulman, "Approximating KL
    divergence"): exp(ref - logp) - (ref - logp) - 1, never negative and unbiased under the policy."""
    delta = ref_logps - logps
    return jnp.exp(delta) - delta - 1.0


def policy_loss(logps: Array, old_logps: Array, ref_logps: Array | None, advantages: Array, mask: Array,
                spec: PolicyLoss) -> tuple[Array, Array, Array]:
    """The clipped policy-gradient loss with the KL penalty, as (sum, count, stats sums [STATS]).

    logps, old_logps, ref_logps [rows, T]: the completion tokens' log-probs under the policy being
    trained, the policy that sampled them and the reference (None when spec.kl_coef is 0);
    advantages [rows]; mask [rows, T] the tokens that count (completion tokens up to the end).
    Per token: -min(ratio A, clip(ratio, 1 - clip, 1 + clip) A) + kl_coef k3, ratio = exp(logp - old).
    count is the number of masked tokens (token averaging) or of rows with any (sequence)."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(logps - old_logps)
    adv = advantages.astype(jnp.float32)[:, None]
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1.0 - spec.clip, 1.0 + spec.clip) * adv
    pg = -jnp.minimum(unclipped, clipped)
    # Without a reference the KL is 0 and its array is never built (no reference forward pass).
    kl = k3_kl(logps, ref_logps) if ref_logps is not None else jnp.zeros_like(logps)
    per_token = pg + spec.kl_coef * kl
    # A token is clipped when the clipped term is the smaller: its gradient is zero.
    was_clipped = (clipped < unclipped).astype(jnp.float32)
    weights, count = averaging_weights(mask, spec.averaging)
    stats = jnp.stack([jnp.sum(pg * weights), jnp.sum(kl * weights), jnp.sum(was_clipped * weights),
                       jnp.sum(ratio * weights)])
    return jnp.sum(per_token * weights), count, stats
