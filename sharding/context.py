"""The sequence split: the `context` mesh axis, causal load balancing, and attention across it.

With `mesh.context` = C > 1 the activations' `length` dim is split over `context` (the rule
`length -> context`), so each device holds T / C positions of every row it holds.

Load balancing (`context.load_balance`): the sequence is cut into 2C chunks and reordered so
that device i holds chunks i and 2C-1-i. Under causal attention the early chunks see few keys
and the late ones many; this pairing gives every device the same amount of work. The reorder is
one gather of the inputs, targets, positions and segment ids before the model; the loss is a
sum over tokens, so it does not care about order, and the model's mask reads positions, not
array order (model/attention.py).

Strategies (`context.strategy`):
- `allgather`: keys and values are gathered whole over `context`, queries stay local; the
  model's own constraint (model/attention.py) asks XLA for it. Simple, one all-gather per layer
  (and a reduce-scatter in the backward pass); the gathered keys and values of one layer are
  whole-sequence sized, which is cheap under grouped-query attention.
- `ring`: under `shard_map`, each device keeps its queries and passes its key/value block round
  the ring with a collective-permute, C - 1 times, accumulating with an online softmax (running
  max and sum), so no device ever holds more than two key/value blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from model.attn_kernels.registry import LocalFn, MaskFn, MeshBinders
from model.kernels import AttentionFn
from model.ring_blocks import BlockKernel
from sharding.fused_ring import FusedRing, fused_ring_attention
from sharding.rules import Rules, logical_to_spec, mesh_axes

Array = jax.Array
QKV_AXES = (("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim"))


def balanced_order(length: int, shards: int) -> np.ndarray:
    """Slot -> sequence index such that, cut into `shards` equal blocks, block i holds chunks i
    and 2*shards-1-i of 2*shards equal chunks."""
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    pairs = [np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)]
    return np.concatenate(pairs).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Ring:
    """The static settings of `ring_attention`: the ring and how each key block is scored."""

    axis: str  # the mesh axis of the ring ("" with one shard: no ring)
    shards: int  # devices on it
    mask_fn: MaskFn  # the kernel's mask (model/attention.py `block_mask` for xla)
    piece: int = 512  # keys scored at a time within a block


def ring_attention(q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None, ring: Ring) -> Array:
    """Attention of the local queries over every device's keys on the `ring.axis` ring; runs inside
    shard_map with q, k [b, t, h or kv, d], v [b, t, kv, dv], positions and segment_ids [b, t] local.

    Each key/value block is taken `ring.piece` keys at a time under remat, so a device holds scores
    of [heads, t, piece], never [heads, t, t], and the backward pass keeps only the running
    max, sum and output per piece (at 131,072 tokens over 16 devices t is 8,192)."""
    axis, shards, mask_fn, piece = ring.axis, ring.shards, ring.mask_fn, ring.piece
    b, t, h, d = q.shape
    kvh, dv = k.shape[2], v.shape[-1]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    perm = [(i, (i + 1) % shards) for i in range(shards)]
    piece = t if t <= piece else math.gcd(t, piece)

    @jax.checkpoint
    def add(acc: tuple[Array, Array, Array], kv: tuple) -> tuple[tuple[Array, Array, Array], None]:
        m, l, o = acc
        kb, vb, kp, ks = kv
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32) * d**-0.5
        mask = mask_fn(positions, kp, segment_ids, ks)[:, :, None]  # broadcast over each group's heads
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        m_new = jnp.maximum(m, s.max(-1))
        # Masked scores count 0 even where a whole row is masked so far (m_new is then the
        # fill value itself and exp(s - m_new) would be 1).
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        scale = jnp.exp(m - m_new)
        return (m_new, l * scale + p.sum(-1), o * scale[..., None] + pv), None

    # Remat per ring step as well as per piece: the backward pass keeps one accumulator per
    # ring step, and a step's per-piece accumulators only while that step is differentiated.
    @jax.checkpoint
    def block(acc: tuple[Array, Array, Array], kv: tuple) -> tuple[Array, Array, Array]:
        pieces = jax.tree.map(lambda a: a.reshape(b, t // piece, piece, *a.shape[2:]).swapaxes(0, 1), kv)
        return jax.lax.scan(add, acc, pieces)[0]

    start = (jnp.full((b, kvh, h // kvh, t), jnp.finfo(jnp.float32).min), jnp.zeros((b, kvh, h // kvh, t)),
             jnp.zeros((b, kvh, h // kvh, t, dv)))
    acc = block(start, (k, v, positions, segment_ids))

    def step(carry: tuple, _: None) -> tuple[tuple, None]:
        acc, kv = carry
        kv = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), kv)
        return (block(acc, kv), kv), None

    if shards > 1:
        (acc, _), _ = jax.lax.scan(step, (acc, (k, v, positions, segment_ids)), None, length=shards - 1)
    m, l, o = acc
    out = (o / l[..., None]).astype(q.dtype)  # [b, kv, g, t, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dv)


def _ring_axis(rules: Rules, shards: int) -> str:
    """The mesh axis of `length` the ring passes blocks round ("" with one shard: no ring, blockwise
    attention on each device's whole rows)."""
    return mesh_axes("length", rules)[0] if shards > 1 else ""


def _specs(rules: Rules) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    q_spec, kv_spec = (logical_to_spec(axes, rules) for axes in QKV_AXES)
    return q_spec, kv_spec, logical_to_spec(("batch", "length"), rules)


def sharded_ring(rules: Rules, shards: int, mask_fn: MaskFn) -> AttentionFn:
    """Ring attention over the mesh axis of `length`, as a kernel the model can call on global
    arrays (the mesh comes from the tracing context, jax.set_mesh). With one shard it is
    blockwise attention on each device's whole rows: no [T, T] scores."""
    q_spec, kv_spec, row_spec = _specs(rules)
    axis = _ring_axis(rules, shards)

    def attention(q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None) -> Array:
        fn = functools.partial(ring_attention, ring=Ring(axis, shards, mask_fn))
        seg_spec = None if segment_ids is None else row_spec
        # check_vma off: under the pipeline's vmap (spmd_axis_name) the stage axis joins some
        # operands' varying axes and not others'; every input and the output are split the same
        # way over the axes that split them, so nothing is reduced on the way back either.
        return jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec, row_spec, seg_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v, positions, segment_ids)

    return attention


