"""Incremental decoding with a key/value cache, reusing the model's own modules and parameters.

`forward` runs new tokens through the stacked blocks at positions `start ...`, writing their
keys and values into a fixed-size cache and attending over everything cached so far; the
prompt goes through it once (prefill), then one token per step. Norms, the q/k/v and output
projections with their rotary embedding (`Attention.project`, `Attention.output`), the MLP and
the output head are the model's; only the attention over the cache is written here, because the
training path attends within one sequence and has no cache. `generate` runs prefill and the
whole decode loop inside one `jit` (a `lax.scan` over new tokens), greedy or sampled.

Multi-head latent attention (model/mla.py) caches what DeepSeek's inference does: per token and
layer the normed latent and the rotary key (`LatentCache`), never per-head keys or values. Its
queries are taken into the latent's space instead (`kv_b`'s key part absorbed into them, its
value part applied after the weighted sum), so no step expands the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention import masked_attention
from model.block import Block
from model.flops import stack_layers
from model.inputs import TokenInputs
from model.layers import Attention
from model.mla import MLAttention
from model.transformer import BlockGroup, Transformer

Array = jax.Array


class Cache(NamedTuple):
    k: Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: Array


class LatentCache(NamedTuple):
    """Multi-head latent attention's cache: one head of each, whatever `model.num_heads`."""

    latent: Array  # [layers, batch, max_len, 1, kv_lora_rank], normed
    rope: Array  # [layers, batch, max_len, 1, qk_rope_head_dim], rotary applied


AnyCache = Cache | LatentCache


def init_cache(model: Transformer, batch: int, max_len: int) -> AnyCache:
    cfg = model.cfg
    zeros = lambda *dims: jnp.zeros((cfg.num_layers, batch, max_len, *dims), jnp.dtype(cfg.dtype))  # noqa: E731
    if cfg.attention_type == "mla":
        return LatentCache(zeros(1, cfg.mla.kv_lora_rank), zeros(1, cfg.mla.qk_rope_head_dim))
    return Cache(zeros(cfg.num_kv_heads, cfg.resolved_head_dim), zeros(cfg.num_kv_heads, cfg.resolved_head_dim))


def _visible(positions: Array, start: Array | int, slots: int) -> Array:
    """[b or 1, 1, t, S]: a slot is seen iff its position is in [0, the query's]. Positions are
    the slots' own ([t]), or per row [b, t] the slot less the row's left padding: a padding slot
    has a negative position and is never seen, nor is a slot past the written ones."""
    q_slot = start + jnp.arange(positions.shape[-1], dtype=jnp.int32)
    pos = jnp.atleast_2d(positions)
    slot_pos = jnp.arange(slots)[None, None, :] - (q_slot[None, :] - pos)[:, :, None]  # [b, t, S]
    return ((slot_pos >= 0) & (slot_pos <= pos[:, :, None]))[:, None]


def _write(cache: Array, new: Array, start: Array | int) -> Array:
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, start, 0, 0))


def _attend_gqa(attn: Attention, x: Array, positions: Array, start: Array | int, k_cache: Array,
                v_cache: Array) -> tuple[Array, Array, Array]:
    """Normed x [b, t, d] -> the attention output over the cache, and the cache with t new slots."""
    q, k, v = attn.project(x, TokenInputs(jnp.broadcast_to(positions, x.shape[:2])))
    k_cache, v_cache = _write(k_cache, k, start), _write(v_cache, v, start)
    return attn.output(masked_attention(q, k_cache, v_cache, _visible(positions, start, k_cache.shape[1]))), k_cache, v_cache


