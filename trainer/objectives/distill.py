"""`train.objective=distill`: knowledge distillation, the student against a frozen teacher's logits.

Per target token the loss is (1 - w) T^2 KL(teacher_T || student_T) + w CE, where T is
`distill.temperature`, both distributions softmax(logits / T), w is `distill.lm_weight` and CE the
student's next-token cross-entropy; like the LM loss it is a sum over target tokens with their
weights and a count, so micro-batches and accumulation give the one-batch mean exactly.

The teacher (`distill.teacher`) is a meshlm run directory (config.yaml and its newest checkpoint)
or a Hugging Face one (config.json), told apart by which file it holds. It may be any size with
the student's vocabulary. Its weights are the objective's `Frozen` weights: loaded once when the
run starts, sharded by the run's parameter rules in `TrainState.ref_params`, out of the optimizer,
and saved and restored with the state like DPO's reference (a resumed run uses the teacher it
started with, whatever the directory holds since; `distill.teacher` is a resume key). At the start
of each step the teacher runs on the batch micro-batch by micro-batch without gradients, with the
model's own layer scan and the run's kernels, and its temperature log-probs [rows, length, vocab]
join the batch (as DPO's reference log-probs do): the student's loss, micro-batched with the rest
of the batch, needs no other input. Holding them whole is why `model.loss_chunk` is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import Config, ModelConfig
from configs.post import DistillConfig
from model.loss import LossFn, cross_entropy_sum, model_inputs
from model.terms import metric_names
from trainer.compute import Compute
from trainer.forward import by_microbatch, forward
from trainer.frozen import load_dir, model_of_dir
from trainer.objectives.lm import add_terms, terms_console
from trainer.objectives.registry import BatchFn, EvalFn, Frozen, Objective, register, require
from trainer.state import abstract_model

Array = jax.Array
KEY = "distill.teacher"
# The student's settings of how a network computes (not its shapes) that the teacher runs with too.
SHARED_KEYS = ("seq_len", "dtype", "attention", "remat")


def teacher_model(cfg: Config) -> ModelConfig:
    """The teacher's network, running as the student's does (SHARED_KEYS)."""
    require(bool(cfg.distill.teacher), KEY, "train.objective=distill needs a teacher: a meshlm run directory or a "
            "Hugging Face one")
    model = model_of_dir(cfg.distill.teacher, KEY)
    return dataclasses.replace(model, **{k: getattr(cfg.model, k) for k in SHARED_KEYS})


def teacher_compute(compute: Compute) -> Compute:
    """The run's kernels, order and micro-batches, with the model's own scan: the teacher's layer
    count need not fit a pipeline, and it takes no gradient. No compute-dtype cast pinned to the
    student's shardings either: each weight is cast where the model uses it, the same values."""
    return dataclasses.replace(compute, runner=None, grad_fn=None, cast=None)


def make_teacher_fn(graphdef: nnx.GraphDef, compute: Compute, temperature: float) -> Callable[[dict, dict], Array]:
    """logps(teacher params, batch) -> the teacher's log-probs at `temperature` [rows, length,
    vocab] float32, in the compute's position order, without gradients, one micro-batch at a time
    (the teacher never holds more activations than the student's step does)."""
    compute = teacher_compute(compute)

    def one(params: dict, batch: dict[str, Array]) -> Array:
        out = forward(graphdef, compute, params, model_inputs(batch))
        return jax.nn.log_softmax(out.model.logits(out.x).astype(jnp.float32) / temperature, axis=-1)

    def logps(params: dict, batch: dict[str, Array]) -> Array:
        return by_microbatch(functools.partial(one, jax.lax.stop_gradient(params)), batch, compute.grad_accum)

    return logps


def kl_sum(logits: Array, teacher_logps: Array, weights: Array, temperature: float) -> Array:
    """Sum over targets of weight x KL(teacher_T || student_T), in float32."""
    student = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    per_token = jnp.sum(jnp.exp(teacher_logps) * (teacher_logps - student), axis=-1)
    return jnp.sum(per_token * weights)


