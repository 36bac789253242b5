"""MoE routing (`model.moe.router`): router logits -> each token's experts and their weights, and
the router statistics a layer reports.

Three routers. `softmax_topk` (Mixtral): top-k of the logits, softmax over those k.
`topk_softmax` (Qwen3-MoE): softmax over all experts, top-k, optionally renormalized. `sigmoid`
(DeepSeek-V3): scores sigmoid(logits); the choice ranks scores + a per-expert bias, first
keeping the `topk_group` of `n_group` expert groups whose two best biased scores sum highest,
then the top-k experts inside them; the weights are the chosen experts' unbiased scores,
optionally divided by their sum, times `routed_scaling_factor`.

The bias balances the load without an auxiliary loss: after each step every expert's bias moves
by `router_bias_update_rate` against its load (down when it took more than the mean share of
the layer's assignments, up when less). The load reaches the bias as its gradient: the layer's
statistic `bias_load` is zero in value, and its derivative with respect to the layer's bias is
the experts' share of the assignments minus the mean share. So the load travels the way every
gradient does, through every layer runner and pipeline schedule, summed over micro-batches and
batch shards; the optimizer gives the bias its own update, the sign of that gradient times the
rate (trainer/optimizer.py), never Adam's nor weight decay, and clipping leaves it out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.moe import MoEConfig

Array = jax.Array
# aux: the load-balancing loss; z: the z-loss; dropped: the share of dropped assignments;
# imbalance: the most-loaded expert's assignments over the mean; bias_load: zero, carrying the
# load to the routing bias as its gradient (see above).
STATS = ("aux_loss", "z_loss", "dropped", "imbalance", "bias_load")
BIAS_NAME = "router_bias"  # the bias's key in a layer's parameters (trainer/optimizer.py finds it by it)


class RouterBias(nnx.Variable):
    """The sigmoid router's per-expert bias: steered by the load, not trained by the loss."""


def group_mask(biased: Array, n_group: int, topk_group: int) -> Array:
    """biased scores [..., E] -> [..., E] bool: the experts of the `topk_group` groups (of
    `n_group` consecutive experts) whose two best biased scores sum highest."""
    if n_group == 1:
        return jnp.ones(biased.shape, bool)
    groups = biased.reshape(*biased.shape[:-1], n_group, -1)
    best = jax.lax.top_k(groups, min(2, groups.shape[-1]))[0].sum(-1)  # [..., n_group]
    chosen = jax.lax.top_k(best, topk_group)[1]
    keep = jnp.sum(jax.nn.one_hot(chosen, n_group, dtype=jnp.int32), axis=-2) > 0  # [..., n_group]
    return jnp.repeat(keep, biased.shape[-1] // n_group, axis=-1)


def sigmoid_route(logits: Array, bias: Array, cfg: MoEConfig) -> tuple[Array, Array]:
    """DeepSeek-V3's gate: logits [..., E] float32, bias [E] -> (ids [..., k], weights [..., k])."""
    scores = jax.nn.sigmoid(logits)
    biased = scores + jax.lax.stop_gradient(bias)  # the bias steers the choice only
    allowed = group_mask(biased, cfg.n_group, cfg.topk_group)
    ids = jax.lax.top_k(jnp.where(allowed, biased, -jnp.inf), cfg.experts_per_token)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def route(logits: Array, cfg: MoEConfig, bias: Array | None = None) -> tuple[Array, Array]:
    """Router logits [..., E] float32 -> (expert ids [..., k], weights [..., k] float32)."""
    k = cfg.experts_per_token
    if cfg.router == "sigmoid":
        return sigmoid_route(logits, bias, cfg)
    if cfg.router == "softmax_topk":  # Mixtral: softmax over the chosen logits
        top, ids = jax.lax.top_k(logits, k)
        return ids, jax.nn.softmax(top, axis=-1)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)  # Qwen3-MoE
    if cfg.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def sequence_balance(scores: Array, counts_ble: Array, k: int) -> Array:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the rows: per row, sum_e f_e P_e
    with f_e = E / (k T) x the row's assignments to e and P_e the mean over its T tokens of
    e's score divided by the token's score sum."""
    num_experts, length = scores.shape[-1], scores.shape[1]
    f = num_experts / (k * length) * jnp.sum(counts_ble, axis=1)  # [b, E]
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)  # [b, E]
    return jnp.mean(jnp.sum(f * p, axis=-1))


def bias_load(bias: Array, share: Array) -> Array:
    """Zero, whose gradient with respect to `bias` [E] is share [E] - 1 / E: the load above the mean."""
    over = jax.lax.stop_gradient(share - 1.0 / share.shape[0])
    signal = jnp.sum(bias * over)
    return signal - jax.lax.stop_gradient(signal)


def router_loss(stats: Array, cfg: MoEConfig) -> Array:
    """The per-token router loss a training loss adds from `STATS` averaged over layers: the
    weighted load-balancing and z losses, plus `bias_load` (zero, joined so that its gradient, the
    load, reaches the routing bias)."""
    aux, z, load = (stats[STATS.index(name)] for name in ("aux_loss", "z_loss", "bias_load"))
    return cfg.aux_loss_coef * aux + cfg.router_z_loss_coef * z + load


def router_stats(logits: Array, ids: Array, kept: Array, router: str = "softmax_topk",
                 bias: Array | None = None) -> Array:
    """`STATS` float32 over all tokens of logits [b, l, E] (ids, kept [b, l, k]). The balance
    loss is Switch's (E x sum_e f_e P_e over the batch, P from the softmax) for the softmax
    routers, DeepSeek-V3's sequence-wise one for `sigmoid`."""
    num_experts, k = logits.shape[-1], ids.shape[-1]
    per_token = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=2)  # [b, l, E]
    counts = jnp.sum(per_token, axis=(0, 1))  # [E]
    share = counts / jnp.sum(counts)
    if router == "sigmoid":
        aux = sequence_balance(jax.nn.sigmoid(logits), per_token, k)
    else:
        aux = num_experts * jnp.sum(share * jnp.mean(jax.nn.softmax(logits, axis=-1), axis=(0, 1)))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
    imbalance = jnp.max(counts) / jnp.mean(counts)
    signal = jnp.zeros((), jnp.float32) if bias is None else bias_load(bias, share)
    return jnp.stack([aux, z, dropped, imbalance, signal])
