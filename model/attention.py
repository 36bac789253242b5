"""Causal attention kernels, chosen by `model.attention`.

- `xla`: plain einsums and a softmax in float32; runs everywhere and is the reference.
- `dot_product`: `jax.nn.dot_product_attention` with the implementation JAX picks.
- `cudnn`: the same, forced to cuDNN's fused flash attention (GPU only).

Shapes: q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim];
segment_ids [batch, length] or None (None: one document per row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _mask(segment_ids: Array | None, length: int) -> Array:
    """[batch or 1, 1, q_len, kv_len] boolean: causal, and within one document."""
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]
    if segment_ids is None:
        return causal
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same_doc


def xla_attention(q: Array, k: Array, v: Array, segment_ids: Array | None) -> Array:
    return masked_attention(q, k, v, _mask(segment_ids, q.shape[1]))


def masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q [b, t, heads, d] over k, v [b, s, kv_heads, d] where mask [b or 1, 1, t, s] is true;
    also what KV-cache decoding (model/decode.py) attends with, s being the cache length."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    # Group query heads by the kv head they share instead of repeating k and v.
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)  # broadcast over the group axis
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def fused_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, implementation: str | None) -> Array:
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    mask = _mask(segment_ids, q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def attend(q: Array, k: Array, v: Array, segment_ids: Array | None, *, impl: str) -> Array:
    if impl == "xla":
        return xla_attention(q, k, v, segment_ids)
    if impl == "dot_product":
        return fused_attention(q, k, v, segment_ids, implementation=None)
    if impl == "cudnn":
        return fused_attention(q, k, v, segment_ids, implementation="cudnn")
    raise ValueError(f"unknown attention implementation {impl!r}")