def _attend_mla(attn: MLAttention, x: Array, positions: Array, start: Array | int, latent_cache: Array,
                rope_cache: Array) -> tuple[Array, Array, Array]:
    """As `_attend_gqa` for latent attention: the scores are q_nope . (latent @ kv_b's key part)
    + q_rope . k_rope, computed as (q_nope @ kv_b's key part^T) . latent, and the output as
    (weights @ latent) @ kv_b's value part."""
    pos = jnp.broadcast_to(positions, x.shape[:2])
    q_nope, q_rope = attn.queries(x, TokenInputs(pos))
    latent, k_rope = attn.latents(x, pos)
    latent_cache = _write(latent_cache, latent[:, :, None], start)
    rope_cache = _write(rope_cache, k_rope[:, :, None], start)
    m = attn.cfg.mla
    w = attn.kv_b[...].astype(x.dtype)  # [rank, heads, nope + v]
    c, r = latent_cache[:, :, 0], rope_cache[:, :, 0]  # [b, S, rank], [b, S, rope]
    q_latent = jnp.einsum("bthk,rhk->bthr", q_nope, w[..., :m.qk_nope_head_dim])
    scores = (jnp.einsum("bthr,bsr->bhts", q_latent, c, preferred_element_type=jnp.float32)
              + jnp.einsum("bthk,bsk->bhts", q_rope, r, preferred_element_type=jnp.float32)) * m.qk_head_dim**-0.5
    scores = jnp.where(_visible(positions, start, c.shape[1]), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bthr,rhk->bthk", jnp.einsum("bhts,bsr->bthr", probs, c), w[..., m.qk_nope_head_dim:])
    return attn.output(out), latent_cache, rope_cache


def _block(
    block: Block, x: Array, positions: Array, start: Array | int, k_cache: Array, v_cache: Array
) -> tuple[Array, Array, Array]:
    """One decoder layer on new tokens x [b, t, d]; returns x and the updated cache of this layer
    (for latent attention, `k_cache` and `v_cache` are its latent and rotary-key caches)."""
    attend = _attend_mla if isinstance(block.attn, MLAttention) else _attend_gqa
    out, k_cache, v_cache = attend(block.attn, block.attn_norm(x), positions, start, k_cache, v_cache)
    x = x + out
    x = x + block.feed_forward(block.mlp_norm(x))[0]
    return x, k_cache, v_cache


def forward(model: Transformer, tokens: Array, cache: AnyCache, start: Array | int,
            pad: Array | None = None) -> tuple[Array, AnyCache]:
    """tokens [batch, t] into cache slots start..start+t-1 -> (logits [batch, t, vocab] float32,
    cache). `pad` [batch]: each row's left padding, slots it never attends to; its positions start
    after them. The head writes `model.logits_dtype` (bf16 for a bf16 model by default); sampling
    divides, ranks and draws in float32."""
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    if pad is not None:
        positions = positions[None, :] - pad[:, None]
    x = jnp.take(model.embedding[...], tokens, axis=0).astype(jnp.dtype(model.cfg.dtype))
    if hasattr(model, "dense_layers"):  # model.moe.first_k_dense_replace: the cache's first layers
        first, kind = model.cfg.num_layers - stack_layers(model.cfg), type(cache)
        x, k, v = _scan_blocks(model.dense_layers, x, positions, start, cache[0][:first], cache[1][:first])
        logits, rest = _forward_stack(model, x, positions, start, kind(cache[0][first:], cache[1][first:]))
        return logits, kind(jnp.concatenate([k, rest[0]]), jnp.concatenate([v, rest[1]]))
    return _forward_stack(model, x, positions, start, cache)


def _forward_stack(model: Transformer, x: Array, positions: Array, start: Array | int,
                   cache: AnyCache) -> tuple[Array, AnyCache]:
    """The main layer stack over embedded x and its slice of the cache, then the head."""
    every = model.cfg.moe.every if isinstance(model.layers, BlockGroup) else 1
    kind, (k_cache, v_cache) = type(cache), cache
    if every == 1:
        x, k, v = _scan_blocks(model.layers, x, positions, start, k_cache, v_cache)
        return model.logits(model.final_norm(x)).astype(jnp.float32), kind(k, v)
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

    x, (k, v) = jax.lax.scan(group, x, (stacked, grouped(k_cache), grouped(v_cache)))
    return model.logits(model.final_norm(x)).astype(jnp.float32), kind(k.reshape(k_cache.shape), v.reshape(v_cache.shape))


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


def until_end(tokens: Array | Sequence[int], end_id: int) -> list[int]:
    """Generated ids (one row, on the host) up to, not including, the first end-of-document id: the
    end of a document ends a sample or a completion. All of them when none ends."""
    ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
    return ids[: ids.index(end_id)] if end_id in ids else ids


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How `generate` picks each new token, as one value. Static under jit (hashable): one
    compiled program per setting, whatever the seed."""

    temperature: float = 0.0  # 0: greedy (argmax), else the softmax of the logits / temperature
    top_k: int = 0  # draw among the k most likely tokens only (0: all)
    top_p: float = 1.0  # draw among the most likely tokens whose probabilities add up to p (1: all)


def _truncated(logits: Array, sampling: Sampling) -> Array:
    """Tempered logits [batch, vocab] with the tokens top-k and top-p leave out at -inf."""
    top_k, top_p = sampling.top_k, sampling.top_p
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        # Nucleus: keep the most likely tokens until their probabilities reach p (the most
        # likely always), i.e. each token whose more likely tokens hold less than p.
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        kept = jnp.cumsum(probs, axis=-1) - probs < top_p
        smallest = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < smallest, -jnp.inf, logits)
    return logits


def sample(logits: Array, key: Array, sampling: Sampling) -> Array:
    """logits [batch, vocab] -> token ids [batch]: argmax at temperature 0, else a draw from the
    softmax at `sampling.temperature` over the `sampling.top_k` most likely tokens (0: all) and
    the nucleus of mass `sampling.top_p` (1: all)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = _truncated(logits / sampling.temperature, sampling)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sampled_logps(logits: Array, tokens: Array, sampling: Sampling) -> Array:
    """float32 [batch]: log softmax(logits / temperature)[token] (temperature 0: 1), the
    policy's log-probability of each drawn token. Top-k and top-p are left out: this is the
    quantity a trainer recomputes from its own forward (reinforcement learning's old log-probs)."""
    logits = logits.astype(jnp.float32) / (sampling.temperature or 1.0)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]


