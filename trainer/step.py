"""The pure train step: the objective's loss, gradients (optionally accumulated over micro-batches), update.

With LoRA adapters (model/lora.py) the step differentiates with respect to the adapters only:
the base weights enter the loss as constants, so no gradient is computed for them, the optimizer
sees the adapters alone and the base weights leave the step as they came in.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model.lora import join, split, token_noise
from model.loss import GradFn, LossFn
from pipeline.stages import to_microbatches
from trainer.compute import Compute
from trainer.objectives import Objective
from trainer.optimizer import schedule_count, without_router_bias
from trainer.state import TrainState

Array = jax.Array


def accumulate(
    loss_fn: LossFn, params: dict, batch: dict[str, Array], steps: int, grad_fn: GradFn | None = None
) -> tuple[Array, dict]:
    """`accumulate_stats` without the summed aux."""
    loss, grads, _ = accumulate_stats(loss_fn, params, batch, steps, grad_fn)
    return loss, grads


def accumulate_stats(
    loss_fn: LossFn, params: dict, batch: dict[str, Array], steps: int, grad_fn: GradFn | None = None
) -> tuple[Array, dict, Any]:
    """The per-token mean loss over the whole batch and its gradients, computed over `steps`
    equal micro-batches (the split of `pipeline.stages.to_microbatches`) by a scan.
    `grad_fn` replaces autodiff of `loss_fn` where a pipeline schedule computes the gradients.

    Each micro-batch gives the gradient of its loss *sum*; sums, token counts and gradients add
    up in float32 and are divided once by the batch's token count, so the result is the one-big-
    batch mean even when packing leaves the micro-batches with different numbers of targets.
    Also returns the loss function's aux summed over the micro-batches."""
    grad_fn = grad_fn or jax.value_and_grad(loss_fn, has_aux=True)
    if steps == 1:
        (total, aux), grads = grad_fn(params, batch)
    else:

        def body(carry: tuple[Array, dict], mb: dict[str, Array]) -> tuple[tuple[Array, dict], Any]:
            (total, aux), grads = grad_fn(params, mb)
            return (carry[0] + total, jax.tree.map(jnp.add, carry[1], grads)), aux

        # Each micro-batch's aux leaves the scan stacked rather than summed in its carry: a carry
        # needs the aux's structure before the scan traces grad_fn, and learning it by eval_shape
        # traced the whole loss and gradient (or pipeline schedule) once more: a quarter to a half of
        # tracing and lowering the train step. The sum below adds them in the carry's order, from
        # zero: the same values bitwise.
        micro = jax.tree.map(lambda x: to_microbatches(x, steps), batch)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (total, grads), auxes = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
        add = lambda carry, a: (jax.tree.map(jnp.add, carry, a), None)  # noqa: E731
        aux, _ = jax.lax.scan(add, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), auxes), auxes)
    count = jnp.maximum(jax.tree.leaves(aux)[0], 1.0)  # a batch of padding only: loss and gradients 0, not NaN
    return total / count, jax.tree.map(lambda g: g / count, grads), aux


def step_noise(seed: int, step: Array, tokens: Array) -> Array:
    """LoRA dropout's noise for a step's batch (model/lora.py): one uint32 per input token of the
    whole batch, [rows..., length] (tokens [rows..., length + 1]), before any micro-batch split."""
    return token_noise(seed, step, (*tokens.shape[:-1], tokens.shape[-1] - 1))


def _adapter_grads(grad_fn: GradFn, frozen: dict) -> GradFn:
    """A schedule's gradient function (which differentiates every parameter it is given) over
    the adapters alone, the base weights joined in as they are; their gradients are dropped."""

    def adapter_grads(adapters: dict, batch: dict[str, Array]) -> tuple[Any, dict]:
        out, grads = grad_fn(join(adapters, frozen), batch)
        return out, split(grads)[0]

    return adapter_grads


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, *,
                    compute: Compute, objective: Objective) -> Callable[[TrainState, dict[str, Array]],
                                                                          tuple[TrainState, dict[str, Array]]]:
    """The pure train step: what the objective adds to the batch (DPO's reference log-probs),
    LoRA dropout's noise, the objective's loss and gradients as `compute` says to take them
    (accumulated over its micro-batches), the optimizer update, and the step's metrics."""
    loss_fn, prepare = objective.loss_fn(graphdef, compute), objective.batch_fn(graphdef, compute)
    noise_seed = objective.noise_seed

    def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
        if prepare is not None:
            batch = prepare(state.params, state.ref_params, batch)
        if noise_seed is not None:  # after the objective's additions, which run without dropout
            batch = {**batch, "noise": step_noise(noise_seed, state.step, batch["tokens"])}
        adapters, frozen = split(state.params)
        train, frozen = (adapters, frozen) if adapters else (state.params, {})
        over = (lambda a, b: loss_fn(join(a, frozen), b)) if adapters else loss_fn  # noqa: E731
        grad_fn = _adapter_grads(compute.grad_fn, frozen) if adapters and compute.grad_fn else compute.grad_fn
        loss, grads, aux = accumulate_stats(over, train, batch, compute.grad_accum, grad_fn)
        grad_norm = optax.tree.norm(without_router_bias(grads))  # the bias's gradient is its load
        updates, opt_state = tx.update(grads, state.opt_state, train)
        params = optax.apply_updates(train, updates)
        # A non-finite loss or gradient skips the update: parameters and optimizer state stay
        # as they were (the step counter and the data still advance).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        # The rate this update used: optax indexes the schedule by its own count, which a skipped
        # step does not advance, so after one it lags `state.step`.
        lr = lr_schedule(schedule_count(state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite, **objective.step_metrics(aux)}
        new = state.replace(  # the frozen weights pass through untouched
            step=state.step + 1, params=join(keep(params, train), frozen), opt_state=keep(opt_state, state.opt_state)
        )
        return new, metrics

    return train_step
