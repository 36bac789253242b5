"""One pre-norm decoder layer: attention (grouped-query, or multi-head latent: model/mla.py), then
the feed-forward (dense SwiGLU or a mixture of experts).

A layer returns its output and its router statistics (model/router.py `STATS`; zeros for a dense
layer), so that the layer runners can carry them out of the layer scan into the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model.inputs import TokenInputs
from model.layers import MLP, Attention, RMSNorm, constrain
from model.lora import add_adapters
from model.mla import MLAttention
from model.moe import MoE
from model.router import STATS

Array = jax.Array


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool | None = None):
        """moe: an MoE feed-forward (None: if `model.moe` is enabled), else the dense SwiGLU."""
        moe = cfg.moe.enabled if moe is None else moe
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = MLAttention(cfg, rngs=rngs) if cfg.attention_type == "mla" else Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
        if cfg.lora.enabled:  # after every base weight, so their random init is the same with or without
            add_adapters(self.attn, ("q", "k", "v", "o") if cfg.attention_type != "mla" else ("q", "o"), cfg, rngs)
            if not moe:
                add_adapters(self.mlp, ("gate", "up", "down"), cfg, rngs)

    def feed_forward(self, x: Array, inputs: TokenInputs | None = None) -> tuple[Array, Array]:
        """The feed-forward of normed x [b, l, d] -> (out [b, l, d], router stats float32)."""
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x, inputs), jnp.zeros(len(STATS), jnp.float32)

    def __call__(self, x: Array, inputs: TokenInputs) -> tuple[Array, Array]:
        """x [b, l, d] and this layer's per-token inputs (model/inputs.py: positions, documents
        and, in a training step, the layer's LoRA dropout noise) -> (out, router stats)."""
        x = x + self.attn(self.attn_norm(x), inputs)
        y, stats = self.feed_forward(self.mlp_norm(x), inputs)
        return constrain(x + y, ("batch", "length", "embed")), stats