def make_distill_loss_fn(graphdef: nnx.GraphDef, compute: Compute, distill: DistillConfig, *,
                         model_terms: bool = False) -> LossFn:
    """loss(params, batch with "teacher_logps") -> (the distillation loss sum, (target count,
    [the sums of the KL, of the cross-entropy, then of the model's term metrics])). With
    `model_terms` (training) the model's loss terms join the sum, as in the LM loss."""
    t, w = distill.temperature, distill.lm_weight

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, tuple[Array, Array]]:
        out = forward(graphdef, compute, params, model_inputs(batch), model_terms)  # with the student's dropout
        logits = out.model.logits(out.x)
        kl = kl_sum(logits, batch["teacher_logps"], out.weights, t)
        ce, count = cross_entropy_sum(logits, out.targets, out.weights), jnp.sum(out.weights)
        total, metrics = add_terms((1.0 - w) * t * t * kl + w * ce, count, out.terms, [kl, ce])
        return total, (count, jnp.stack(metrics))

    return loss_fn


@register
class Distill(Objective):
    name = "distill"
    data_format = "lm"  # the LM corpora; an SFT corpus's loss mask would need data_format "sft"
    token_loss = False  # the 1F1B family's own gradient code has the LM loss only

    def check(self) -> None:
        cfg = self.cfg
        require(cfg.model.loss_chunk == 0, "model.loss_chunk", "train.objective=distill holds the teacher's "
                "log-probs over the whole vocabulary for every position; set 0")
        teacher = self.frozen.model  # the teacher's directory read once, here
        require(teacher.vocab_size == cfg.model.vocab_size, KEY, f"the teacher at {cfg.distill.teacher} has "
                f"vocab_size {teacher.vocab_size}, the student (model.vocab_size) {cfg.model.vocab_size}: they must match")

    @functools.cached_property
    def frozen(self) -> Frozen:
        model, path = teacher_model(self.cfg), self.cfg.distill.teacher
        return Frozen(model, functools.partial(load_dir, path, model, key=KEY), KEY)

    def batch_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> BatchFn:
        logps = make_teacher_fn(abstract_model(self.frozen.model).graphdef, compute, self.cfg.distill.temperature)
        return lambda params, teacher, batch: {**batch, "teacher_logps": logps(teacher, batch)}

    def loss_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> LossFn:
        return make_distill_loss_fn(graphdef, compute, self.cfg.distill, model_terms=True)

    def eval_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> EvalFn:
        """The held-out distillation loss, KL and cross-entropy (no model terms, no dropout)."""
        with_teacher = self.batch_fn(graphdef, compute)
        loss_fn = make_distill_loss_fn(graphdef, compute, self.cfg.distill)
        return lambda params, teacher, batch: loss_fn(params, with_teacher(params, teacher, batch))

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        count = jnp.maximum(aux[0], 1.0)
        names = ("kl", "lm_loss") + metric_names(self.cfg.model)
        return {name: value / count for name, value in zip(names, aux[1])}

    def eval_metrics(self, sums: np.ndarray) -> tuple[float, dict[str, float], str]:
        count = max(sums[1], 1.0)
        means = {"kl": float(sums[2] / count), "lm_loss": float(sums[3] / count)}
        perplexity = math.exp(min(means["lm_loss"], 700.0))
        return float(sums[0] / count), {**means, "perplexity": perplexity}, (
            f"kl {means['kl']:.4f} | lm_loss {means['lm_loss']:.4f} | perplexity {perplexity:.2f}")

    def console(self, record: dict[str, float]) -> list[str]:
        # terms_console prints lm_loss itself beside an MoE's or MTP's terms.
        lm = "" if self.cfg.model.moe.enabled or self.cfg.model.mtp_depth else f" lm_loss {record['lm_loss']:.4f}"
        return terms_console(self.cfg, record, [f"kl {record['kl']:.4f}{lm}"])
