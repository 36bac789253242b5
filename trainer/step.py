"""The pure train step: loss, gradients (optionally accumulated over micro-batches), update.

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

from model.flops import moe_layer_count
from model.inputs import TokenInputs
from model.kernels import use_kernels
from model.lora import join, split, token_noise
from model.loss import GradFn, LossFn, head_loss, model_inputs
from model.mtp import mtp_losses, mtp_targets
from model.router import STATS, router_loss
from pipeline.stages import to_microbatches
from trainer.compute import Compute
from trainer.optimizer import schedule_count, without_router_bias
from trainer.preference import DPO_METRICS, make_dpo_eval_fn, make_dpo_loss_fn, make_reference_fn, reference_params
from trainer.state import TrainState

Array = jax.Array


# The MoE metrics of a step (model/router.py STATS, averaged over layers), each a per-token mean;
# the last, `bias_load`, is zero by construction (only its gradient means something): not one.
MOE_METRICS = ("lm_loss",) + tuple(f"moe_{name}" for name in STATS[:4])

LOSS_STATS = ("aux_loss", "z_loss", "bias_load")  # the router statistics the training loss takes


def make_loss_fn(graphdef: nnx.GraphDef, compute: Compute = Compute(), *, router_losses: bool = False) -> LossFn:
    """loss(params, batch) -> (sum of the per-token losses, number of target tokens), both
    float32 scalars: the mean is their ratio, and the sums of several batches divided once give
    the mean over all their tokens, however unevenly the tokens fall into the batches.

    A batch is {"tokens"} (rows of seq_len + 1), plus "segment_ids" and "positions" for document
    packing: then attention stays within a document, positions restart per document, and
    padding (segment 0) and targets across a document boundary carry no loss. `compute` says how
    (trainer/compute.py): the compute-dtype cast inside the differentiated function (so gathers
    and gradient reductions move the compute dtype), the layer runner, the kernels bound into the
    model, a sequence split's load-balanced order, the loss chunk. `router_losses` with an MoE
    model (`compute.moe`): the loss sum gains the router losses, each a per-token mean of this
    batch times its target count (so that micro-batches weigh by tokens as the cross-entropy
    does), and aux carries the MoE metrics; without them the loss is the cross-entropy alone (eval).
    The same for multi-token prediction (`model.mtp_depth`, model/mtp.py): with `router_losses`
    the loss gains `compute.mtp_loss_coef` x its mean loss x the target count, and aux its mean loss."""
    cast, moe = compute.cast, compute.moe if router_losses else None

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, Array]:
        model = nnx.merge(graphdef, params if cast is None else cast(params))
        b = model_inputs(batch)
        inputs, targets, weights = b["inputs"], b["targets"], b["weights"]
        positions, seg_in, noise = b.get("positions"), b.get("segment_ids"), batch.get("noise")
        depth = compute.mtp_depth if router_losses else 0
        # Tokens ahead are found in sequence order, before any reorder below.
        extra = mtp_targets(inputs, targets, weights, depth) if depth else {}
        if compute.order is not None and positions is None:  # a reordered row needs its positions
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        inputs, targets, weights, positions, seg_in, noise = compute.in_order(
            inputs, targets, weights, positions, seg_in, noise)
        extra = dict(zip(extra, compute.in_order(*extra.values(), axis=2)))
        with use_kernels(compute.kernels):
            token_inputs = TokenInputs.of(inputs, positions, seg_in, noise)
            x, stats = model.features_and_stats(inputs, token_inputs, runner=compute.runner)
            mtp = None
            if depth:
                mtp, mtp_stats = mtp_losses(model, x, token_inputs, extra, compute.loss_chunk)
                mtp = mtp.mean()
                if moe is not None:
                    # Each module's block is one more MoE layer in the loss terms' mean (its router
                    # losses, its bias's load); the logged dropped share and imbalance, maxima over
                    # a batch that a pipeline splits differently for the modules, stay the stack's.
                    layers = moe_layer_count(model.cfg)
                    merged = (stats * layers + mtp_stats) / (layers + depth)
                    stats = jnp.where(jnp.array([s in LOSS_STATS for s in STATS]), merged, stats)
        ce, count = head_loss(model, x, targets, weights, compute.loss_chunk), jnp.sum(weights)
        if moe is None and mtp is None:
            return ce, count
        loss, metrics = ce, [ce[None]]
        if moe is not None:
            loss = loss + router_loss(stats, moe) * count
            metrics.append(stats[:4] * count)
        if mtp is not None:
            loss = loss + compute.mtp_loss_coef * mtp * count
            metrics.append((mtp * count)[None])
        return loss, (count, jnp.concatenate(metrics))

    return loss_fn


def make_eval_fn(graphdef: nnx.GraphDef, compute: Compute) -> Callable[[dict, Any, dict[str, Array]], Any]:
    """The held-out evaluation, (params, ref_params, batch) -> the LM loss's (sum, target count), or
    under DPO (trainer/preference.py) the pairs' (loss sum, (pairs, DPO metric sums)); neither
    with router losses or LoRA dropout."""
    if compute.objective == "dpo":
        return make_dpo_eval_fn(graphdef, compute, compute.dpo)
    loss_fn = make_loss_fn(graphdef, compute)
    return lambda params, ref_params, batch: loss_fn(params, batch)


def aux_metrics(compute: Compute) -> tuple[str, ...]:
    """The names of the per-token means a training loss function's aux carries, in order."""
    return (MOE_METRICS if compute.moe is not None else ("lm_loss",)) + (("mtp_loss",) if compute.mtp_depth else ())


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


