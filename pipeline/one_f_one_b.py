"""1F1B: explicit ticks, each stage's backward by hand, activations bounded by the stages. The
engine here (`OneFOneBStep`) also runs interleaved 1F1B (pipeline/interleaved.py) and, with its
backward split, zero-bubble (pipeline/zero_bubble.py).

GPipe (pipeline/gpipe.py) is the autodiff of a forward scan: every microbatch's activations live
until the backward pass starts, so memory grows with the number of microbatches M. In 1F1B the
forward of one microbatch and the backward of an earlier one share a tick, which autodiff of a
forward scan cannot express; so this module writes the ticks itself and computes the loss and
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
- The head and the embedding's backward run only on the ticks that need them (`lax.cond` on a
  predicate every device computes alike).
- The embedding runs where a microbatch enters (before stage 0), outside the stage `vmap`. The
  head and loss run where it leaves (after stage S - 1), split over the pipeline devices by
  positions (`head_split`): the last stage's output [mb, L, D] goes out as S pieces of L / S
  positions, one per device (a `vmap` over pieces, sharded over `pipeline` like the stages), so
  each device computes 1/S of the head instead of all of it (with a 128k vocabulary the head
  is a large share of a stage), and the pieces' input gradients come back to the
  last stage. The head and embedding gradients add up per device, in an [S, ...] float32
  accumulator sharded over `pipeline` (the embedding's in stage 0's slot), summed over the
  devices once at the end, so no tick all-reduces the head's weight gradient. Where the
  positions do not split (`head_split` False) every pipeline device computes the whole head.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from configs import Config, ConfigError
from model import LayerRunner, attn_kernels
from model.loss import GradFn
from pipeline.gpipe import StageFn as RunnerStageFn
from pipeline.gpipe import pipeline_runner
from pipeline.grads import make_scheduled_grad_fn
from pipeline.registry import Phase, Schedule, register
from pipeline.stages import GradSpec, per_stage, pin_stages
from pipeline.ticks import backward_item, first_backward, forward_item, forward_of_backward, passes
from sharding.rules import Rules

Array = jax.Array
Micro = dict[str, Any]  # one microbatch's inputs (arrays, the layers' TokenInputs); with a leading [M] dim: all
EmbedFn = Callable[[Any, Micro], Array]  # (outer params, microbatch) -> x [mb, length, embed]
StageFn = Callable[[Any, Array, Micro], Array]  # (one stage's layer params, x, microbatch) -> x
HeadFn = Callable[[Any, Array, Micro], tuple[Array, Array]]  # (outer, x, microbatch) -> (loss sum, targets)
Carry = dict[str, Any]  # the scans' state: see `OneFOneBStep.init_carry`
Items = tuple[Array, Array, Array, Array]  # each stage's (pass index, running, microbatch, repeat)

# A stage's stash write (kept where `on` is False) and read, per stage under the stage `vmap`.
stash_put = jax.vmap(
    lambda st, x, i, on: jax.lax.dynamic_update_index_in_dim(
        st, jnp.where(on, x, jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False)), i, 0
    ),
    spmd_axis_name="pipeline",
)
stash_get = jax.vmap(lambda st, i: jax.lax.dynamic_index_in_dim(st, i, 0, keepdims=False), spmd_axis_name="pipeline")


def add_f32(acc: Array, g: Array) -> Array:
    return acc + g.astype(jnp.float32)


def zeros_like_f32(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


@dataclasses.dataclass
class OneFOneBStep:
    """One step of a 1F1B-family schedule over all M microbatches of `micro` (leaves [M, mb, ...]):
    the static set-up, and each slot of a tick as a method.

    `staged` holds the layer stack as [S, R, K, ...] (stage s, repeat r: layer group rS + s),
    sharded over `pipeline` along its first dim; `outer` holds every other parameter. `head_split`:
    the head and loss are per position and the microbatches' length divides into S pieces (each a
    whole number of the loss's chunks and of the `length` dim's shards): run them 1/S per device."""

    schedule: "OneFOneB"
    stages: int
    repeats: int
    embed_fn: EmbedFn
    stage_fn: StageFn
    head_fn: HeadFn
    outer: Any
    staged: Any
    micro: Micro
    stage_rules: Rules
    head_split: bool = False

    def __post_init__(self) -> None:
        self.M = jax.tree.leaves(self.micro)[0].shape[0]
        self.stash_len = self.schedule.stash_slots(self.stages, self.repeats)
        self.ids = jnp.arange(self.stages)

    def pick(self, m: Any) -> Micro:
        """Microbatch m's inputs: one [mb, ...] for a scalar m, per stage [S, mb, ...] for m [S]."""
        return jax.tree.map(lambda a: a[jnp.clip(m, 0, self.M - 1)], self.micro)

    def stage_micro(self, m: Array, r: Array) -> Micro:
        """Each stage's microbatch inputs [S, mb, ...] for stages running microbatches m [S] of
        repeats r [S], and the layer group each runs ("group": r S + s), whose layers' global
        indices give each layer its per-token inputs (model/inputs.py `for_layer`)."""
        return {**self.pick(m), "group": r * self.stages + self.ids}

    def chunk(self, tree: Any, r: Array) -> Any:
        """Repeat r's layer group of a stage's [R, K, ...] parameters."""
        R = self.repeats
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(r, 0, R - 1), 0, keepdims=False), tree)

    def scatter(self, p: Any, g_p: Any, r: Array, on: Array) -> Any:
        """The repeat's gradients in a zero [R, K, ...] tree: only one chunk is touched."""
        R = self.repeats
        return jax.tree.map(
            lambda a, gp: jax.lax.dynamic_update_index_in_dim(
                jnp.zeros(a.shape, jnp.float32), jnp.where(on, gp, 0).astype(jnp.float32), jnp.clip(r, 0, R - 1), 0),
            p, g_p)

    def stage_forward(self, p: Any, r: Array, x: Array, mb: Micro) -> Array:
        return self.stage_fn(self.chunk(p, r), x, mb)

    def stage_backward(self, p: Any, r: Array, x: Array, mb: Micro, g: Array, on: Array) -> tuple[Any, Array]:
        """One stage's fused backward: the vjp of its forward, recomputed from the stashed input."""
        p_r = self.chunk(p, r)
        _, vjp = jax.vjp(lambda p, x: self.stage_fn(p, x, mb), p_r, x)
        g_p, g_x = vjp(g)
        return self.scatter(p, g_p, r, on), g_x

    def head_piece(self, o: Any, x: Array, mb: Micro) -> tuple[Array, Any, Array, Array]:
        """One piece of positions through the head and loss: (loss sum, float32 gradients of
        `outer`, input gradient, target count)."""
        total, head_vjp, count = jax.vjp(lambda o, h: self.head_fn(o, h, mb), o, x, has_aux=True)
        g_o, g_x = head_vjp(jnp.ones_like(total))
        return total, jax.tree.map(lambda g: g.astype(jnp.float32), g_o), g_x, count

    def on_device(self, s: int, g: Array) -> Array:
        """g (the same on every device) in slot s of an [S, ...] accumulator, zeros elsewhere:
        elementwise, so each device writes its own slot (an indexed update of one slot of the
        pipeline-sharded array compiled to an all-reduce of it on H100)."""
        return jnp.where(per_stage(self.ids == s, g[None]), g[None], 0.0)

    def to_pieces(self, a: Array) -> Array:
        """[mb, L, ...] -> [S, mb, L / S, ...]: piece p holds positions p L / S .. (p + 1) L / S."""
        S = self.stages
        return jnp.moveaxis(a.reshape(a.shape[0], S, a.shape[1] // S, *a.shape[2:]), 1, 0)

    def from_pieces(self, a: Array) -> Array:
        return jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1, *a.shape[3:])

    def forward_slot(self, c: Carry, t: Array) -> tuple[Array, Items]:
        """Each stage's forward pass of tick t: stashes the stage inputs and sends the outputs on
        (c["stash"], c["fwd"]). Returns the outputs and each stage's forward item."""
        S, R = self.stages, self.repeats
        u, on_f = passes("F", t, self.ids, S, R, self.M)
        m_f, r_f = forward_item(u, S, R)
        # Stage 0 takes a fresh microbatch in repeat 0, else the last stage's output (rolled in).
        inp = c["fwd"].at[0].set(jnp.where(r_f[0] == 0, self.embed_fn(self.outer, self.pick(m_f[0])), c["fwd"][0]))
        c["stash"] = stash_put(c["stash"], inp, jnp.full((S,), t % self.stash_len), on_f)
        out = jax.vmap(self.stage_forward, spmd_axis_name="pipeline")(self.staged, r_f, inp, self.stage_micro(m_f, r_f))
        c["fwd"] = jnp.roll(out, 1, axis=0)
        return out, (u, on_f, m_f, r_f)

    def backward_items(self, t: Array) -> Items:
        """Each stage's backward pass of tick t."""
        w, on_b = passes("B", t, self.ids, self.stages, self.repeats, self.M)
        m_b, r_b = backward_item(w, self.stages, self.repeats)
        return w, on_b, m_b, r_b

    def run_head(self, x: Array, mb: Micro) -> tuple[Array, Array, Any, Array]:
        """The last stage's output x through the head and loss: (loss sum, target count, per-device
        gradients of `outer`, input gradient), in pieces over the devices or whole on each."""
        if self.head_split:
            head_all = jax.vmap(self.head_piece, in_axes=(None, 0, 0), spmd_axis_name="pipeline")
            total, g_outer, g_x, count = head_all(self.outer, self.to_pieces(x), jax.tree.map(self.to_pieces, mb))
            return total.sum(), count.sum(), g_outer, self.from_pieces(g_x)
        total, g_outer, g_x, count = self.head_piece(self.outer, x, mb)  # every device, whole
        return total, count, jax.tree.map(lambda g: self.on_device(self.stages - 1, g), g_outer), g_x

    def head_slot(self, c: Carry, out: Array, fwd: Items, g_out: Array) -> Array:
        """The last stage's forward of the last repeat leaves through the head, and its backward
        starts in the same tick (the same microbatch: see T0). Adds the loss and head gradients
        into c; returns the output cotangents with the last stage's from the head."""
        S = self.stages
        _, on_f, m_f, r_f = fwd
        last = (r_f[S - 1] == self.repeats - 1) & on_f[S - 1]
        done = self.pick(m_f[S - 1])

        def no_head(_: None) -> tuple[Array, Array, Any, Array]:
            zero = jnp.zeros((), jnp.float32)
            return zero, zero, jax.tree.map(jnp.zeros_like, c["g_outer"]), jnp.zeros_like(out[S - 1])

        total, count, g_outer, g_x = jax.lax.cond(last, lambda _: self.run_head(out[S - 1], done), no_head, None)
        c["loss"], c["count"] = c["loss"] + total, c["count"] + count
        c["g_outer"] = jax.tree.map(add_f32, c["g_outer"], g_outer)
        return g_out.at[S - 1].set(jnp.where(last, g_x, g_out[S - 1]))

    def backward_pass(self, c: Carry, x_b: Array, bwd: Items, g_out: Array) -> Array:
        """Each stage's backward from its stashed input x_b: adds the layer gradients into c and
        returns the input gradients."""
        _, on_b, m_b, r_b = bwd
        backward_all = jax.vmap(self.stage_backward, spmd_axis_name="pipeline")
        g_p, g_in = backward_all(self.staged, r_b, x_b, self.stage_micro(m_b, r_b), g_out, on_b)
        c["g_staged"] = jax.tree.map(add_f32, c["g_staged"], g_p)
        return g_in

    def embedding_slot(self, c: Carry, bwd: Items, g_in: Array) -> None:
        """Stage 0's backward of repeat 0 ends in the embedding: its gradients go into stage 0's
        slot of the per-device accumulator, where the embedding's input gradient is."""
        _, on_b, m_b, r_b = bwd
        first = (r_b[0] == 0) & on_b[0]

        def embed_grads(_: None) -> Any:
            _, embed_vjp = jax.vjp(lambda o: self.embed_fn(o, self.pick(m_b[0])), self.outer)
            return jax.tree.map(lambda g: g.astype(jnp.float32), embed_vjp(g_in[0])[0])

        g_embed = jax.lax.cond(first, embed_grads, lambda _: zeros_like_f32(self.outer), None)
        c["g_outer"] = jax.tree.map(lambda acc, g: acc + self.on_device(0, g), c["g_outer"], g_embed)

    def backward_slot(self, c: Carry, bwd: Items, g_out: Array) -> None:
        """Each stage's backward pass of the tick, the embedding's where it ends there, and the
        input gradients sent down (c["bwd"]: stage s takes the input gradient of stage s + 1)."""
        w, _, m_b, r_b = bwd
        # The forward tick of each stage's backward item says where its input was stashed.
        u_b = forward_of_backward(w, m_b, r_b, self.stages, self.repeats)
        x_b = stash_get(c["stash"], (u_b + self.ids) % self.stash_len)
        g_in = self.backward_pass(c, x_b, bwd, g_out)
        self.embedding_slot(c, bwd, g_in)
        c["bwd"] = jnp.roll(g_in, -1, axis=0)

    def weight_slot(self, c: Carry, t: Array) -> None:
        """The deferred weight gradients of a split backward (zero-bubble only)."""
        raise NotImplementedError(f"pipeline.schedule={self.schedule.name} runs no W slot")

    def tick(self, carry: Carry, t: Array, slots: str) -> tuple[Carry, None]:
        """One tick: the slots its phase runs, in the order F, head, B, W."""
        c = dict(carry)
        if "F" in slots:
            out, fwd = self.forward_slot(c, t)
        if "B" in slots:
            bwd = self.backward_items(t)
            g_out = c["bwd"]
        if "F" in slots and "B" in slots:
            g_out = self.head_slot(c, out, fwd, g_out)
        if "B" in slots:
            self.backward_slot(c, bwd, g_out)
        if "W" in slots:
            self.weight_slot(c, t)
        return c, None

    def init_carry(self, x: jax.ShapeDtypeStruct) -> Carry:
        """Zeros for the scans' state: activations in flight forward and backward, the stash, the
        loss, and the float32 gradient accumulators."""
        S = self.stages
        acts = pin_stages(jnp.zeros((S,) + x.shape, x.dtype))
        return {
            "fwd": acts,
            "bwd": acts,
            "stash": pin_stages(jnp.zeros((S, self.stash_len) + x.shape, x.dtype)),
            "loss": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.float32),
            # Per device: slot s holds what device s computed (head pieces; the embedding in 0).
            "g_outer": jax.tree.map(lambda a: pin_stages(jnp.zeros((S,) + a.shape, jnp.float32)), self.outer),
            "g_staged": jax.tree.map(pin_stages, zeros_like_f32(self.staged)),
        }

    def run(self) -> tuple[tuple[Array, Array], tuple[Any, Any]]:
        """((loss sum, target count), (gradients of `outer`, gradients of `staged`)), the
        gradients in float32 with the trees and shapes of `outer` and `staged`."""
        with nn.logical_axis_rules(self.stage_rules):
            x = jax.eval_shape(self.embed_fn, self.outer, self.pick(0))
            carry = self.init_carry(x)
            for first, end, slots in self.schedule.phases(self.stages, self.repeats, self.M):
                carry, _ = jax.lax.scan(functools.partial(self.tick, slots=slots), carry, jnp.arange(first, end))
        g_outer = jax.tree.map(lambda g: g.sum(axis=0), carry["g_outer"])  # the one reduction over `pipeline`
        return (carry["loss"], carry["count"]), (g_outer, carry["g_staged"])


