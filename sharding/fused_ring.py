"""Ring attention whose blocks are a fused flash kernel (model/ring_blocks.py): no [t, s] scores
ever reach memory, and no masked block is computed.

Runs inside shard_map on each device's queries, keys and values (t positions of every row it
holds); the key/value blocks go round the `axis` ring as in sharding/context.py's einsum ring.
Rows hold one document each, in the split's array order, so which keys a query sees follows
from which devices' blocks meet:

- Contiguous split (device i holds chunk i of C): its own block is causal, an earlier device's
  block is seen whole, a later one's not at all. A later block is computed and dropped rather
  than branched on (the step takes as long as the device that does see it: the last one).
- Load-balanced split (`balanced`: device i holds chunks i and 2C-1-i of 2C, sharding/context.py
  `balanced_order`): its own block is causal in array order (chunk i comes first); from an
  earlier device j < i, both query halves see the block's first half (chunk j) and none of its
  second (2C-1-j > 2C-1-i); from a later one, only the second query half (2C-1-i) sees both key
  halves. So every ring step is two half-by-half unmasked kernel calls on every device: the
  second query half against the first key half always, and (first queries, first keys) or
  (second queries, second keys) picked by a select, not a branch. Each device then does the
  causal half of the work, as the load balance intends.

Forward, the parts are merged by their log-sum-exps. Backward (a custom VJP), each step hands the
kernel the whole softmax's output and log-sum-exp, so the kernel returns exactly that block's
share of the gradients; dq stays, dk and dv travel round the ring with their block and come home
with one more hop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax.ad_checkpoint import checkpoint_name

from model.ring_blocks import RESIDUALS, BlockGrads, BlockKernel

Array = jax.Array
Part = tuple[Array, Array]  # (out [b, t, h, dv], lse [b, h, t]): attention over some of the keys


@dataclasses.dataclass(frozen=True)
class FusedRing:
    """The static settings of `fused_ring_attention`."""

    axis: str  # the mesh axis of the ring ("" with one shard: no ring)
    shards: int  # devices on it
    kernel: BlockKernel
    balanced: bool  # context.load_balance: device i holds chunks i and 2C-1-i


def _merge(acc: Part, part: Part) -> Part:
    """Two parts of one softmax (over disjoint keys) as one; a row a part does not reach has lse -inf."""
    (o, l), (po, pl) = acc, part
    lse = jnp.logaddexp(l, pl)
    weight = lambda x: jnp.exp(x - lse).transpose(0, 2, 1)[..., None]  # noqa: E731  [b, t, h, 1]
    return o * weight(l) + po.astype(jnp.float32) * weight(pl), lse


def _halves(a: Array, axis: int = 1) -> tuple[Array, Array]:
    half = a.shape[axis] // 2
    return jax.lax.slice_in_dim(a, 0, half, axis=axis), jax.lax.slice_in_dim(a, half, None, axis=axis)


def _spread(a: Array, first: Array | bool, fill: float, axis: int = 1) -> Array:
    """A half-length `a` at full length along `axis`: in the first half where `first`, else the
    second, `fill` in the other."""
    other = jnp.full_like(a, fill)
    return jnp.where(first, jnp.concatenate([a, other], axis), jnp.concatenate([other, a], axis))


def _pick(first: Array, a: Array, axis: int = 1) -> Array:
    """The first half of `a` along `axis` where `first`, else the second."""
    one, two = _halves(a, axis)
    return jnp.where(first, one, two)


def _step_parts(q: Array, kv: tuple[Array, Array], earlier: Array, ring: FusedRing) -> list[Part]:
    """The parts of a ring step's block, from a device `earlier` on the ring than this one or not."""
    k, v = kv
    fwd = functools.partial(ring.kernel.forward, causal=False)
    if not ring.balanced:
        o, lse = fwd(q, k, v)
        return [(jnp.where(earlier, o, 0), jnp.where(earlier, lse, -jnp.inf))]
    (_, q2), (k1, _), (v1, _) = _halves(q), _halves(k), _halves(v)
    o, lse = fwd(q2, k1, v1)
    always = (_spread(o, False, 0), _spread(lse, False, -jnp.inf, axis=2))
    o, lse = fwd(_pick(earlier, q), _pick(earlier, k), _pick(earlier, v))
    return [always, (_spread(o, earlier, 0), _spread(lse, earlier, -jnp.inf, axis=2))]


def _ring_index(ring: FusedRing) -> Array:
    return jax.lax.axis_index(ring.axis) if ring.shards > 1 else jnp.int32(0)


def _hop(tree: tuple, ring: FusedRing) -> tuple:
    perm = [(i, (i + 1) % ring.shards) for i in range(ring.shards)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, ring.axis, perm), tree)


