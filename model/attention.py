"""Causal attention kernels: the math of each `model.attention` choice, which model/attn_kernels
(one module per kernel, a registry by name) says how to call, check and bind to the mesh.

- `xla`: plain einsums and a softmax in float32; runs everywhere and is the reference. With
  `model.attention_chunk` it runs one block of queries at a time (`chunked_attention`), so the
  [length, length] scores never exist at once.
- `dot_product`: `jax.nn.dot_product_attention` with the implementation JAX picks.
- `cudnn`: the same, forced to cuDNN's fused flash attention (GPU only). With packed documents
  and `model.max_documents` > 0 it takes each row's documents as cuDNN's packed layout (the
  start and length of every run of one segment id: `document_spans`), not a dense mask.
- `splash`: the TPU Pallas splash attention kernel that ships in JAX, with segment ids for packed
  documents; it never forms [length, length] scores. Off TPU it runs in Pallas interpret mode
  (slow: for checking numerics).

Shapes: q and k [batch, length, heads or kv_heads, head_dim]; v [batch, length, kv_heads,
v_head_dim], where v_head_dim may differ from head_dim (multi-head latent attention, model/mla.py);
positions and segment_ids [batch, length] (segment_ids None: one document per row). Scores are
scaled by head_dim ** -0.5.

"Causal" is read from positions, not from array order: a query sees a key of its own document
whose position is not later. Within a document positions count up from 0 in order, so this is
the usual causal mask; it also stays right when the sequence is reordered (the load-balanced
context split, sharding/context.py), where array order no longer is sequence order.

Under a sequence split (`length` on a mesh axis) keys and values are constrained whole along
`length` while queries stay split: XLA gathers them, the all-gather strategy. The trainer may
install a sharded kernel (ring attention, splash under shard_map) through `model.kernels`; the
model names no mesh axis and no platform either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from model import kernels
from model.attn_kernels import registry
from model.inputs import TokenInputs
from model.splash import heads_first, scaled, splash_kernel

Array = jax.Array


def block_mask(q_pos: Array, k_pos: Array, q_seg: Array | None, k_seg: Array | None) -> Array:
    """[batch, 1, q_len, kv_len] boolean: the key's position is not after the query's, and both
    sit in one document. Positions [batch, q_len] and [batch, kv_len]."""
    mask = (q_pos[:, :, None] >= k_pos[:, None, :])[:, None]
    if q_seg is None:
        return mask
    return mask & (q_seg[:, :, None] == k_seg[:, None, :])[:, None]


def _positions(positions: Array | None, q: Array) -> Array:
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])


def xla_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, positions: Array | None = None) -> Array:
    pos = _positions(positions, q)
    return masked_attention(q, k, v, block_mask(pos, pos, segment_ids, segment_ids))


def masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q, k [b, t or s, heads or kv_heads, d] and v [b, s, kv_heads, dv] where mask [b or 1, 1,
    t, s] is true; also what KV-cache decoding (model/decode.py) attends with."""
    b, t, h, d = q.shape
    kv, dv = k.shape[2], v.shape[-1]
    g = h // kv
    # Query heads grouped by the kv head they share (no repeated k and v), the group merged with
    # the queries: each product then has one free dim per operand, the layout a matmul takes
    # without copying the [t, s] scores or probabilities into another order. The queries are the
    # major part of the merged dim, so a split of `t` over devices (the sequence split) is a split
    # of the merged dim into contiguous blocks, which XLA keeps; with the group major it could not
    # and gathered every query to every device, each then scoring the whole [t, s].
    q = q.reshape(b, t, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, d)
    scores = jnp.einsum("bkqd,bskd->bkqs", q, k, preferred_element_type=jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, :, :, None], scores.reshape(b, kv, t, g, -1), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, t * g, -1)
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v)
    return out.reshape(b, kv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dv)


