"""Zero-bubble (ZB-H1, R = 1): 1F1B with each backward split into B, the input gradient, and W,
the weight gradient, deferred into the ticks 1F1B's cool-down leaves idle.

B is on the critical path: its input gradient goes to the previous stage at once. The B
wavefront (ticks S - 1 to 2S - 3, the last stage's first B down to stage 0's) runs without W
slots; from tick 2S - 2 on, every tick has a W slot, and stage s runs microbatch t - (2S - 2)'s
W in it, s ticks after its B: the last stage's W's fill the ticks that 1F1B's cool-down spends
on stage 0's. Stage s holds s deferred output cotangents (S slots) and its inputs s ticks longer
(still within the 2S - 1 slots). Lockstep, a tick costs its slots on every stage, so the bubble
is (S - 1)(F + B) / ((M + S - 1)(F + B) + M W) against 1F1B's (S - 1)(F + B + W) / ((M + S - 1)
(F + B + W)): the W of S - 1 ticks saved; the paper's (S - 1)(F + B - W) needs stages running
different passes at once, which one SPMD program per tick does not do. pipeline/ticks.py has the
cost model.

B is the vjp w.r.t. the stage input with the parameters closed over (constants: no
weight-gradient matmuls are traced); W the vjp w.r.t. the parameters with the input closed over.
Each recomputes the stage forward from the stashed input, and W also the input-gradient chain
through the stage's later layers (a layer's weight gradient needs the cotangent of its output).
Why not save residuals instead: splitting one vjp at the matmuls (B keeps each matmul's input and
output cotangent, W only multiplies them) needs a hook in the model's matmuls or a jaxpr rewrite
of the transposed layer scan; closed-over vjps need neither and keep 1F1B's stash (stage inputs)
plus one output cotangent per deferred W. The cost: B = 2, W = 3 stage forwards.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipeline.one_f_one_b import Carry, Items, Micro, OneFOneB, OneFOneBStep, add_f32, stash_get, stash_put
from pipeline.registry import Phase, register
from pipeline.stages import pin_stages
from pipeline.ticks import first_backward, passes

Array = jax.Array


class ZeroBubbleStep(OneFOneBStep):
    """The 1F1B step with B and W slots in place of the fused backward."""

    def stage_backward_input(self, p: Any, x: Array, mb: Micro, g: Array) -> Array:
        """B: one stage's input gradient, its parameters closed over."""
        return jax.vjp(lambda x: self.stage_fn(self.chunk(p, 0), x, mb), x)[1](g)[0]

    def stage_backward_weights(self, p: Any, x: Array, mb: Micro, g: Array, on: Array) -> Any:
        """W: one stage's parameter gradients, its input closed over."""
        g_p = jax.vjp(lambda p: self.stage_fn(p, x, mb), self.chunk(p, 0))[1](g)[0]
        return self.scatter(p, g_p, jnp.zeros((), jnp.int32), on)

    def backward_pass(self, c: Carry, x_b: Array, bwd: Items, g_out: Array) -> Array:
        """B on every stage; stage s runs this microbatch's W s ticks later (passes("W")), so its
        output cotangent is kept (c["cots"])."""
        _, on_b, m_b, _ = bwd
        input_all = jax.vmap(self.stage_backward_input, spmd_axis_name="pipeline")
        g_in = input_all(self.staged, x_b, self.stage_micro(m_b, jnp.zeros_like(m_b)), g_out)
        c["cots"] = stash_put(c["cots"], g_out, m_b % self.stages, on_b)
        return g_in

    def weight_slot(self, c: Carry, t: Array) -> None:
        """W of one microbatch on every stage (R = 1: the pass index is the microbatch), from the
        stage input stashed at its forward (tick m + s) and the kept output cotangent."""
        S = self.stages
        m_w, on_w = passes("W", t, self.ids, S, self.repeats, self.M)
        x_w = stash_get(c["stash"], (m_w + self.ids) % self.stash_len)
        weights_all = jax.vmap(self.stage_backward_weights, spmd_axis_name="pipeline")
        mb = self.stage_micro(m_w, jnp.zeros_like(m_w))
        g_p = weights_all(self.staged, x_w, mb, stash_get(c["cots"], m_w % S), on_w)
        c["g_staged"] = jax.tree.map(add_f32, c["g_staged"], g_p)

    def init_carry(self, x: jax.ShapeDtypeStruct) -> Carry:
        carry = super().init_carry(x)
        # The output cotangents of deferred W's: stage s defers s of them.
        carry["cots"] = pin_stages(jnp.zeros((self.stages, self.stages) + x.shape, x.dtype))
        return carry


@register
class ZeroBubble(OneFOneB):
    """ZB-H1 in lockstep ticks: B on the critical path, W deferred (R = 1)."""

    name = "zero_bubble"
    costs = {"F": 1, "B": 2, "W": 3}
    step = ZeroBubbleStep

    def phases(self, S: int, R: int, M: int) -> list[Phase]:
        # The B wavefront runs from the last stage down to stage 0 without weight gradients;
        # from tick 2S - 2 (stage 0's first B) on, every tick has a W slot for the deferred ones.
        U, T0 = R * M, first_backward(S, R)
        return [(0, T0, "F"), (T0, 2 * S - 2, "FB"), (2 * S - 2, U + S - 1, "FBW"), (U + S - 1, U + T0 + S - 1, "BW")]

    def formula(self, S: int, R: int, M: int) -> str:
        c = self.costs
        return (f"(S - 1)(F + B) / ((M + S - 1)(F + B) + M W), F {c['F']} B {c['B']} W {c['W']} = "
                f"{S - 1} x {c['F'] + c['B']} / ({M + S - 1} x {c['F'] + c['B']} + {M} x {c['W']})")

    def in_flight(self, S: int, R: int, M: int) -> int:
        return self.stash_slots(S, R) + S  # stage inputs, and the output cotangents of deferred W's
