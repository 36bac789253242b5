"""Incremental decoding with a key/value cache, reusing the model's own modules and parameters.

`forward` runs new tokens through the stacked blocks at positions `start ...`, writing their
keys and values into a fixed-size cache and attending over everything cached so far; the
prompt goes through it once (prefill), then one token per step. Norms, the q/k/v and output
projections with their rotary embedding (`Attention.project`, `Attention.output`), the MLP and
the output head are the model's; only the attention over the cache is written here, because the
training path attends within one sequence and has no cache. `generate` runs prefill and the
whole decode loop inside one `jit` (a `lax.scan` over new tokens), greedy or sampled.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import masked_attention
from model.block import Block
from model.flops import stack_layers
from model.transformer import BlockGroup, Transformer

Array = jax.Array


class Cache(NamedTuple):
    k: Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: Array


def init_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    cfg = model.cfg
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return Cache(zeros, zeros)


def _attend_cached(q: Array, k: Array, v: Array, q_pos: Array) -> Array:
    """q [b, t, h, d] at positions q_pos [t] over the whole cache k, v [b, S, kv, d]; a slot is
    seen iff its position <= the query's (slots past the written ones are never seen)."""
    visible = jnp.arange(k.shape[1])[None, :] <= q_pos[:, None]  # [t, S]
    return masked_attention(q, k, v, visible[None, None])


def _block(
    block: Block, x: Array, positions: Array, start: Array | int, k_cache: Array, v_cache: Array
) -> tuple[Array, Array, Array]:
    """One decoder layer on new tokens x [b, t, d]; returns x and the updated cache of this layer."""
    q, k, v = block.attn.project(block.attn_norm(x), jnp.broadcast_to(positions, x.shape[:2]))
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
    x = x + block.attn.output(_attend_cached(q, k_cache, v_cache, positions))
    x = x + block.feed_forward(block.mlp_norm(x))[0]
    return x, k_cache, v_cache


def forward(model: Transformer, tokens: Array, cache: Cache, start: Array | int) -> tuple[Array, Cache]:
    """tokens [batch, t] at positions start..start+t-1 -> (logits [batch, t, vocab] float32, cache).
    The head writes `model.logits_dtype` (bf16 for a bf16 model by default); sampling divides,
    ranks and draws in float32."""
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = jnp.take(model.embedding[...], tokens, axis=0).astype(jnp.dtype(model.cfg.dtype))
    if hasattr(model, "dense_layers"):  # model.moe.first_k_dense_replace: the cache's first layers
        first = model.cfg.num_layers - stack_layers(model.cfg)
        x, k, v = _scan_blocks(model.dense_layers, x, positions, start, cache.k[:first], cache.v[:first])
        logits, rest = _forward_stack(model, x, positions, start, Cache(cache.k[first:], cache.v[first:]))
        return logits, Cache(jnp.concatenate([k, rest.k]), jnp.concatenate([v, rest.v]))
    return _forward_stack(model, x, positions, start, cache)


def _forward_stack(model: Transformer, x: Array, positions: Array, start: Array | int,
                   cache: Cache) -> tuple[Array, Cache]:
    """The main layer stack over embedded x and its slice of the cache, then the head."""
    every = model.cfg.moe.every if isinstance(model.layers, BlockGroup) else 1
    if every == 1:
        x, k, v = _scan_blocks(model.layers, x, positions, start, cache.k, cache.v)
        return model.logits(model.final_norm(x)).astype(jnp.float32), Cache(k, v)
    # Layer groups (model.moe.every): the cache's layers as [groups, every, ...], the group's
    # dense layers first, its MoE layer last.
    graphdef, stacked = nnx.split(model.layers)
    grouped = lambda a: a.reshape(-1, every, *a.shape[1:])  # noqa: E731

    def group(h: Array, layer: tuple[nnx.State, Array, Array]) -> tuple[Array, tuple[Array, Array]]:
        state, k_cache, v_cache = layer
        g = nnx.merge(graphdef, state)
        h, k_dense, v_dense = _scan_blocks(g.dense, h, positions, start, k_cache[:-1], v_cache[:-1])
        h, k_moe, v_moe = _block(g.moe, h, positions, start, k_cache[-1], v_cache[-1])
        return h, (jnp.concatenate([k_dense, k_moe[None]]), jnp.concatenate([v_dense, v_moe[None]]))

    x, (k, v) = jax.lax.scan(group, x, (stacked, grouped(cache.k), grouped(cache.v)))
    return model.logits(model.final_norm(x)).astype(jnp.float32), Cache(k.reshape(cache.k.shape), v.reshape(cache.v.shape))


def _scan_blocks(
    stack: Block, x: Array, positions: Array, start: Array | int, k_cache: Array, v_cache: Array
) -> tuple[Array, Array, Array]:
    """The stacked blocks in order over x, each with its slice [layer] of the caches."""
    graphdef, stacked = nnx.split(stack)

    def body(h: Array, layer: tuple[nnx.State, Array, Array]) -> tuple[Array, tuple[Array, Array]]:
        state, k_layer, v_layer = layer
        h, k_layer, v_layer = _block(nnx.merge(graphdef, state), h, positions, start, k_layer, v_layer)
        return h, (k_layer, v_layer)

    x, (k, v) = jax.lax.scan(body, x, (stacked, k_cache, v_cache))
    return x, k, v


def sample(logits: Array, key: Array, temperature: float, top_k: int) -> Array:
    """logits [batch, vocab] -> token ids [batch]: argmax at temperature 0, else a draw from the
    softmax at `temperature` over the `top_k` most likely tokens (0: all)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: Transformer, prompt: Array, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0
) -> Array:
    """prompt [batch, t] int -> the next `max_new_tokens` tokens [batch, max_new_tokens]."""
    return _generate(model, jnp.asarray(prompt, jnp.int32), jax.random.key(seed), max_new_tokens, float(temperature),
                     int(top_k))


# One jitted function for every call (the sampling settings static): calls with the same model
# structure, shapes and settings run one compiled program, whatever the parameters, prompt or
# seed; a jit made inside `generate` would trace and compile again on every call.
@functools.partial(nnx.jit, static_argnums=(3, 4, 5))
def _generate(m: Transformer, prompt: Array, key: Array, max_new_tokens: int, temperature: float, top_k: int) -> Array:
    batch, length = prompt.shape
    logits, cache = forward(m, prompt, init_cache(m, batch, length + max_new_tokens), 0)
    keys = jax.random.split(key, max_new_tokens)
    first = sample(logits[:, -1], keys[0], temperature, top_k)

    def step(carry: tuple[Array, Cache, Array], key: Array) -> tuple[tuple[Array, Cache, Array], Array]:
        token, cache, pos = carry
        logits, cache = forward(m, token[:, None], cache, pos)
        nxt = sample(logits[:, -1], key, temperature, top_k)
        return (nxt, cache, pos + 1), nxt

    _, rest = jax.lax.scan(step, (first, cache, jnp.int32(length)), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)
