"""Building blocks of a Llama-style decoder: RMSNorm, rotary embeddings, GQA attention, SwiGLU
(assembled into a layer in model/block.py).

The block projections (`project`) run under `model.quant`, `model.grad_reduce` and
`model.gather_dtype` (model/quant.py); norms and the softmax do not.

Every parameter carries logical axis names (`out_sharding` metadata) and every main activation
is constrained by logical names; which mesh axes those names land on is decided by the rules in
`sharding/`, never here. Parameters are stored in float32 and cast to the compute dtype at use.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from configs.rope import RopeScalingConfig
from configs.schema import REMAT_SAVES, ModelConfig
from model.attention import attend
from model.attn_kernels.registry import Options
from model.inputs import TokenInputs
from model.lora import adapt
from model.quant import fp8_gather, gather, qeinsum
from model.rope import yarn_frequencies

Array = jax.Array


def remat(fn: Callable, policy: str, in_scan: bool = True) -> Callable:
    """Wraps a per-layer function in `jax.checkpoint` with the named `model.remat` policy ('none': as is)."""
    saves = REMAT_SAVES[policy]
    if saves is None:
        return fn
    if isinstance(saves, tuple):  # a policy built from names: ("save_only_these_names", name, ...)
        keep = getattr(jax.checkpoint_policies, saves[0])(*saves[1:])
    else:
        keep = getattr(jax.checkpoint_policies, saves)
    # prevent_cse=False is safe (and faster) inside scan, which already blocks CSE across steps.
    return jax.checkpoint(fn, policy=keep, prevent_cse=not in_scan)


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
    """Pins an activation's sharding by logical names; a no-op unless the trainer set rules."""
    return nn.with_logical_constraint(x, tuple(axes))


