"""Building blocks of a Llama-style decoder: RMSNorm, rotary embeddings, GQA attention, SwiGLU
(assembled into a layer in model/block.py).

The block projections run under `model.quant` and `model.grad_reduce` (model/quant.py); norms
and the softmax do not.

Every parameter carries logical axis names (`out_sharding` metadata) and every main activation
is constrained by logical names; which mesh axes those names land on is decided by the rules in
`sharding/`, never here. Parameters are stored in float32 and cast to the compute dtype at use.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from configs.schema import ModelConfig
from model.attention import attend
from model.quant import qeinsum

Array = jax.Array


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
    """Pins an activation's sharding by logical names; a no-op unless the trainer set rules."""
    return nn.with_logical_constraint(x, tuple(axes))


def param(rngs: nnx.Rngs, init: nnx.Initializer, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    """A float32 parameter annotated with its logical axes. Sharding is applied by the trainer
    (jit with out_shardings), so eager sharding at construction is off."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32), eager_sharding=False, out_sharding=tuple(axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("embed",))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        # Statistics in float32 whatever the compute dtype: bf16 variance loses too much.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float) -> Array:
    """Rotary position embedding, half-split convention (as Hugging Face Llama).
    x: [batch, length, heads, head_dim]; positions: [batch, length]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: `num_heads` query heads share `num_kv_heads` key/value heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        init = nnx.initializers.normal(cfg.init_std)
        self.q = param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"))
        self.k = param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.v = param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.o = param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"))
        self.cfg = cfg

    def __call__(self, x: Array, positions: Array, segment_ids: Array | None) -> Array:
        q, k, v = self.project(x, positions)
        return self.output(attend(q, k, v, positions, segment_ids, impl=self.cfg.attention))

    def project(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
        """x [b, l, d] -> q [b, l, heads, hd], k and v [b, l, kv_heads, hd], rotary applied.
        Split from __call__ so KV-cache decoding (model/decode.py) reuses it."""
        dt = x.dtype
        quant, reduce = self.cfg.quant, self.cfg.grad_reduce
        q = qeinsum("bld,dhk->blhk", x, self.q[...].astype(dt), quant, reduce)
        k = qeinsum("bld,dhk->blhk", x, self.k[...].astype(dt), quant, reduce)
        v = qeinsum("bld,dhk->blhk", x, self.v[...].astype(dt), quant, reduce)
        q = constrain(rotary(q, positions, self.cfg.rope_theta), ("batch", "length", "heads", "head_dim"))
        k = constrain(rotary(k, positions, self.cfg.rope_theta), ("batch", "length", "kv_heads", "head_dim"))
        return q, k, constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    def output(self, out: Array) -> Array:
        """Attention output [b, l, heads, hd] -> [b, l, d]."""
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return qeinsum("blhk,hkd->bld", out, self.o[...].astype(out.dtype), self.cfg.quant, self.cfg.grad_reduce)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int = 0):
        init = nnx.initializers.normal(cfg.init_std)
        f = d_ff or cfg.d_ff  # d_ff: the MoE's shared experts, side by side
        self.gate = param(rngs, init, (cfg.d_model, f), ("embed", "mlp"))
        self.up = param(rngs, init, (cfg.d_model, f), ("embed", "mlp"))
        self.down = param(rngs, init, (f, cfg.d_model), ("mlp", "embed"))
        self.quant, self.grad_reduce = cfg.quant, cfg.grad_reduce

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        gate = qeinsum("bld,df->blf", x, self.gate[...].astype(dt), self.quant, self.grad_reduce)
        up = qeinsum("bld,df->blf", x, self.up[...].astype(dt), self.quant, self.grad_reduce)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return qeinsum("blf,fd->bld", hidden, self.down[...].astype(dt), self.quant, self.grad_reduce)
