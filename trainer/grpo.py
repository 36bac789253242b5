"""GRPO's trainer side: one rollout batch (prompts -> completions -> rewards -> advantages -> the
old log-probs from the trainer's own forward) and the loss the step differentiates over it.

The pieces of `train.objective=grpo` that need the trainer (trainer/forward.py) but not its loop:

- `target_logps`: per-target log-probs at the sampling temperature from the one forward pass, in
  the rows' own order (a sequence split's order undone), so old, new and reference log-probs and
  the sampler's line up token for token.
- `make_grpo_loss_fn`: a loss `(params, batch) -> (sum, (count, stats))` of the objective
  contract (trainer/objectives/registry.py), so the step's micro-batching and gradient
  accumulation (trainer/step.py `accumulate_stats`) take it as they take every loss.
- `GRPO.rollout_batch`: the host side of one step: sample with the model's KV-cached decoder
  (model/rollout.py), score the text with the rewards (trainer/rewards.py), normalize within each
  group (model/grpo.py), recompute the sampling policy's log-probs with the trainer's forward
  (the first update's ratio is then exactly 1, the same program computing both), and measure the
  largest gap between the sampler's and the trainer's log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import Config
from model.decode import Sampling, until_end
from model.grpo import STATS, PolicyLoss, averaging_weights, group_advantages, policy_loss
from model.loss import LossFn
from model.preference import token_logps
from model.rollout import Rollout, RolloutSpec, completion_logps, rollout, training_rows
from trainer.compute import Compute
from trainer.forward import forward
from trainer.objectives.lm import add_terms
from trainer.rewards import Rewards

Array = jax.Array
ROWS = ("inputs", "targets", "weights")  # the per-target arrays of a rollout's training rows
STEP_STATS = STATS + ("entropy",)  # a step's statistics: the loss's, then the policy's entropy


@dataclasses.dataclass(frozen=True)
class GRPOSpec:
    """The `rl` keys a GRPO step needs, as static values."""

    rollout: RolloutSpec
    loss: PolicyLoss
    updates: int  # rl.updates_per_rollout

    @property
    def temperature(self) -> float:
        return self.rollout.sampling.temperature


def grpo_spec(cfg: Config, end_id: int) -> GRPOSpec:
    """The run's GRPO settings; `end_id`: the tokenizer's end-of-document id."""
    rl = cfg.rl
    sampling = Sampling(float(rl.temperature), int(rl.top_k), float(rl.top_p))
    return GRPOSpec(RolloutSpec(rl.group_size, rl.max_new_tokens, sampling, end_id),
                    PolicyLoss(rl.clip, rl.kl_coef, rl.loss_averaging), rl.updates_per_rollout)


def target_logps(graphdef: nnx.GraphDef, compute: Compute, params: dict, rows: dict[str, Array],
                 temperature: float, with_terms: bool = False) -> tuple[Array, dict]:
    """(log softmax(logits / temperature)[target] x weight per target [rows, n] in the rows'
    order, the model's loss terms when asked) from the one forward pass."""
    logps, _, terms = _policy(graphdef, compute, params, rows, temperature, with_terms)
    return logps, terms


def _policy(graphdef: nnx.GraphDef, compute: Compute, params: dict, rows: dict[str, Array],
            temperature: float, with_terms: bool) -> tuple[Array, Array, dict]:
    """`target_logps` with the policy's entropy at each target (in nats, at the temperature)."""
    out = forward(graphdef, compute, params, rows, with_terms)
    logits = out.model.logits(out.x).astype(jnp.float32) / temperature
    # token_logps: the same program with or without gradients, so old == new bitwise.
    logps = token_logps(logits, out.targets) * out.weights
    # A metric only: no gradient flows through it.
    log_probs = jax.nn.log_softmax(jax.lax.stop_gradient(logits), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) * out.weights
    if compute.order is not None:  # a sequence split's load-balanced order, undone
        undo = np.argsort(compute.order)
        logps, entropy = logps[:, undo], entropy[:, undo]
    return logps, entropy, out.terms


def make_grpo_loss_fn(graphdef: nnx.GraphDef, compute: Compute, spec: GRPOSpec, *,
                      model_terms: bool = False) -> LossFn:
    """loss(params, batch) -> (the clipped loss with its KL summed, (count, [the sums of
    STEP_STATS])). batch: the training rows with "old_logps", "advantages" (each row's
    on every target) and, when
    rl.kl_coef > 0, "ref_logps" (`GRPO.rollout_batch`). With `model_terms` the model's own loss
    terms join the sum, weighed by the count as the LM loss weighs them."""

    def loss_fn(params: dict, batch: dict[str, Array]) -> tuple[Array, tuple[Array, Array]]:
        rows = {k: batch[k] for k in ROWS}
        logps, entropy, terms = _policy(graphdef, compute, params, rows, spec.temperature, model_terms)
        total, count, stats = policy_loss(logps, batch["old_logps"], batch.get("ref_logps"),
                                          batch["advantages"][:, 0], batch["weights"], spec.loss)
        total, _ = add_terms(total, count, terms, [])
        # The entropy averaged as the loss is, so it adds up over micro-batches as the loss does.
        weights, _ = averaging_weights(batch["weights"], spec.loss.averaging)
        return total, (count, jnp.concatenate([stats, jnp.sum(entropy * weights)[None]]))

    return loss_fn


def step_metrics(aux: Any) -> dict[str, Array]:
    """The means of a step's STEP_STATS from its loss's aux summed over micro-batches."""
    count = jnp.maximum(aux[0], 1.0)
    return {name: value / count for name, value in zip(STEP_STATS, aux[1])}


class GRPO:
    """The host side of GRPO on one model: rollouts, rewards and the batch a step trains on."""

    def __init__(self, graphdef: nnx.GraphDef, compute: Compute, spec: GRPOSpec, rewards: Rewards,
                 decode: Callable[[Sequence[int]], str]) -> None:
        self.graphdef, self.compute, self.spec, self.rewards, self.decode = graphdef, compute, spec, rewards, decode
        temperature = spec.temperature
        # Jitted once per shape: the policy's (and the reference's) log-probs without gradients.
        self.logps = jax.jit(lambda params, rows: jax.lax.stop_gradient(
            target_logps(graphdef, compute, params, rows, temperature)[0]))

    def sample(self, params: dict, prompts: np.ndarray, pad: np.ndarray, key: Array) -> Rollout:
        """`group_size` completions of each prompt from the policy `params` (its compute dtype)."""
        model = nnx.merge(self.graphdef, params if self.compute.cast is None else self.compute.cast(params))
        return rollout(model, prompts, pad, self.spec.rollout, key)

    def rollout_batch(self, params: dict, ref_params: dict | None, prompts: np.ndarray, pad: np.ndarray,
                      examples: Sequence[dict], key: Array) -> tuple[dict[str, Array], dict[str, float]]:
        """(the batch a step trains on, the rollout's metrics) for prompts int32 [P, L] left-padded
        by `pad`, each with its example ({"prompt", "answer"} texts) for the rewards. Raises
        RewardError (one line) for a reward that fails, before any update."""
        r = self.sample(params, prompts, pad, key)
        rewards = self._rewards(r, examples)
        batch = self.training_batch(params, ref_params, r, rewards)
        return batch, self._metrics(r, rewards, completion_logps(batch["old_logps"], r))

    def training_batch(self, params: dict, ref_params: dict | None, r: Rollout,
                       rewards: np.ndarray) -> dict[str, Array]:
        """The batch a step trains on from a rollout and its rewards (float32 [rows]): the rows,
        the old log-probs of `params` and, when rl.kl_coef > 0, the reference's, by the trainer's
        own forward under the activation rules in force, and each row's advantage."""
        rows = training_rows(r)
        old = self.logps(params, rows)  # the sampling policy, by the trainer's own forward
        # Each row's advantage on every target, so that every array of the batch is [rows, n] and
        # shards and splits into micro-batches as the rows do.
        advantages = group_advantages(rewards, self.spec.rollout.group_size)
        batch = {**rows, "old_logps": old, "advantages": jnp.broadcast_to(advantages[:, None], old.shape)}
        if self.spec.loss.kl_coef > 0:
            batch["ref_logps"] = self.logps(ref_params, rows)
        return batch

    def _rewards(self, r: Rollout, examples: Sequence[dict]) -> np.ndarray:
        """float32 [rows]: each completion's reward, its text cut before the end token."""
        # A completion's tokens after its first end token are end tokens (model/rollout.py `_cut`).
        texts = [self.decode(until_end(tokens, self.spec.rollout.end_id)) for tokens in np.asarray(r.completion)]
        rows_examples = [examples[i // self.spec.rollout.group_size] for i in range(len(texts))]
        return self.rewards.score([str(e.get("prompt", "")) for e in rows_examples], texts, rows_examples)

    def _metrics(self, r: Rollout, rewards: np.ndarray, trainer_logps: Array) -> dict[str, float]:
        """The rollout's metrics: reward mean and spread, the share of groups whose completions
        all scored alike (they teach nothing), completion length, and the largest gap between
        the sampler's and the trainer's log-probs of the same tokens."""
        groups = rewards.reshape(-1, self.spec.rollout.group_size)
        mask = np.asarray(r.mask) > 0
        gap = np.abs(np.asarray(trainer_logps) - np.asarray(r.logps))[mask]
        return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                "no_spread_groups": float(np.mean(groups.std(axis=1) == 0)),
                "completion_length": float(mask.sum(axis=1).mean()),
                "logp_gap_max": float(gap.max()) if gap.size else 0.0}