def sharded_fused_ring(rules: Rules, shards: int, kernel: BlockKernel, balanced: bool) -> AttentionFn:
    """Ring attention over the mesh axis of `length` with `kernel` fused on each block
    (sharding/fused_ring.py), for rows of one document each: the split's layout, contiguous or
    load-balanced (`balanced`), says which keys a query sees, so positions are not read."""
    q_spec, kv_spec, _ = _specs(rules)
    ring = FusedRing(_ring_axis(rules, shards), shards, kernel, balanced)

    def attention(q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None) -> Array:
        if segment_ids is not None:  # the kernels' checks refuse document packing first
            raise ValueError(f"ring attention with {kernel.name} blocks takes rows of one document")
        fn = functools.partial(fused_ring_attention, ring=ring)
        # check_vma off for the pipeline's vmap, as in sharded_ring.
        return jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)(q, k, v)

    return attention


def per_device(kernel: LocalFn, rules: Rules) -> AttentionFn:
    """`kernel(q, k, v, segment_ids)` on each device's rows and heads under shard_map: a Pallas
    call (the splash kernel) is opaque to XLA's partitioner, which would otherwise gather whole
    arrays to every device around it. Needs `length` whole (mesh.context=1)."""
    q_spec, kv_spec, row_spec = _specs(rules)

    def attention(q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None) -> Array:
        seg_spec = None if segment_ids is None else row_spec
        # A Pallas call cannot say how its output varies over the mesh, so the check is off;
        # every input and the output are split the same way over the axes that split them.
        return jax.shard_map(kernel, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v, segment_ids)

    return attention


def mesh_binders(rules: Rules, shards: int) -> MeshBinders:
    """The shard_map wrappers of a layout (`rules`, `shards` devices along `length`) that an
    attention kernel which must see the mesh builds its bound form from (model/attn_kernels)."""
    return MeshBinders(per_device=lambda kernel: per_device(kernel, rules),
                       ring=lambda mask_fn: sharded_ring(rules, shards, mask_fn),
                       fused_ring=lambda kernel, balanced: sharded_fused_ring(rules, shards, kernel, balanced),
                       shards=shards)
