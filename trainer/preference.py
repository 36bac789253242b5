"""The DPO objective's pieces of the train step: the frozen reference's log-probs of a batch and
the policy's preference loss (model/preference.py), built like `make_loss_fn` from a `Compute`.

A DPO batch is {"tokens", "loss_mask"} int32 [pairs, 2, seq_len + 1] (data/pairs.py). The
reference is the run's starting weights, held sharded like the policy in `TrainState.ref_params`
(under LoRA, the frozen base itself with the adapters' B zeroed, `model.lora.switched_off`: no copy);
its log-probs are computed at the start of each step, micro-batch by micro-batch, and travel
with the batch as "ref_logps" [pairs, 2], so micro-batching and the gradient code see one batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs.post import DPOConfig
from model.inputs import TokenInputs
from model.kernels import use_kernels
from model.lora import switched_off
from model.loss import LossFn
from model.preference import preference_loss, sequence_logps
from model.router import router_loss
from pipeline.stages import from_microbatches, to_microbatches
from trainer.compute import Compute

Array = jax.Array

# The summed statistics of a DPO step's aux, after the pair count; each a per-pair mean once divided.
DPO_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def _logps(graphdef: nnx.GraphDef, compute: Compute, params: dict, batch: dict[str, Array],
           mean: bool) -> tuple[Array, Array]:
    """(log-probs [pairs, 2] of each response's trained tokens (sums, or per-token means), the
    router statistics of an MoE model (model/moe.py STATS; zeros for a dense one))."""
    model = nnx.merge(graphdef, params if compute.cast is None else compute.cast(params))
    # [pairs, 2, length] -> [2 * pairs, length], a pair's rows side by side: a device's block of
    # pairs becomes its block of rows (no data moves), and one forward pass (one weight gather
    # under FSDP) serves both responses.
    tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
    mask = batch["loss_mask"].reshape(tokens.shape)
    inputs, targets, weights = tokens[:, :-1], tokens[:, 1:], mask[:, 1:].astype(jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    noise = batch["noise"].reshape(inputs.shape) if "noise" in batch else None  # the policy's LoRA dropout
    inputs, targets, weights, positions, noise = compute.in_order(inputs, targets, weights, positions, noise)
    with use_kernels(compute.kernels):
        x, stats = model.features_and_stats(inputs, TokenInputs(positions, None, noise), runner=compute.runner)
    logps = sequence_logps(model, x, targets, weights)
    if mean:
        logps = logps / jnp.maximum(jnp.sum(weights, axis=-1), 1.0)
    return logps.reshape(-1, 2), stats


def make_reference_fn(graphdef: nnx.GraphDef, compute: Compute, dpo: DPOConfig) -> Callable[[dict, dict], Array]:
    """ref_logps(ref_params, batch) -> [pairs, 2], without gradients, one micro-batch at a time
    (so the reference never holds more activations than the policy's step does)."""
    mean = dpo.loss == "ipo"

    def ref_logps(ref_params: dict, batch: dict[str, Array]) -> Array:
        ref_params = jax.lax.stop_gradient(ref_params)
        if compute.grad_accum == 1:
            return _logps(graphdef, compute, ref_params, batch, mean)[0]
        micro = jax.tree.map(lambda a: to_microbatches(a, compute.grad_accum), batch)
        return from_microbatches(jax.lax.map(lambda mb: _logps(graphdef, compute, ref_params, mb, mean)[0], micro))

    return ref_logps


def reference_params(params: dict, ref_params: dict | None) -> dict:
    """DPO's reference weights: the frozen copy of the starting weights, or under LoRA (no copy
    held, `ref_params` None) the policy's own base with its adapters switched off."""
    return switched_off(params) if ref_params is None else ref_params


def make_dpo_loss_fn(graphdef: nnx.GraphDef, compute: Compute, dpo: DPOConfig) -> LossFn:
    """loss(params, batch with "ref_logps") -> (sum of the pairs' losses, (pairs, [the sums of
    DPO_METRICS])): divided by the pair count, the means over all pairs of the step. An MoE
    policy's router losses join the sum, this batch's per-token means times its pair count (as the
    LM loss weighs them by its target count), so micro-batches weigh by pairs."""
    mean, moe = dpo.loss == "ipo", compute.moe

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, tuple[Array, Array]]:
        policy, router = _logps(graphdef, compute, params, batch, mean)
        losses, chosen, rejected = preference_loss(policy, batch["ref_logps"], dpo.beta, dpo.loss)
        total = jnp.sum(losses)
        if moe is not None:
            total = total + router_loss(router, moe) * losses.shape[0]
        stats = jnp.stack([jnp.sum(chosen), jnp.sum(rejected), jnp.sum(chosen - rejected),
                           jnp.sum((chosen > rejected).astype(jnp.float32))])
        return total, (jnp.asarray(losses.shape[0], jnp.float32), stats)

    return loss_fn


def make_dpo_eval_fn(graphdef: nnx.GraphDef, compute: Compute, dpo: DPOConfig) -> Callable[[dict, Any, dict], Any]:
    """The held-out DPO evaluation: (params, ref_params (None under LoRA: the base), batch of
    pairs) -> (sum of the pairs' losses, (pairs, [the sums of DPO_METRICS])), the DPO loss alone
    (no router losses) and, without the training step's noise, no LoRA dropout."""
    reference = make_reference_fn(graphdef, compute, dpo)
    loss_fn = make_dpo_loss_fn(graphdef, dataclasses.replace(compute, moe=None), dpo)

    def dpo_eval(params: dict, ref_params: dict | None, batch: dict[str, Array]) -> Any:
        return loss_fn(params, {**batch, "ref_logps": reference(reference_params(params, ref_params), batch)})

    return dpo_eval