def _forward(q: Array, k: Array, v: Array, ring: FusedRing) -> Part:
    index = _ring_index(ring)
    out, lse = ring.kernel.forward(q, k, v, True)
    acc = (out.astype(jnp.float32), lse)

    def fold(acc: Part, kv: tuple[Array, Array], hops: Array | int) -> Part:
        for part in _step_parts(q, kv, (index - hops) % ring.shards < index, ring):
            acc = _merge(acc, part)
        return acc

    def step(carry: tuple, hops: Array) -> tuple[tuple, None]:
        acc, kv = carry
        # The next block is sent while this one is scored: the hop reads the block, not the
        # kernel's result, so the compiler can run the two at once.
        return (fold(acc, kv, hops), _hop(kv, ring)), None

    if ring.shards > 1:
        (acc, kv), _ = jax.lax.scan(step, (acc, _hop((k, v), ring)), jnp.arange(1, ring.shards - 1))
        acc = fold(acc, kv, ring.shards - 1)  # the last block: nothing left to send
    return acc[0].astype(q.dtype), acc[1]


def _step_grads(x: BlockGrads, earlier: Array, ring: FusedRing) -> tuple[Array, Array, Array]:
    """dq, dk and dv of a ring step's block (x holds this device's queries, the whole softmax's
    output and lse for them, and the visiting block's keys and values)."""
    bwd = functools.partial(ring.kernel.backward, causal=False)
    if not ring.balanced:
        return tuple(jnp.where(earlier, g.astype(jnp.float32), 0) for g in bwd(x))
    rows = lambda pick: BlockGrads(pick(x.q), pick(x.k), pick(x.v), pick(x.out), pick(x.lse, 2),  # noqa: E731
                                   pick(x.dout))
    dq, dk, dv = bwd(rows(lambda a, axis=1: _halves(a, axis)[1])._replace(k=_halves(x.k)[0], v=_halves(x.v)[0]))
    qa, ka, va = _spread(dq, False, 0), _spread(dk, True, 0), _spread(dv, True, 0)
    dq, dk, dv = bwd(rows(functools.partial(_pick, earlier)))
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return (f32(qa) + f32(_spread(dq, earlier, 0)), f32(ka) + f32(_spread(dk, earlier, 0)),
            f32(va) + f32(_spread(dv, earlier, 0)))


def _backward(ring: FusedRing, res: tuple, dout: Array) -> tuple[Array, Array, Array]:
    q, k, v, out, lse = res
    index = _ring_index(ring)
    dq, dk, dv = ring.kernel.backward(BlockGrads(q, k, v, out, lse, dout), True)
    # dq stays and sums in float32; dk and dv travel in their own dtype, as autodiff's cotangents
    # of the einsum ring do (float32 would send twice the bytes round the ring).
    dq = dq.astype(jnp.float32)

    def grads(dq: Array, kv: tuple[Array, Array], sent: tuple[Array, Array], hops: Array | int) -> tuple:
        """This step's block's gradients added: dq's, and those the previous device sent for the block."""
        gq, gk, gv = _step_grads(BlockGrads(q, *kv, out, lse, dout), (index - hops) % ring.shards < index, ring)
        (dk, dv), got = sent, _hop(sent, ring)
        return dq + gq, ((got[0] + gk).astype(dk.dtype), (got[1] + gv).astype(dv.dtype))

    def step(carry: tuple, hops: Array) -> tuple[tuple, None]:
        dq, kv, sent = carry
        # The next block, and the gradients of the block scored last step (the one now here), are
        # sent while this one is differentiated: neither hop waits on the kernel.
        dq, dkv = grads(dq, kv, sent, hops)
        return (dq, _hop(kv, ring), dkv), None

    if ring.shards > 1:
        (dq, kv, sent), _ = jax.lax.scan(step, (dq, _hop((k, v), ring), (dk, dv)), jnp.arange(1, ring.shards - 1))
        dq, (dk, dv) = grads(dq, kv, sent, ring.shards - 1)
        dk, dv = _hop((dk, dv), ring)  # each block's gradients home to the device that holds it
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused_ring_attention(q: Array, k: Array, v: Array, ring: FusedRing) -> Array:
    """Causal attention of the local queries q [b, t, h, d] over every device's keys k [b, t, kv, d]
    and values v [b, t, kv, dv] on the `ring.axis` ring, each block through `ring.kernel`."""
    return _forward(q, k, v, ring)[0]


def _vjp_forward(q: Array, k: Array, v: Array, ring: FusedRing) -> tuple[Array, tuple]:
    out, lse = _forward(q, k, v, ring)
    # Named so that a remat policy can keep them (model.remat=save_ring_attention): the backward
    # pass then needs no second forward round of the ring, only q, k and v again.
    out, lse = (checkpoint_name(a, RESIDUALS) for a in (out, lse))
    return out, (q, k, v, out, lse)


fused_ring_attention.defvjp(_vjp_forward, _backward)
