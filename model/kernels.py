"""The one place a run hands the model kernels of its own: `Kernels`, bound by `use_kernels`.

The model is written once and knows no mesh. Some of its computations depend on how the run
lays the model out: attention under a sequence split runs as a sharded kernel (ring attention,
splash under shard_map), a mixture of experts under expert parallelism moves its tokens to
the experts' devices, and under FSDP the embedding lookup trades rows instead of gathering the
table. The trainer builds those functions from the mesh and binds them here while
it traces the step, as flax binds its logical-axis rules (`nn.logical_axis_rules`); the layers
read them with `current()`. Nothing bound: every layer runs its own kernel.

A context (not constructor arguments) because the layers are re-merged from their state inside
the layer scan and the pipeline runners on every trace, where no constructor runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, NamedTuple

import jax

Array = jax.Array
# (q, k, v, positions, segment_ids) -> out [batch, length, heads, head_dim]
AttentionFn = Callable[[Array, Array, Array, Array, "Array | None"], Array]


class Experts(NamedTuple):
    """A mixture's SwiGLU expert weights in the compute dtype, as one value (a pytree): gate and
    up [E, d, f], down [E, f, d], E the experts at hand (under expert parallelism, a device's)."""

    gate: Array
    up: Array
    down: Array


# (x [b, l, d], expert ids [b, l, k], weights [b, l, k], experts, capacity_factor)
#   -> (y [b, l, d], kept [b, l, k] bool)
DispatchFn = Callable[[Array, Array, Array, Experts, float], tuple[Array, Array]]
# (table [vocab, embed] in the compute dtype, tokens [b, l]) -> rows [b, l, embed]
LookupFn = Callable[[Array, Array], Array]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What replaces the model's own kernels (None: the model's own)."""

    attention: AttentionFn | None = None  # every attention layer calls it instead of `model.attention`'s kernel
    dispatch: DispatchFn | None = None  # every MoE layer hands its routed tokens to it (None: local)
    lookup: LookupFn | None = None  # the embedding lookup (None: the table gathered, then looked up)


_BOUND: contextvars.ContextVar[Kernels] = contextvars.ContextVar("kernels", default=Kernels())


@contextlib.contextmanager
def use_kernels(kernels: Kernels) -> Iterator[None]:
    """While tracing under it, the model's layers run `kernels`."""
    token = _BOUND.set(kernels)
    try:
        yield
    finally:
        _BOUND.reset(token)


def current() -> Kernels:
    """The kernels bound by the innermost `use_kernels` (the model's own outside any)."""
    return _BOUND.get()