# model.attention_chunk=-1: from AUTO_FROM tokens, where whole [T, T] scores outweigh the rest of
# a layer's activations (at 512 they are most of the tiny preset's step memory), the queries in
# AUTO_BLOCKS blocks. Few blocks: under the all-gather sequence split XLA gathers the keys once
# per block (llama3-1b at 4096 on 8 H100s: 128-query blocks sent 2.04x the layout's minimum,
# 4 blocks 1.23x, whole scores 1.14x).
AUTO_BLOCKS, AUTO_FROM = 4, 512


def query_chunk(chunk: int, length: int) -> int:
    """Queries at a time for `length` queries under `model.attention_chunk=chunk`: itself, or for
    -1 (auto) a quarter of them once `length` reaches AUTO_FROM (and AUTO_BLOCKS divide it); 0: all."""
    if chunk >= 0:
        return chunk
    return length // AUTO_BLOCKS if length >= AUTO_FROM and length % AUTO_BLOCKS == 0 else 0


def chunked_attention(q: Array, k: Array, v: Array, q_in: TokenInputs, k_in: TokenInputs, chunk: int) -> Array:
    """`masked_attention` for `chunk` queries at a time (a `lax.map` over the query blocks), each
    block against every key: the same sums, but no [batch, heads, length, length] scores, only
    one block's [batch, heads, chunk, length]. Each block is rematerialized, so its backward keeps
    only its inputs and recomputes its scores (one more q.k product). q [b, t, h, d] with t a
    multiple of `chunk`; the queries' positions and segment ids (`q_in`) [b, t], the keys'
    (`k_in`) [b, s].

    Block j holds queries j, j + n, j + 2n, ... (n = t / chunk blocks): strided, not contiguous,
    so that under a sequence split into C contiguous parts (chunk a multiple of C) every device
    holds chunk / C queries of every block and all devices score their share of a block at once.
    The mask reads positions, not array order, so which queries share a block changes no sum."""
    q_pos, q_seg, k_pos, k_seg = q_in.positions, q_in.segment_ids, k_in.positions, k_in.segment_ids
    b, t = q.shape[:2]
    n = t // chunk
    blocks = lambda a: jnp.moveaxis(a.reshape(b, chunk, n, *a.shape[2:]), 2, 0)  # noqa: E731  [n, b, chunk, ...]

    @jax.checkpoint
    def block(qs: tuple[Array, Array, Array | None]) -> Array:
        qb, pos, seg = qs
        return masked_attention(qb, k, v, block_mask(pos, k_pos, seg, k_seg))

    out = jax.lax.map(block, (blocks(q), blocks(q_pos), None if q_seg is None else blocks(q_seg)))
    return jnp.moveaxis(out, 0, 2).reshape(b, t, *out.shape[3:])