@register
class OneFOneB(Schedule):
    """One forward and one backward per stage and tick, each stage's layers once (R = 1)."""

    name = "1f1b"
    computes_grads = True
    costs = {"F": 1, "B": 3}
    step = OneFOneBStep

    def takes_repeats(self, repeats: int) -> bool:
        return repeats == 1

    def check(self, cfg: Config, stages: int, repeats: int, microbatches: int) -> None:
        # The 1F1B schedules differentiate stage by stage by hand; they carry no router losses yet.
        if cfg.model.moe.enabled:
            raise ConfigError(f"pipeline.schedule: {self.name} does not carry the MoE router losses; use "
                              "pipeline.schedule=gpipe with model.moe")
        self.check_groups(stages, repeats, microbatches)
        split = cfg.mesh.context > 1
        if split or attn_kernels.get(cfg.model.attention).per_device:  # a kernel bound per device (splash)
            what = f"mesh.context={cfg.mesh.context}" if split else f"model.attention={cfg.model.attention}"
            raise ConfigError(f"pipeline.schedule={self.name} does not yet run the sequence split or sharded "
                              f"attention that {what} needs; use pipeline.schedule=gpipe")

    def check_groups(self, stages: int, repeats: int, microbatches: int) -> None:
        """The layer groups per stage and the microbatches the schedule can run."""
        if repeats > 1:
            raise ConfigError(f"pipeline.schedule={self.name} runs each stage's layers once: pipeline.repeats={repeats} "
                              "needs pipeline.schedule=gpipe or interleaved_1f1b")

    def phases(self, S: int, R: int, M: int) -> list[Phase]:
        U, T0 = R * M, first_backward(S, R)
        return [(0, T0, "F"), (T0, U + S - 1, "FB"), (U + S - 1, U + T0 + S - 1, "B")]

    def item(self, kind: str, t: int, s: int, S: int, R: int, M: int) -> int | None:
        u, on = passes(kind, t, s, S, R, M)
        return u if on else None

    def formula(self, S: int, R: int, M: int) -> str:
        return f"(S - 1) / (M + S - 1) = {S - 1} / ({M} + {S - 1})"

    def stash_slots(self, S: int, R: int) -> int:
        """The longest a stage input waits for its backward, in ticks, plus one."""
        return 2 * R * S - 1

    def in_flight(self, S: int, R: int, M: int) -> int:
        return self.stash_slots(S, R)

    def layer_runner(self, S: int, R: int, M: int, stage_fn: RunnerStageFn, stage_rules: Rules) -> LayerRunner:
        return pipeline_runner(S, R, M, stage_fn, stage_rules)  # forward only (evaluation): GPipe's

    def grad_fn(self, graphdef: nnx.GraphDef, spec: GradSpec) -> GradFn:
        return make_scheduled_grad_fn(self, graphdef, spec)
