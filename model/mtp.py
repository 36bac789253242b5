"""Multi-token prediction (DeepSeek-V3), `model.mtp_depth` modules that share the model's embedding
and output head, trained with the main loss at weight `model.mtp_loss_coef`.

Module k (k = 1 .. depth) predicts, at position i, the token k + 1 places ahead: it takes h^(k-1)
(the main model's final normed hidden states for k = 1, else module k-1's output), normed
(`hnorm`), beside the normed embedding of token i + k (`enorm`), projects the pair back to the
model's width (`eh_proj`, the embedding first, as DeepSeek-V3's released weights are laid out),
runs one transformer block (attention over the same positions and documents as the main model)
and scores the shared head on its own final norm (`norm`: Hugging Face's shared_head.norm).

Sequences keep their length: at depth k the last k positions of a row, and every position whose
k + 1 tokens ahead leave its document, have no target (weight 0). The training loss is the main
cross-entropy plus `mtp_loss_coef` times the mean over depths of each depth's mean cross-entropy.
Sampling and Hugging Face export use the main model only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model.block import Block
from model.inputs import TokenInputs
from model.layers import RMSNorm, constrain, param, project, remat
from model.loss import head_loss
from model.router import STATS

Array = jax.Array


class MTPModule(nnx.Module):
    """One prediction depth."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.enorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        # Named as the feed-forward's down projection (a name appears once per array): both dims
        # sharded, and a matmul weight to the compute-dtype cast and the optimizer.
        self.eh_proj = param(rngs, nnx.initializers.normal(cfg.init_std), (2 * d, d), ("mlp", "embed"))
        self.block = Block(cfg, rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.cfg = cfg

    def __call__(self, h: Array, embedded: Array, inputs: TokenInputs) -> tuple[Array, Array]:
        """h [b, l, d] from the depth before and the embeddings of the tokens k ahead [b, l, d],
        with the block's per-token inputs (model/inputs.py) -> (this depth's hidden states
        [b, l, d] before `norm`, its block's router statistics)."""
        both = jnp.concatenate([self.enorm(embedded), self.hnorm(h)], axis=-1)
        x = constrain(project("bld,de->ble", both, self.eh_proj, self.cfg), ("batch", "length", "embed"))
        return self.block(x, inputs)


def _ahead(a: Array, k: int) -> Array:
    """a [b, l] moved k positions left along the row (a[:, i + k] at i), zeros in the last k."""
    return jnp.concatenate([a[:, k:], jnp.zeros_like(a[:, :k])], axis=1)


def mtp_targets(inputs: Array, targets: Array, weights: Array, depth: int) -> dict[str, Array]:
    """For each depth k = 1 .. depth, in sequence order: the token k ahead of each position (its
    input), the token k + 1 ahead (its target) and the target's weight: 1 where every step from
    the position to it stays in one document (the main weights of positions i .. i + k all 1).
    Each [depth, b, l]."""
    tokens, ahead, ws, w = [], [], [], weights
    for k in range(1, depth + 1):
        w = w * _ahead(weights, k)
        tokens.append(_ahead(inputs, k))
        ahead.append(_ahead(targets, k))
        ws.append(w)
    return {"mtp_inputs": jnp.stack(tokens), "mtp_targets": jnp.stack(ahead), "mtp_weights": jnp.stack(ws)}


def mtp_losses(model: nnx.Module, x: Array, inputs: TokenInputs, extra: dict[str, Array],
               loss_chunk: int = 0) -> tuple[Array, Array]:
    """Each depth's mean cross-entropy [depth] float32, from the main model's final normed hidden
    states x [b, l, d], the per-token inputs the stack ran on (model/inputs.py) and
    `mtp_targets`' arrays (all in the order x's positions are in), and the sum of the modules'
    router statistics (model/router.py `STATS`; zeros for dense blocks): a module's MoE block
    balances its load as the stack's layers do."""
    means, h, stats = [], x, jnp.zeros(len(STATS), jnp.float32)
    for k, module in enumerate(model.mtp):
        graphdef, state = nnx.split(module)

        def run(state: nnx.State, h: Array, embedded: Array) -> tuple[Array, Array]:
            # Depth k's block is layer -(k + 1) - 2^16 to its inputs (its LoRA dropout noise),
            # apart from every layer of the stack's and its dense prefix's.
            return nnx.merge(graphdef, state)(h, embedded, inputs.for_layer(-(k + 1) - 2**16))

        # Under `model.remat` as the layer stack is: the backward pass recomputes what the policy drops.
        h, block_stats = remat(run, model.cfg.remat, in_scan=False)(state, h, model.embed(extra["mtp_inputs"][k]))
        stats = stats + block_stats
        w = extra["mtp_weights"][k]
        total = head_loss(model, module.norm(h), extra["mtp_targets"][k], w, loss_chunk)
        means.append(total / jnp.maximum(jnp.sum(w), 1.0))
    return jnp.stack(means), stats