def objective_metrics(compute: Compute, aux: Any) -> dict[str, Array]:
    """The metrics of the step's objective from its summed aux: the MoE router's and multi-token
    prediction's per-token means;
    the trained (assistant) tokens of SFT; DPO's per-pair means of the rewards, margin, accuracy."""
    if compute.objective == "dpo":
        pairs = jnp.maximum(aux[0], 1.0)
        return {name: value / pairs for name, value in zip(DPO_METRICS, aux[1])}
    out = {"trained_tokens": jax.tree.leaves(aux)[0]} if compute.objective == "sft" else {}
    if isinstance(aux, tuple):  # MoE or multi-token prediction: their per-token means
        count = jnp.maximum(aux[0], 1.0)
        out.update({name: value / count for name, value in zip(aux_metrics(compute), aux[1])})
    return out


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


def make_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, *, compute: Compute
) -> Callable[[TrainState, dict[str, Array]], tuple[TrainState, dict[str, Array]]]:
    """The pure train step: the loss and gradients `compute` says how to take (accumulated over
    its micro-batches), the optimizer update, and the step's metrics. Under DPO the frozen
    reference's log-probs (of `state.ref_params`, or under LoRA of the base weights with the
    adapters switched off) join the batch first (trainer/preference.py)."""
    dpo = compute.objective == "dpo"
    loss_fn = make_dpo_loss_fn(graphdef, compute, compute.dpo) if dpo else make_loss_fn(graphdef, compute,
                                                                                        router_losses=True)
    reference = make_reference_fn(graphdef, compute, compute.dpo) if dpo else None

    def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
        if reference is not None:
            ref = reference_params(state.params, state.ref_params)
            batch = {**batch, "ref_logps": reference(ref, batch)}
        if compute.noise_seed is not None:  # after the reference, which runs without dropout
            batch = {**batch, "noise": step_noise(compute.noise_seed, state.step, batch["tokens"])}
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
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite, **objective_metrics(compute, aux)}
        new = state.replace(  # the frozen weights pass through untouched
            step=state.step + 1, params=join(keep(params, train), frozen), opt_state=keep(opt_state, state.opt_state)
        )
        return new, metrics

    return train_step