def generate(model: Transformer, prompt: Array, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             seed: int = 0, pad: Array | None = None) -> Array:
    """prompt [batch, t] int -> the next `max_new_tokens` tokens [batch, max_new_tokens], greedy
    unless `sampling` says otherwise (drawn from `seed`). `pad` [batch]: how many of each row's
    first tokens are left padding (prompts of different lengths in one batch, so one program
    serves them all); each row then decodes as it would alone."""
    return generate_with_logps(model, prompt, max_new_tokens, sampling=sampling, seed=seed, pad=pad)[0]


def generate_with_logps(model: Transformer, prompt: Array, max_new_tokens: int, *, sampling: Sampling = Sampling(),
                        seed: int | Array = 0, pad: Array | None = None) -> tuple[Array, Array]:
    """`generate`'s tokens [batch, max_new_tokens] and each one's log-probability under the
    sampling policy (`sampled_logps`) float32 [batch, max_new_tokens]. `seed`: an int, or a
    PRNG key (reinforcement learning draws a new one for each rollout)."""
    pad = jnp.zeros(len(prompt), jnp.int32) if pad is None else jnp.asarray(pad, jnp.int32)
    # Plain Python numbers: the static settings hash alike however the caller typed them.
    sampling = Sampling(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p))
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    return _generate(model, jnp.asarray(prompt, jnp.int32), pad, key, max_new_tokens, sampling)


# One jitted function for every call (the sampling settings static): calls with the same model
# structure, shapes and settings run one compiled program, whatever the parameters, prompt or
# seed; a jit made inside `generate` would trace and compile again on every call.
@functools.partial(nnx.jit, static_argnums=(4, 5))
def _generate(m: Transformer, prompt: Array, pad: Array, key: Array, max_new_tokens: int,
              sampling: Sampling) -> tuple[Array, Array]:
    batch, length = prompt.shape
    logits, cache = forward(m, prompt, init_cache(m, batch, length + max_new_tokens), 0, pad)
    keys = jax.random.split(key, max_new_tokens)
    first = sample(logits[:, -1], keys[0], sampling)
    first_logp = sampled_logps(logits[:, -1], first, sampling)

    def step(carry: tuple[Array, AnyCache, Array], key: Array) -> tuple[tuple[Array, AnyCache, Array], Array]:
        token, cache, pos = carry
        logits, cache = forward(m, token[:, None], cache, pos, pad)
        nxt = sample(logits[:, -1], key, sampling)
        return (nxt, cache, pos + 1), (nxt, sampled_logps(logits[:, -1], nxt, sampling))

    _, (rest, rest_logps) = jax.lax.scan(step, (first, cache, jnp.int32(length)), keys[1:])
    return (jnp.concatenate([first[:, None], rest.T], axis=1),
            jnp.concatenate([first_logp[:, None], rest_logps.T], axis=1))
