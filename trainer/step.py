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


def cross_entropy(logits: Array, targets: Array) -> Array:
    """Mean next-token loss; logits arrive in float32 so the log-softmax is exact enough."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def make_loss_fn(graphdef: nnx.GraphDef, runner: LayerRunner | None = None) -> Callable[[dict, Array], Array]:
    def loss_fn(params: dict, tokens: Array) -> Array:
        model = nnx.merge(graphdef, params)
        logits = model(tokens[:, :-1], runner=runner)
        return cross_entropy(logits, tokens[:, 1:])

    return loss_fn


def accumulate(loss_fn: Callable, params: dict, tokens: Array, steps: int) -> tuple[Array, dict]:
    """Mean loss and gradients over `steps` equal micro-batches, summed in float32 by a scan.

    Micro-batch a takes rows a, a + steps, a + 2*steps, ...: each device's contiguous block of
    rows then holds whole groups, so splitting the batch moves no data between devices."""
    grad_fn = jax.value_and_grad(loss_fn)
    if steps == 1:
        return grad_fn(params, tokens)
    batch = tokens.shape[0]
    micro = tokens.reshape(batch // steps, steps, -1).swapaxes(0, 1)  # [steps, batch/steps, length]

    def body(carry: tuple[Array, dict], mb: Array) -> tuple[tuple[Array, dict], None]:
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
) -> Callable[[TrainState, dict[str, Array]], tuple[TrainState, dict[str, Array]]]:
    loss_fn = make_loss_fn(graphdef, runner)

    def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
        loss, grads = accumulate(loss_fn, state.params, batch["tokens"], grad_accum)
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
