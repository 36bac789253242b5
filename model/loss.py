"""The language-model loss: next-token cross-entropy sums over a batch of token rows, whole or
a chunk of positions at a time, and the types of the loss and gradient functions built on it.

The trainer differentiates these through the model (trainer/step.py); the 1F1B pipeline
schedules call them per microbatch and differentiate by hand (pipeline/grads.py), so they live
with the model, below both.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Array = jax.Array

# loss(params, batch) -> (loss sum, aux): aux is the target count, or with MoE router losses
# (count, [count x each MoE metric of trainer/step.py]); every aux leaf adds up over micro-batches.
LossFn = Callable[[dict, dict], tuple[Array, Any]]
GradFn = Callable[[dict, dict], tuple[tuple[Array, Any], dict]]  # ((loss sum, aux), gradients)


def cross_entropy_sum(logits: Array, targets: Array, weights: Array, gather: bool | None = None) -> Array:
    """Sum of the next-token losses weighted by `weights` (1 for a target, 0 for none), in
    float32 whatever the logits' dtype (`model.logits_dtype`).

    Each target's logit is taken by a gather (`gather=True`) or by a masked sum over the
    vocabulary (`False`): the same values, gradients equal to float32 rounding. `None` picks the
    masked sum for logits narrower than float32 and the gather for float32 ones, which is what
    holds least memory on TPU: from bf16 logits every use is then one upcast-and-reduce fusion, no
    float32 [batch, length, vocab] copy exists and the logits die before the layers' backward
    pass (with a gather, libtpu keeps the upcast copy alive through it); from float32 logits the
    gather needs less. Under a `vmap`
    sharded over a mesh axis (the pipeline head's pieces) pass False: the partitioner would
    all-gather a gather's whole operand, the logits, onto every device."""
    if gather is None:
        gather = logits.dtype == jnp.float32
    logits = logits.astype(jnp.float32)
    if gather:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    else:
        shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
        losses = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1)) - jnp.sum(jnp.where(hit, shifted, 0.0), axis=-1)
    return jnp.sum(losses * weights)


def chunked_cross_entropy_sum(model: nnx.Module, x: Array, targets: Array, weights: Array, chunk: int,
                              gather: bool | None = None) -> Array:
    """The same sum as `cross_entropy_sum(model.logits(x), ...)`, computed `chunk` positions at
    a time under remat: the [batch, length, vocab] logits never exist at once (with a
    128k vocabulary they would be the largest tensor of the step); the backward pass recomputes
    each chunk's logits instead of storing them."""
    b, length, d = x.shape
    n = length // chunk
    split = lambda a: a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)  # noqa: E731 [n, batch, chunk, ...]

    @jax.checkpoint
    def body(total: Array, piece: tuple[Array, Array, Array]) -> tuple[Array, None]:
        xc, tc, wc = piece
        return total + cross_entropy_sum(model.logits(xc, tied_grads=False), tc, wc, gather), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(targets), split(weights)))
    return total


def model_inputs(batch: dict[str, Array]) -> dict[str, Array]:
    """A batch of token rows -> {"inputs", "targets", "weights"} (+ "positions", "segment_ids"
    for document packing: padding (segment 0) and targets across a document boundary weigh 0).
    A "loss_mask" (supervised fine-tuning) also gives weight 0 to every target it does not mark.
    A training step's "noise" (LoRA dropout, one per input token: model/lora.py) passes through."""
    tokens, segments = batch["tokens"], batch.get("segment_ids")
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if segments is None:
        out["weights"] = jnp.ones(out["targets"].shape, jnp.float32)
    else:
        out["weights"] = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)).astype(jnp.float32)
        out.update(positions=batch["positions"][:, :-1], segment_ids=segments[:, :-1])
    if "loss_mask" in batch:
        out["weights"] = out["weights"] * (batch["loss_mask"][:, 1:] != 0)
    if "noise" in batch:
        out["noise"] = batch["noise"]
    return out


def head_loss(model: nnx.Module, x: Array, targets: Array, weights: Array, loss_chunk: int,
              gather: bool | None = None) -> Array:
    """The weighted loss sum of the final hidden states x [batch, length, embed] (`gather`:
    `cross_entropy_sum`'s)."""
    if loss_chunk:
        return chunked_cross_entropy_sum(model, x, targets, weights, loss_chunk, gather)
    return cross_entropy_sum(model.logits(x), targets, weights, gather)
