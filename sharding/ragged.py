"""A ragged all-to-all: each device sends each other device a slice of its rows of its own size.

`exchange` is `jax.lax.ragged_all_to_all` where the platform's compiler has it (TPU, GPU). XLA:CPU
has none (its thunk emitter reports the opcode unimplemented), so on CPU devices, which run the
tests, the same semantics are built from a dense `all_to_all` of every slice padded to the
operand's length: the same values arrive at the same places, so the code around it is the one
the accelerators run; only the bytes moved differ.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Slices:
    """One device's side of an exchange over P devices, each field [P] int32: where its slice
    for device j starts in its operand and how long it is, where that slice lands in device j's
    output, and how many rows it receives from device j."""

    input_offsets: Array
    send_sizes: Array
    output_offsets: Array
    recv_sizes: Array


def exchange(operand: Array, output: Array, slices: Slices, axis: str, native: bool) -> Array:
    """`output` with the rows other devices sent written where they said (inside shard_map over
    `axis`). `native`: the platform's ragged-all-to-all; else the dense emulation."""
    s = slices
    if native:
        return jax.lax.ragged_all_to_all(operand, output, s.input_offsets, s.send_sizes, s.output_offsets,
                                         s.recv_sizes, axis_name=axis)
    n = operand.shape[0]
    rows = jnp.arange(n)
    # [P, n]: slice j's rows, those past its size pointing at nothing (index n, dropped by the fill).
    picks = jnp.where(rows[None] < s.send_sizes[:, None], s.input_offsets[:, None] + rows[None], n)
    send = jnp.take(operand, picks, axis=0, mode="fill", fill_value=0)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [source, n, ...]
    lands = jax.lax.all_to_all(s.output_offsets, axis, 0, 0, tiled=True)  # where each source's slice goes here
    at = jnp.where(rows[None] < s.recv_sizes[:, None], lands[:, None] + rows[None], output.shape[0])
    return output.at[at.reshape(-1)].set(recv.reshape(-1, *operand.shape[1:]), mode="drop")
