"""The Pallas splash kernel as JAX ships it, built one way for both of its callers: the layers'
splash attention (model/attention.py `splash_attention`) and the ring's splash blocks
(model/ring_blocks.py). Imports nothing from the model, so both can import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def splash_kernel(t: int, s: int, heads: int, causal: bool, interpret: bool, save_residuals: bool = False):  # noqa: ANN201
    """The Pallas splash kernel (a SplashAttentionKernel) on [heads, t, d] queries against [kv, s, d]
    keys and values, unscaled: causal in array order, or every key; tiles of 512 positions where
    they divide a length, else 128. `save_residuals`: it also returns its log-sum-exp (the ring's
    blocks, model/ring_blocks.py)."""
    # Imported here: loading Pallas and its TPU kernels costs every other run start-up time.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    tile = lambda n: 512 if n % 512 == 0 else 128  # noqa: E731
    bq, bkv = tile(t), tile(s)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    mask = sm.CausalMask((t, s)) if causal else sm.FullMask((t, s))
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              save_residuals=save_residuals, interpret=interpret)


def heads_first(a: Array) -> Array:
    """[b, t, h, d] <-> [b, h, t, d]: the splash kernel takes [heads, length, head_dim]."""
    return a.swapaxes(1, 2)


def scaled(q: Array) -> Array:
    """q times head_dim ** -0.5, in its own dtype: the splash kernel does not scale the scores."""
    return (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