def fused_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, implementation: str | None,
                    positions: Array | None = None) -> Array:
    if segment_ids is None:
        # One document per row, in sequence order (these kernels refuse a reordered split): the
        # causal flag, not a dense [batch, 1, T, T] mask, which cuDNN would read from memory.
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    pos = _positions(positions, q)
    mask = block_mask(pos, pos, segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def document_spans(segment_ids: Array, max_spans: int) -> tuple[Array, Array]:
    """Each row's runs of equal segment ids in array order (its packed documents, then its
    padding), as cuDNN's packed layout wants them: lengths [batch, max_spans] and starts
    [batch, max_spans + 1], -1 past the row's last run. A row with more runs than `max_spans`
    loses the later ones (the packer keeps rows within `model.max_documents`)."""
    b, t = segment_ids.shape
    new = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run = jnp.cumsum(new, axis=1, dtype=jnp.int32) - 1  # [b, t]: the run each position is in
    count = run[:, -1:] + 1  # [b, 1]
    lengths = jax.vmap(lambda r: jnp.zeros(max_spans, jnp.int32).at[r].add(1, mode="drop"))(run)
    starts = jnp.cumsum(lengths, axis=1) - lengths
    used = jnp.arange(max_spans)[None] < count
    pad = jnp.full((b, 1), -1, jnp.int32)
    return jnp.where(used, lengths, -1), jnp.concatenate([jnp.where(used, starts, -1), pad], axis=1)


def cudnn_packed_attention(q: Array, k: Array, v: Array, segment_ids: Array, max_documents: int) -> Array:
    """cuDNN flash attention over packed documents, causal within each run of one segment id
    (array order is sequence order here: cuDNN refuses a reordered split). No [T, T] mask: the
    kernel takes every row as up to max_documents + 1 runs (the documents, then the padding),
    given by their starts and lengths. Private JAX API (the public jax.nn.dot_product_attention
    takes per-row lengths only); checked against jax 0.10.2."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # the public API has no offsets

    lengths, starts = document_spans(segment_ids, max_documents + 1)
    lengths = nn.with_logical_constraint(lengths, ("batch", None))
    starts = nn.with_logical_constraint(starts, ("batch", None))
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        # JAX turns the starts into element offsets with the query's heads (T x heads x head_dim
        # strides) for the keys and values too; with fewer kv heads those would point at the
        # wrong tokens, so keys and values are given the query's heads (query head i reads kv
        # head i // groups, as in masked_attention).
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return cudnn.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts,
                                       kv_offsets=starts, scale=q.shape[-1] ** -0.5,
                                       mask_type=cudnn.MaskType.PADDING_CAUSAL)


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, interpret: bool | None = None) -> Array:
    """The Pallas splash kernel over q [b, t, h, d], k, v [b, t, kv, d]: causal in array order,
    within documents by segment ids. Needs every row in sequence order (no load balancing) and
    a length that is a multiple of 128 (its tiles: 512 positions where they divide it, else 128)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, h, d = q.shape
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    kernel = splash_kernel(t, t, h, True, interpret)
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    out = jax.vmap(lambda qq, kk, vv, s: kernel(qq, kk, vv, segment_ids=sk.SegmentIds(q=s, kv=s)))(
        heads_first(scaled(q)), heads_first(k), heads_first(v), seg)
    return heads_first(out)


def gathered_attention(q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
                       chunk: int = 0) -> Array:
    """`masked_attention` on global arrays with keys, values and what masks them whole along
    `length` and queries as they come (`query_chunk(chunk, length)` queries at a time when it is
    less than the length): the xla kernel as the layers call it."""
    # Under a sequence split XLA gathers the keys and values over it (the all-gather strategy)
    # and each device scores only its own queries; without one this changes nothing.
    whole = lambda a, axes: nn.with_logical_constraint(a, axes)  # noqa: E731
    k = whole(k, ("batch", None, "kv_heads", "head_dim"))
    v = whole(v, ("batch", None, "kv_heads", "head_dim"))
    k_pos = whole(positions, ("batch", None))
    k_seg = None if segment_ids is None else whole(segment_ids, ("batch", None))
    chunk = query_chunk(chunk, q.shape[1])
    if 0 < chunk < q.shape[1]:
        return chunked_attention(q, k, v, TokenInputs(positions, segment_ids), TokenInputs(k_pos, k_seg), chunk)
    return masked_attention(q, k, v, block_mask(positions, k_pos, segment_ids, k_seg))


def attend(q: Array, k: Array, v: Array, inputs: TokenInputs, *, impl: str,
           opts: registry.Options = registry.Options()) -> Array:
    """The layers' attention, masked by the positions and segment ids of the layer's `inputs`:
    the bound sharded kernel, else the registered kernel `impl` (model/attn_kernels) with the
    config's `opts` (xla: `opts.chunk` > 0 queries at a time when it is less than the length)."""
    sharded = kernels.current().attention
    if sharded is not None:
        return sharded(q, k, v, inputs.positions, inputs.segment_ids)
    return registry.get(impl).attend(q, k, v, inputs.positions, inputs.segment_ids, opts)
