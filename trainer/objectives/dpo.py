"""`train.objective=dpo`: direct preference optimization of the policy against a frozen reference.

A DPO batch is {"tokens", "loss_mask"} int32 [pairs, 2, seq_len + 1] (data/pairs.py). The
reference is the run's starting weights, held sharded like the policy in `TrainState.ref_params`
(under LoRA, the frozen base itself with the adapters' B zeroed, `model.lora.switched_off`: no
copy); its log-probs are computed at the start of each step, micro-batch by micro-batch, and
travel with the batch as "ref_logps" [pairs, 2], so micro-batching and the gradient code see one
batch. The preference math is model/preference.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.post import DPOConfig
from model.lora import switched_off
from model.loss import LossFn
from model.preference import preference_loss, sequence_logps
from model.terms import LossTerm
from trainer.compute import Compute
from trainer.forward import by_microbatch, forward
from trainer.objectives.lm import add_terms
from trainer.objectives.registry import BatchFn, EvalFn, Objective, check_prepared, register, require

Array = jax.Array

# The summed statistics of a DPO step's aux, after the pair count; each a per-pair mean once divided.
DPO_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def _logps(graphdef: nnx.GraphDef, compute: Compute, params: dict, batch: dict[str, Array],
           mean: bool, model_terms: bool = False) -> tuple[Array, dict[str, LossTerm]]:
    """(log-probs [pairs, 2] of each response's trained tokens (sums, or per-token means), the
    model's loss terms when asked)."""
    # [pairs, 2, length] -> [2 * pairs, length], a pair's rows side by side: a device's block of
    # pairs becomes its block of rows (no data moves), and one forward pass (one weight gather
    # under FSDP) serves both responses.
    tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
    mask = batch["loss_mask"].reshape(tokens.shape)
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": mask[:, 1:].astype(jnp.float32)}
    if "noise" in batch:  # the policy's LoRA dropout
        rows["noise"] = batch["noise"].reshape(rows["inputs"].shape)
    out = forward(graphdef, compute, params, rows, model_terms)
    logps = sequence_logps(out.model, out.x, out.targets, out.weights)
    if mean:
        logps = logps / jnp.maximum(jnp.sum(out.weights, axis=-1), 1.0)
    return logps.reshape(-1, 2), out.terms


def make_reference_fn(graphdef: nnx.GraphDef, compute: Compute, dpo: DPOConfig) -> Callable[[dict, dict], Array]:
    """ref_logps(ref_params, batch) -> [pairs, 2], without gradients, one micro-batch at a time
    (so the reference never holds more activations than the policy's step does)."""
    mean = dpo.loss == "ipo"

    def ref_logps(ref_params: dict, batch: dict[str, Array]) -> Array:
        ref_params = jax.lax.stop_gradient(ref_params)
        return by_microbatch(lambda mb: _logps(graphdef, compute, ref_params, mb, mean)[0], batch, compute.grad_accum)

    return ref_logps


def reference_params(params: dict, ref_params: dict | None) -> dict:
    """DPO's reference weights: the frozen copy of the starting weights, or under LoRA (no copy
    held, `ref_params` None) the policy's own base with its adapters switched off."""
    return switched_off(params) if ref_params is None else ref_params


def make_dpo_loss_fn(graphdef: nnx.GraphDef, compute: Compute, dpo: DPOConfig, *, model_terms: bool = False) -> LossFn:
    """loss(params, batch with "ref_logps") -> (sum of the pairs' losses, (pairs, [the sums of
    DPO_METRICS])): divided by the pair count, the means over all pairs of the step. With
    `model_terms` (training), the model's loss terms (an MoE's router losses) join the sum, each
    per-token mean times the pair count (as the LM loss weighs them by its target count)."""
    mean = dpo.loss == "ipo"

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, tuple[Array, Array]]:
        policy, terms = _logps(graphdef, compute, params, batch, mean, model_terms)
        losses, chosen, rejected = preference_loss(policy, batch["ref_logps"], dpo.beta, dpo.loss)
        total, _ = add_terms(jnp.sum(losses), losses.shape[0], terms, [])
        stats = jnp.stack([jnp.sum(chosen), jnp.sum(rejected), jnp.sum(chosen - rejected),
                           jnp.sum((chosen > rejected).astype(jnp.float32))])
        return total, (jnp.asarray(losses.shape[0], jnp.float32), stats)

    return loss_fn


@register
class DPO(Objective):
    name = "dpo"
    data_format = "dpo"
    rows_per_example = 2  # chosen and rejected
    token_loss = False

    def check(self) -> None:
        cfg = self.cfg
        check_prepared(cfg)
        require(cfg.data.packing == "concat", "data.packing", "train.objective=dpo pads each sequence of a pair to "
                "model.seq_len + 1 and packs nothing; leave data.packing=concat")
        require(cfg.model.loss_chunk == 0, "model.loss_chunk", "train.objective=dpo computes whole-row log-probs; "
                "set 0")
        require(cfg.model.mtp_depth == 0, "model.mtp_depth", f"{cfg.model.mtp_depth} with train.objective=dpo: the "
                "DPO loss is the main head's log-probs, so the prediction modules would get no gradient; set 0")

    reference_keys = ("model.lora.enabled",)

    @property
    def holds_reference(self) -> bool:
        # Under LoRA the reference is the base the adapters sit on (their B zeroed): no copy to hold.
        return not self.cfg.model.lora.enabled

    def batch_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> BatchFn:
        reference = make_reference_fn(graphdef, compute, self.cfg.dpo)

        def with_reference(params: dict, ref_params: Any, batch: dict[str, Array]) -> dict[str, Array]:
            return {**batch, "ref_logps": reference(reference_params(params, ref_params), batch)}

        return with_reference

    def loss_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> LossFn:
        return make_dpo_loss_fn(graphdef, compute, self.cfg.dpo, model_terms=True)

    def eval_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> EvalFn:
        """The held-out pairs' DPO loss alone (no router losses) and, without the training
        step's noise, no LoRA dropout."""
        with_reference = self.batch_fn(graphdef, compute)
        loss_fn = make_dpo_loss_fn(graphdef, compute, self.cfg.dpo)
        return lambda params, ref_params, batch: loss_fn(params, with_reference(params, ref_params, batch))

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        pairs = jnp.maximum(aux[0], 1.0)
        return {name: value / pairs for name, value in zip(DPO_METRICS, aux[1])}

    def eval_metrics(self, sums: np.ndarray) -> tuple[float, dict[str, float], str]:
        pairs = max(sums[1], 1.0)
        means = {name: float(v / pairs) for name, v in zip(DPO_METRICS, sums[2:])}
        return float(sums[0] / pairs), means, " | ".join(f"{k} {v:.4f}" for k, v in means.items())

    def console(self, r: dict[str, float]) -> list[str]:
        return [f"margin {r['reward_margin']:.3f} chosen {r['reward_chosen']:.3f} "
                f"rejected {r['reward_rejected']:.3f} accuracy {r['reward_accuracy']:.2f}"]
