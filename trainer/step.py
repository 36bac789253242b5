"""The pure train step: loss, gradients (optionally accumulated over micro-batches), update."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model import LayerRunner
from trainer.state import TrainState

Array = jax.Array


def cross_entropy(logits: Array, targets: Array, mask: Array | None = None) -> Array:
    """Mean next-token loss over the targets `mask` keeps (all if None); logits arrive in
    float32 so the log-softmax is exact enough."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return losses.mean()
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)


def chunked_cross_entropy(model: nnx.Module, x: Array, targets: Array, mask: Array | None, chunk: int) -> Array:
    """The same mean loss as `cross_entropy(model.logits(x), ...)`, computed `chunk` positions at
    a time under remat: the [batch, length, vocab] float32 logits never exist at once (with a
    128k vocabulary they would be the largest tensor of the step); the backward pass recomputes
    each chunk's logits instead of storing them."""
    b, length, d = x.shape
    n = length // chunk
    split = lambda a: a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)  # noqa: E731 [n, batch, chunk, ...]
    weights = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)

    @jax.checkpoint
    def body(total: Array, piece: tuple[Array, Array, Array]) -> tuple[Array, None]:
        xc, tc, wc = piece
        losses = optax.softmax_cross_entropy_with_integer_labels(model.logits(xc).astype(jnp.float32), tc)
        return total + jnp.sum(losses * wc), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(targets), split(weights)))
    return total / jnp.maximum(jnp.sum(weights), 1)


def make_loss_fn(
    graphdef: nnx.GraphDef,
    runner: LayerRunner | None = None,
    loss_chunk: int = 0,
    cast: Callable[[dict], dict] | None = None,
) -> Callable[[dict, dict], Array]:
    """loss(params, batch). A batch is {"tokens"} (rows of seq_len + 1), plus "segment_ids" and
    "positions" for document packing: then attention stays within a document, positions restart
    per document, and padding (segment 0) and targets across a document boundary carry no loss.
    `loss_chunk` > 0 computes the output head and loss that many positions at a time. `cast`
    maps the float32 parameters to their compute-dtype view (sharding.cast) inside the
    differentiated function, so gathers and gradient reductions move the compute dtype."""

    def loss_fn(params: dict, batch: dict[str, Array]) -> Array:
        model = nnx.merge(graphdef, params if cast is None else cast(params))
        tokens, segments = batch["tokens"], batch.get("segment_ids")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if segments is None:
            x, mask = model.features(inputs, runner=runner), None
        else:
            x = model.features(inputs, batch["positions"][:, :-1], segments[:, :-1], runner=runner)
            mask = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        if loss_chunk:
            return chunked_cross_entropy(model, x, targets, mask, loss_chunk)
        return cross_entropy(model.logits(x), targets, mask)

    return loss_fn


def accumulate(loss_fn: Callable, params: dict, batch: dict[str, Array], steps: int) -> tuple[Array, dict]:
    """Mean loss and gradients over `steps` equal micro-batches, summed in float32 by a scan.

    Micro-batch a takes rows a, a + steps, a + 2*steps, ...: each device's contiguous block of
    rows then holds whole groups, so splitting the batch moves no data between devices."""
    grad_fn = jax.value_and_grad(loss_fn)
    if steps == 1:
        return grad_fn(params, batch)
    split = lambda x: x.reshape(x.shape[0] // steps, steps, -1).swapaxes(0, 1)  # noqa: E731 [steps, B/steps, L]
    micro = jax.tree.map(split, batch)

    def body(carry: tuple[Array, dict], mb: dict[str, Array]) -> tuple[tuple[Array, dict], None]:
        loss, grads = grad_fn(params, mb)
        return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss / steps, jax.tree.map(lambda g: g / steps, grads)


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grad_accum: int,
    runner: LayerRunner | None = None,
    loss_chunk: int = 0,
    cast: Callable[[dict], dict] | None = None,
) -> Callable[[TrainState, dict[str, Array]], tuple[TrainState, dict[str, Array]]]:
    loss_fn = make_loss_fn(graphdef, runner, loss_chunk, cast)

    def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
        loss, grads = accumulate(loss_fn, state.params, batch, grad_accum)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient skips the update: parameters and optimizer state stay
        # as they were (the step counter and the data still advance).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "finite": finite}
        new = state.replace(
            step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state)
        )
        return new, metrics

    return train_step