def param(rngs: nnx.Rngs, init: nnx.Initializer, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    """A float32 parameter annotated with its logical axes. Sharding is applied by the trainer
    (jit with out_shardings), so eager sharding at construction is off."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32), eager_sharding=False, out_sharding=tuple(axes))


def project(spec: str, x: Array, p: nnx.Param, cfg: ModelConfig) -> Array:
    """`jnp.einsum(spec, x, w)` for a block weight `p`, in x's dtype, under `model.quant` and
    `model.grad_reduce`; with `model.gather_dtype=fp8` the weight is gathered from its shards
    in FP8; else, under remat and without `model.quant`, in the compute dtype once for all its
    matmuls (model/quant.py `gather`)."""
    w = p[...]
    if cfg.gather_dtype == "compute" and (cfg.remat == "none" or cfg.quant != "none"):
        # remat none: nothing recomputed, the forward matmul and the input gradient's each gather
        # for themselves. model.quant: the matmul rounds the weight, and the partitioner may gather
        # the rounded array (libtpu gathers int8), where a gather pinned here would move bf16.
        return qeinsum(spec, x, w.astype(x.dtype), cfg.quant, cfg.grad_reduce)
    names = p.get_metadata()["out_sharding"]
    axes = tuple(names[len(names) - w.ndim:])  # inside the layer scan, `layers` is sliced off the value
    move = fp8_gather if cfg.gather_dtype == "fp8" else gather

    def gathered(x: Array, w: Array) -> Array:
        return qeinsum(spec, x, move(w.astype(x.dtype), axes), cfg.quant, cfg.grad_reduce)

    if cfg.remat == "none":
        # Without a remat policy autodiff would keep the gathered weight of every layer for the
        # backward pass; FSDP gathers it again there (in FP8) instead. Under a policy the layer's
        # own recompute does that, and a second checkpoint here would gather it a third time.
        gathered = jax.checkpoint(gathered, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    return gathered(x, w)


def project_adapted(module: nnx.Module, name: str, spec: str, x: Array, inputs: TokenInputs | None = None) -> Array:
    """`project` by the module's weight `name`, plus its LoRA adapter's output if it has one
    (model/lora.py). The leaf that reads the layer's `inputs` for the adapter's dropout: their
    noise, present in a training step only (None, or no noise: no dropout)."""
    noise = None if inputs is None else inputs.noise
    return adapt(module, name, spec, x, project(spec, x, getattr(module, name), module.cfg), noise)


class RMSNorm(nnx.Module):
    # The scale of a model-width norm is `norm`, a dim no default rule maps: each device keeps the
    # few KB whole rather than gathering them at every use (two gathers a layer under FSDP).
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis: str = "norm"):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), (axis,))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        # Statistics in float32 whatever the compute dtype: bf16 variance loses too much.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float, scaling: RopeScalingConfig | None = None) -> Array:
    """Rotary position embedding, half-split convention (as Hugging Face Llama), with YaRN's
    frequencies and magnitude under `scaling` (model/rope.py).
    x: [batch, length, heads, head_dim]; positions: [batch, length]."""
    half = x.shape[-1] // 2
    magnitude = 1.0
    if scaling is None or scaling.type == "none":
        inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    else:
        inv_freq, magnitude = yarn_frequencies(2 * half, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
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
        if cfg.qk_norm:  # one scale shared by all heads (Qwen3)
            self.q_norm = RMSNorm(hd, cfg.norm_eps, rngs=rngs, axis="head_dim")
            self.k_norm = RMSNorm(hd, cfg.norm_eps, rngs=rngs, axis="head_dim")
        self.cfg = cfg

    def __call__(self, x: Array, inputs: TokenInputs) -> Array:
        """Normed x [b, l, d] and the layer's per-token inputs (model/inputs.py) -> [b, l, d]."""
        q, k, v = self.project(x, inputs)
        return self.output(attend(q, k, v, inputs, impl=self.cfg.attention,
                                  opts=Options(self.cfg.max_documents, self.cfg.attention_chunk)), inputs)

    def project(self, x: Array, inputs: TokenInputs) -> tuple[Array, Array, Array]:
        """x [b, l, d] -> q [b, l, heads, hd], k and v [b, l, kv_heads, hd], rotary applied at
        `inputs.positions`. Split from __call__ so KV-cache decoding (model/decode.py) reuses it."""
        q = project_adapted(self, "q", "bld,dhk->blhk", x, inputs)
        k = project_adapted(self, "k", "bld,dhk->blhk", x, inputs)
        v = project_adapted(self, "v", "bld,dhk->blhk", x, inputs)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rotary(q, inputs.positions, self.cfg.rope_theta), ("batch", "length", "heads", "head_dim"))
        k = constrain(rotary(k, inputs.positions, self.cfg.rope_theta), ("batch", "length", "kv_heads", "head_dim"))
        return q, k, constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    def output(self, out: Array, inputs: TokenInputs | None = None) -> Array:
        """Attention output [b, l, heads, hd] -> [b, l, d] (None: no LoRA dropout, as in decoding)."""
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return project_adapted(self, "o", "blhk,hkd->bld", out, inputs)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int = 0):
        init = nnx.initializers.normal(cfg.init_std)
        f = d_ff or cfg.d_ff  # d_ff: the MoE's shared experts, side by side
        self.gate = param(rngs, init, (cfg.d_model, f), ("embed", "mlp"))
        self.up = param(rngs, init, (cfg.d_model, f), ("embed", "mlp"))
        self.down = param(rngs, init, (f, cfg.d_model), ("mlp", "embed"))
        self.cfg = cfg

    def __call__(self, x: Array, inputs: TokenInputs | None = None) -> Array:
        """x [b, l, d] -> [b, l, d]; `inputs`: the layer's (None: no LoRA dropout, as in decoding
        and for an MoE's shared experts, which have no adapters)."""
        gate = project_adapted(self, "gate", "bld,df->blf", x, inputs)
        up = project_adapted(self, "up", "bld,df->blf", x, inputs)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return project_adapted(self, "down", "blf,fd->bld", hidden, inputs)
