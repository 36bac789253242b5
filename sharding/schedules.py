"""The 1F1B pipeline schedules (plain, interleaved and zero-bubble): explicit ticks, each stage's
backward by hand, activations bounded.

GPipe (sharding/pipeline.py) is the autodiff of a forward scan: every microbatch's activations
live until the backward pass starts, so memory grows with the number of microbatches M. In 1F1B
the forward of one microbatch and the backward of an earlier one share a tick, which autodiff of
a forward scan cannot express; so this module writes the ticks itself and computes the loss and
every gradient by hand: the step calls it instead of differentiating a loss.

How, and why this way:
- Lockstep ticks, as in the GPipe runner: all stages run at once as a `vmap` over the stage dim
  (sharded over `pipeline` by `spmd_axis_name`, so each device computes only its stage), and
  activations and gradients move between neighbours with `jnp.roll` (a collective-permute).
  The partitioner keeps doing `fsdp`, `tensor` and `data` inside a stage from the same logical
  constraints; `shard_map` with `ppermute` would make `pipeline` manual and need the other axes'
  collectives written out inside the stage (or a partially manual mesh), for no gain here.
- A stage's backward is `jax.vjp` of its forward, recomputed from the stage's stashed *input*:
  the stash holds one [microbatch, length, embed] activation per microbatch in flight, the
  smallest state a microbatch can leave behind (the cost is one more stage forward per
  microbatch, what the `full` remat policy pays anyway). Parameter gradients add up in float32.
- Three scans: warm-up (S - 1 ticks, forwards only), steady (M ticks, one forward and one
  backward per stage) and cool-down (S - 1 ticks, backwards only). Stage s runs the forward of
  microbatch t - s and the backward of microbatch t - (2S - 2 - s) at tick t; the last stage
  feeds each microbatch it finishes through the head and loss in the same tick and starts its
  backward at once. Stage s therefore holds at most 2(S - 1 - s) + 1 microbatches (the round
  trip to the last stage and back, one tick per hop), whatever M: the stash has 2S - 1 slots.
  Time: (S - 1) F + M (F + B) + (S - 1) B = (M + S - 1)(F + B), GPipe's bubble,
  (S - 1) / (M + S - 1), at a memory that no longer grows with M.
- Interleaved (R repeats > 1): stage s holds layer groups s, S + s, ..., (R - 1)S + s, as in
  the circular GPipe runner, and a tick runs one group (1/R of the stage's layers). Forward
  passes go in groups of S microbatches through repeat 0, then repeat 1, ...: the u-th pass of
  stage 0 is microbatch (u div SR) S + u mod S in repeat (u mod SR) div S, at stage s on tick
  u + s, so the last stage's output for repeat r is stage 0's input for repeat r + 1 on the next
  tick (the roll carries it round). Backward passes run the same order with the repeats
  reversed, the first on tick T0 = RS - 1 (the last stage, as the last repeat of microbatch 0
  leaves the head). A stage input waits at most 2RS - 2 ticks for its backward: 2RS - 1 stash
  slots, indexed by the tick of the forward. Warm-up and cool-down take RS - 1 ticks of 1/R of a
  stage each: the bubble is (S - 1) / (RM + S - 1). With R = 1 this is the plain 1F1B above.
  The head and the embedding's backward run only on the ticks that need them (`lax.cond` on a
  predicate every device computes alike).
- Zero-bubble (ZB-H1, R = 1): each backward splits into B, the input gradient (on the critical
  path: sent to the previous stage at once) and W, the weight gradient, deferred. The B wavefront
  (ticks S - 1 to 2S - 3, the last stage's first B down to stage 0's) runs without W slots; from
  tick 2S - 2 on, every tick has a W slot, and stage s runs microbatch t - (2S - 2)'s W in it, s
  ticks after its B: the last stage's W's fill the ticks that 1F1B's cool-down spends on stage
  0's. Stage s holds s deferred output cotangents (S slots) and its inputs s ticks longer (still
  within the 2S - 1 slots). Lockstep, a tick costs its slots on every stage, so the bubble is
  (S - 1)(F + B) / ((M + S - 1)(F + B) + M W) against 1F1B's (S - 1)(F + B + W) / ((M + S - 1)
  (F + B + W)): the W of S - 1 ticks saved; the paper's (S - 1)(F + B - W) needs stages running
  different passes at once, which one SPMD program per tick does not do. sharding/ticks.py has
  the tick table and the cost model.
- The embedding runs where a microbatch enters (before stage 0), outside the stage `vmap`. The
  head and loss run where it leaves (after stage S - 1), split over the pipeline devices by
  positions (`head_split`): the last stage's output [mb, L, D] goes out as S pieces of L / S
  positions, one per device (a `vmap` over pieces, sharded over `pipeline` like the stages), so
  each device computes 1/S of the head instead of all of it (with a 128k vocabulary the head
  is a large share of a stage: BENCHMARKS.md, issue 18), and the pieces' input gradients come
  back to the last stage. The head and embedding gradients add up per device, in an [S, ...]
  float32 accumulator sharded over `pipeline` (the embedding's in stage 0's slot), summed over
  the devices once at the end, so no tick all-reduces the head's weight gradient. Where the
  positions do not split (`head_split` False) every pipeline device computes the whole head.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from sharding.rules import Rules
from sharding.ticks import backward_item, forward_item, passes, phases

Array = jax.Array
Micro = dict[str, Array]  # one microbatch's inputs; with a leading [M] dim: all of them
EmbedFn = Callable[[Any, Micro], Array]  # (outer params, microbatch) -> x [mb, length, embed]
StageFn = Callable[[Any, Array, Micro], Array]  # (one stage's layer params, x, microbatch) -> x
HeadFn = Callable[[Any, Array, Micro], tuple[Array, Array]]  # (outer, x, microbatch) -> (loss sum, targets)


def _pin_stages(a: Array) -> Array:
    """Pins the leading stage dim of a carry to `pipeline`, the rest to what the partitioner picks."""
    spec = PartitionSpec("pipeline", *([PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))
    return jax.lax.with_sharding_constraint(a, spec)


def _per_stage(mask: Array, a: Array) -> Array:
    """mask [S] broadcast against a [S, ...] array."""
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))


def one_f_one_b(
    stages: int,
    repeats: int,
    embed_fn: EmbedFn,
    stage_fn: StageFn,
    head_fn: HeadFn,
    outer: Any,
    staged: Any,
    micro: Micro,
    stage_rules: Rules,
    schedule: str = "1f1b",
    head_split: bool = False,
) -> tuple[tuple[Array, Array], tuple[Any, Any]]:
    """((loss sum, target count), (gradients of `outer`, gradients of `staged`)) over all M
    microbatches of `micro` (leaves [M, mb, ...]) under 1F1B (repeats 1), interleaved 1F1B or
    zero_bubble (repeats 1, the backward split into B and W).

    `staged` holds the layer stack as [S, R, K, ...] (stage s, repeat r: layer group rS + s),
    sharded over `pipeline` along its first dim; `outer` holds every other parameter. Gradients
    come back in float32, with the trees and shapes of `outer` and `staged`. `head_split`: the
    head and loss are per position and the microbatches' length divides into S pieces (each a
    whole number of the loss's chunks and of the `length` dim's shards): run them 1/S per device."""
    S, R = stages, repeats
    M = jax.tree.leaves(micro)[0].shape[0]
    W = 2 * R * S - 1  # stash slots: the longest a stage input waits for its backward, in ticks, plus one
    split = schedule == "zero_bubble"
    ids = jnp.arange(S)
    pick = lambda m: jax.tree.map(lambda a: a[jnp.clip(m, 0, M - 1)], micro)  # noqa: E731 one [mb] or per-stage [S, mb]

    def chunk(tree: Any, r: Array) -> Any:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(r, 0, R - 1), 0, keepdims=False), tree)

    def scatter(p: Any, g_p: Any, r: Array, on: Array) -> Any:
        """The repeat's gradients in a zero [R, K, ...] tree: only one chunk is touched."""
        return jax.tree.map(
            lambda a, gp: jax.lax.dynamic_update_index_in_dim(
                jnp.zeros(a.shape, jnp.float32), jnp.where(on, gp, 0).astype(jnp.float32), jnp.clip(r, 0, R - 1), 0),
            p, g_p)

    def forward(p: Any, r: Array, x: Array, mb: Micro) -> Array:
        return stage_fn(chunk(p, r), x, mb)

    def backward(p: Any, r: Array, x: Array, mb: Micro, g: Array, on: Array) -> tuple[Any, Array]:
        p_r = chunk(p, r)
        _, vjp = jax.vjp(lambda p, x: stage_fn(p, x, mb), p_r, x)
        g_p, g_x = vjp(g)
        return scatter(p, g_p, r, on), g_x

    # zero_bubble's halves. B is the vjp w.r.t. the stage input with the parameters closed over
    # (constants: no weight-gradient matmuls are traced); W the vjp w.r.t. the parameters with the
    # input closed over. Each recomputes the stage forward from the stashed input, and W also
    # the input-gradient chain through the stage's later layers (a layer's weight gradient needs
    # the cotangent of its output). Why not save residuals instead: splitting one vjp at the
    # matmuls (B keeps each matmul's input and output cotangent, W only multiplies them) needs a
    # hook in the model's matmuls or a jaxpr rewrite of the transposed layer scan; closed-over
    # vjps need neither and keep 1F1B's stash (stage inputs) plus one output cotangent per
    # deferred W. The cost is in sharding/ticks.py's model: B = 2, W = 3 stage forwards.
    def backward_input(p: Any, x: Array, mb: Micro, g: Array) -> Array:
        return jax.vjp(lambda x: stage_fn(chunk(p, 0), x, mb), x)[1](g)[0]

    def backward_weights(p: Any, x: Array, mb: Micro, g: Array, on: Array) -> Any:
        g_p = jax.vjp(lambda p: stage_fn(p, x, mb), chunk(p, 0))[1](g)[0]
        return scatter(p, g_p, jnp.zeros((), jnp.int32), on)

    forward_all = jax.vmap(forward, spmd_axis_name="pipeline")
    backward_all = jax.vmap(backward, spmd_axis_name="pipeline")
    input_all = jax.vmap(backward_input, spmd_axis_name="pipeline")
    weights_all = jax.vmap(backward_weights, spmd_axis_name="pipeline")
    stash_put = jax.vmap(
        lambda st, x, i, on: jax.lax.dynamic_update_index_in_dim(
            st, jnp.where(on, x, jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False)), i, 0
        ),
        spmd_axis_name="pipeline",
    )
    stash_get = jax.vmap(lambda st, i: jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False), spmd_axis_name="pipeline")
    add = lambda acc, g: acc + g.astype(jnp.float32)  # noqa: E731
    zeros_like_f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731

    def tick(carry: dict, t: Array, slots: str) -> tuple[dict, None]:
        c = dict(carry)
        forward, backward = "F" in slots, "B" in slots
        if forward:
            u, on_f = passes("F", t, ids, S, R, M)  # each stage's forward pass
            m_f, r_f = forward_item(u, S, R)
            # Stage 0 takes a fresh microbatch in repeat 0, else the last stage's output (rolled in).
            inp = c["fwd"].at[0].set(jnp.where(r_f[0] == 0, embed_fn(outer, pick(m_f[0])), c["fwd"][0]))
            c["stash"] = stash_put(c["stash"], inp, jnp.full((S,), t % W), on_f)
            out = forward_all(staged, r_f, inp, pick(m_f))
            c["fwd"] = jnp.roll(out, 1, axis=0)
        if backward:
            w, on_b = passes("B", t, ids, S, R, M)  # each stage's backward pass
            m_b, r_b = backward_item(w, S, R)
            g_out = c["bwd"]
        if forward and backward:
            # The last stage's forward of the last repeat leaves through the head, and its
            # backward starts in the same tick (the same microbatch: see T0).
            last = (r_f[S - 1] == R - 1) & on_f[S - 1]
            done = pick(m_f[S - 1])

            def head(_: None) -> tuple[Array, Array, Any, Array]:
                if head_split:
                    total, g_outer, g_x, count = head_all(outer, to_pieces(out[S - 1]),
                                                          jax.tree.map(to_pieces, done))
                    return total.sum(), count.sum(), g_outer, from_pieces(g_x)
                total, g_outer, g_x, count = head_piece(outer, out[S - 1], done)  # every device, whole
                return total, count, jax.tree.map(lambda g: on_device(S - 1, g), g_outer), g_x

            def no_head(_: None) -> tuple[Array, Array, Any, Array]:
                zero = jnp.zeros((), jnp.float32)
                return zero, zero, jax.tree.map(jnp.zeros_like, c["g_outer"]), jnp.zeros_like(out[S - 1])

            total, count, g_outer, g_x = jax.lax.cond(last, head, no_head, None)
            c["loss"], c["count"] = c["loss"] + total, c["count"] + count
            c["g_outer"] = jax.tree.map(add, c["g_outer"], g_outer)
            g_out = g_out.at[S - 1].set(jnp.where(last, g_x, g_out[S - 1]))
        if backward:
            # The forward tick of each stage's backward item says where its input was stashed.
            u_b = (w // (S * R)) * (S * R) + r_b * S + m_b % S
            x_b = stash_get(c["stash"], (u_b + ids) % W)
            if split:
                g_in = input_all(staged, x_b, pick(m_b), g_out)
                # Stage s runs this microbatch's W s ticks later (passes("W")): keep its output cotangent.
                c["cots"] = stash_put(c["cots"], g_out, m_b % S, on_b)
            else:
                g_p, g_in = backward_all(staged, r_b, x_b, pick(m_b), g_out, on_b)
                c["g_staged"] = jax.tree.map(add, c["g_staged"], g_p)
            first = (r_b[0] == 0) & on_b[0]  # stage 0's backward of repeat 0 ends in the embedding

            def embed_grads(_: None) -> Any:
                _, embed_vjp = jax.vjp(lambda o: embed_fn(o, pick(m_b[0])), outer)
                return jax.tree.map(lambda g: g.astype(jnp.float32), embed_vjp(g_in[0])[0])

            # Into stage 0's slot of the per-device accumulator: where the embedding's input gradient is.
            g_embed = jax.lax.cond(first, embed_grads, lambda _: zeros_like_f32(outer), None)
            c["g_outer"] = jax.tree.map(lambda acc, g: acc + on_device(0, g), c["g_outer"], g_embed)
            c["bwd"] = jnp.roll(g_in, -1, axis=0)  # stage s takes the input gradient of stage s + 1
        if "W" in slots:
            m_w, on_w = passes("W", t, ids, S, R, M)  # one microbatch on every stage (R = 1: u is m)
            x_w = stash_get(c["stash"], (m_w + ids) % W)  # its forward at stage s ran on tick m + s
            g_p = weights_all(staged, x_w, pick(m_w), stash_get(c["cots"], m_w % S), on_w)
            c["g_staged"] = jax.tree.map(add, c["g_staged"], g_p)
        return c, None

    def head_piece(o: Any, x: Array, mb: Micro) -> tuple[Array, Any, Array, Array]:
        """One piece of positions through the head and loss: (loss sum, float32 gradients of
        `outer`, input gradient, target count)."""
        total, head_vjp, count = jax.vjp(lambda o, h: head_fn(o, h, mb), o, x, has_aux=True)
        g_o, g_x = head_vjp(jnp.ones_like(total))
        return total, jax.tree.map(lambda g: g.astype(jnp.float32), g_o), g_x, count

    # Pieces [P, ...] sharded over `pipeline`; `outer` is the same on every device (in_axes None).
    head_all = jax.vmap(head_piece, in_axes=(None, 0, 0), spmd_axis_name="pipeline")

    def on_device(s: int, g: Array) -> Array:
        """g (the same on every device) in slot s of an [S, ...] accumulator, zeros elsewhere:
        elementwise, so each device writes its own slot (an indexed update of one slot of the
        pipeline-sharded array compiled to an all-reduce of it on H100)."""
        return jnp.where(_per_stage(ids == s, g[None]), g[None], 0.0)

    def to_pieces(a: Array) -> Array:
        """[mb, L, ...] -> [S, mb, L / S, ...]: piece p holds positions p L / S .. (p + 1) L / S."""
        return jnp.moveaxis(a.reshape(a.shape[0], S, a.shape[1] // S, *a.shape[2:]), 1, 0)

    def from_pieces(a: Array) -> Array:
        return jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1, *a.shape[3:])

    with nn.logical_axis_rules(stage_rules):
        x_shape = jax.eval_shape(embed_fn, outer, pick(0))
        acts = _pin_stages(jnp.zeros((S,) + x_shape.shape, x_shape.dtype))
        carry = {
            "fwd": acts,
            "bwd": acts,
            "stash": _pin_stages(jnp.zeros((S, W) + x_shape.shape, x_shape.dtype)),
            "loss": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.float32),
            # Per device: slot s holds what device s computed (head pieces; the embedding in 0).
            "g_outer": jax.tree.map(lambda a: _pin_stages(jnp.zeros((S,) + a.shape, jnp.float32)), outer),
            "g_staged": jax.tree.map(_pin_stages, zeros_like_f32(staged)),
        }
        if split:  # the output cotangents of deferred W's: stage s defers s of them
            carry["cots"] = _pin_stages(jnp.zeros((S, S) + x_shape.shape, x_shape.dtype))
        for first, end, slots in phases(schedule, S, R, M):
            body = lambda c, t, slots=slots: tick(c, t, slots)  # noqa: E731
            carry, _ = jax.lax.scan(body, carry, jnp.arange(first, end))
    g_outer = jax.tree.map(lambda g: g.sum(axis=0), carry["g_outer"])  # the one reduction over `pipeline`
    return (carry["loss"], carry["count"]), (g_outer, carry["g_staged"])
