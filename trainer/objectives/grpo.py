"""`train.objective=grpo`: reinforcement learning from verifiable rewards (GRPO), the rollouts
sampled by the very model being trained, with its own KV-cached decoder, on the training mesh.

Each step's batch is made on the host between steps (`stage`, `RolloutStage`): the data's
batch of prompts with answers (corpus format `rl`, `data.prepare --objective rl`) -> `rl.group_size`
completions of each (model/rollout.py) -> their rewards (trainer/rewards.py) -> advantages within
each group -> the sampling policy's log-probs from the trainer's own forward (trainer/grpo.py), so
the first update's importance ratio is exactly 1. The step then differentiates the clipped loss
with the k3 KL to the starting weights (model/grpo.py) over those rows, micro-batched as every
loss is; `rl.updates_per_rollout` steps train on one rollout batch before the next is sampled.
The held-out metric is exact-match accuracy of greedy completions (eval_accuracy).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.corpus_format.rl import prompts_and_answers
from data.tokenizer import load_tokenizer
from model.loss import LossFn
from model.rollout import Rollout, exact_matches, rollout
from trainer import grpo, rewards
from trainer.compute import Compute
from trainer.objectives.dpo import reference_params
from trainer.objectives.registry import EvalFn, Made, Objective, Stage, check_prepared, register, require

Array = jax.Array
# Rollout batches in a row whose every group scored alike before the run says that it learns
# nothing: such groups have no advantage, so the updates stop (all but weight decay).
FLAT_ROLLOUTS = 10


class RolloutStage(Stage):
    """Makes each step's batch from the data's prompts: a new rollout every
    `rl.updates_per_rollout` steps (and at a run's first step), the same batch in between. A
    checkpoint between the updates of one rollout batch holds that batch (`carried`): the weights
    that sampled it are gone, so a resumed run trains on it rather than sampling again."""

    def __init__(self, objective: "GRPOObjective", graphdef: nnx.GraphDef, compute: Compute) -> None:
        cfg = objective.cfg
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.spec = grpo.grpo_spec(cfg, self.tokenizer.eod_id)
        self.grpo = grpo.GRPO(graphdef, compute, self.spec, rewards.build(cfg.rl), self.tokenizer.decode)
        self.seed, self.prompt_len = cfg.run.seed, cfg.model.seq_len + 1 - cfg.rl.max_new_tokens
        self.made: tuple[dict, dict[str, float]] | None = None
        self.flat = 0  # rollout batches in a row with no group's rewards spread

    def __call__(self, state: Any, next_batch: Callable[[], dict], step: int) -> tuple[dict, dict[str, float]]:
        if not self.makes_batch(step):
            return self.made
        t0 = time.perf_counter()
        data = next_batch()
        prompts, pad, answers = prompts_and_answers(np.asarray(data["tokens"]), np.asarray(data["loss_mask"]),
                                                    self.prompt_len, self.tokenizer.eod_id)
        decode = self.tokenizer.decode
        examples = [{"prompt": decode(p[k:].tolist()), "answer": decode(a.tolist())}
                    for p, k, a in zip(prompts, pad, answers)]
        # The step folded into the seed: a resumed run draws the same completions at the same step.
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        ref = reference_params(state.params, state.ref_params) if self.spec.loss.kl_coef > 0 else None
        batch, metrics = self.grpo.rollout_batch(state.params, ref, prompts, pad, examples, key)
        seconds = time.perf_counter() - t0
        tokens = metrics["completion_length"] * len(prompts) * self.spec.rollout.group_size
        self.made = batch, {**metrics, "rollout_s": seconds, "rollout_tokens_per_s": tokens / seconds}
        self._watch_spread(metrics, step)
        return self.made

    def _watch_spread(self, metrics: dict[str, float], step: int) -> None:
        """Says once per streak when FLAT_ROLLOUTS rollout batches in a row had no group with
        spread (no_spread_groups 1): a collapsed policy or a reward nothing earns."""
        self.flat = self.flat + 1 if metrics["no_spread_groups"] >= 1.0 else 0
        if self.flat == FLAT_ROLLOUTS:
            print(f"warning: step {step}: in each of the last {FLAT_ROLLOUTS} rollout batches every group's "
                  f"completions scored alike (reward {metrics['reward_mean']:.3f}), so the updates learn "
                  "nothing; a larger rl.group_size, a lower optim.lr or a reward with partial credit gives "
                  "groups spread", flush=True)

    def makes_batch(self, step: int) -> bool:
        # A new rollout batch begins every rl.updates_per_rollout steps, and at a run's first step.
        return self.made is None or (step - 1) % self.spec.updates == 0

    def carried(self, step: int) -> Made | None:
        return None if self.makes_batch(step + 1) else self.made

    def resume(self, made: Made | None) -> None:
        self.made = made


@register
class GRPOObjective(Objective):
    name = "grpo"
    data_format = "rl"
    token_loss = False  # the 1F1B family's own gradient code has the LM loss only
    eval_before_training = True  # the held-out accuracy the run starts from

    def check(self) -> None:
        cfg, rl = self.cfg, self.cfg.rl
        check_prepared(cfg)
        require(cfg.data.packing == "concat", "data.packing", "train.objective=grpo pads each prompt to "
                "model.seq_len + 1 and packs nothing; leave data.packing=concat")
        require(rl.max_new_tokens < cfg.model.seq_len, "rl.max_new_tokens", f"{rl.max_new_tokens} leaves no room "
                f"for a prompt in model.seq_len={cfg.model.seq_len}")
        # After the processes met (trainer.startup.bring_up), before anything is compiled.
        require(jax.process_count() == 1, "dist.num_processes", f"{jax.process_count()} processes with "
                "train.objective=grpo: rollouts run on one process for now")
        require(cfg.mesh.pipeline == 1, "mesh.pipeline", f"{cfg.mesh.pipeline} with train.objective=grpo: rollouts "
                "decode with the whole layer stack on every device; pipeline layouts are not supported yet")
        require(cfg.model.mtp_depth == 0, "model.mtp_depth", "train.objective=grpo trains the main head's "
                "log-probs of sampled tokens; set 0")
        require(cfg.model.lora.dropout == 0, "model.lora.dropout", "train.objective=grpo compares log-probs "
                "of the same tokens before and during the update; set 0")
        # A persistent checkpoint between the updates of one rollout batch holds the batch
        # (RolloutStage.carried); the local tier's fixed tree holds none, so it saves on boundaries.
        every = cfg.checkpoint.local_every
        require(every % rl.updates_per_rollout == 0, "checkpoint.local_every", f"{every} is not a multiple of "
                f"rl.updates_per_rollout={rl.updates_per_rollout}: the local tier holds no rollout batch; save "
                "where a new rollout batch begins")
        rewards.build(rl)  # every reward's name and path resolve, before anything is compiled

    @property
    def rows_per_example(self) -> int:  # type: ignore[override]
        return self.cfg.rl.group_size  # a prompt's group of completions

    reference_keys = ("rl.kl_coef", "model.lora.enabled")

    @property
    def holds_reference(self) -> bool:
        # kl_coef 0: no reference at all; under LoRA it is the base with the adapters switched off.
        return self.cfg.rl.kl_coef > 0 and not self.cfg.model.lora.enabled

    def _spec(self) -> grpo.GRPOSpec:
        return grpo.grpo_spec(self.cfg, load_tokenizer(self.cfg.data.tokenizer).eod_id)

    def stage(self, graphdef: nnx.GraphDef, compute: Compute) -> Stage:
        return RolloutStage(self, graphdef, compute)

    def side_program(self, graphdef: nnx.GraphDef, compute: Compute) -> tuple[Callable, tuple]:
        """The rollouts' decoding of one step's prompts (train.global_batch x rl.group_size rows,
        the KV cache of prompt and completion), for the planner."""
        spec, cfg = self._spec(), self.cfg
        prompt_len = cfg.model.seq_len + 1 - cfg.rl.max_new_tokens

        def decode(params: dict, prompts: Array, pad: Array, key: Array) -> Rollout:
            model = nnx.merge(graphdef, params if compute.cast is None else compute.cast(params))
            return rollout(model, prompts, pad, spec.rollout, key)

        rows = cfg.train.global_batch
        return decode, (jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                        jax.eval_shape(lambda: jax.random.key(0)))

    def step_batch(self, data: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
        tokens = data["tokens"]
        shape = (tokens.shape[0] * self.cfg.rl.group_size, tokens.shape[1] - 1)
        fields = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32, "old_logps": jnp.float32,
                  "advantages": jnp.float32}
        if self.cfg.rl.kl_coef > 0:
            fields["ref_logps"] = jnp.float32
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=tokens.sharding) for k, dtype in fields.items()}

    def loss_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> LossFn:
        return grpo.make_grpo_loss_fn(graphdef, compute, self._spec(), model_terms=True)

    def eval_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> EvalFn:
        """Held-out exact match of greedy completions: (wrong, prompts, right) summed."""
        new, end = self.cfg.rl.max_new_tokens, self._spec().rollout.end_id

        def eval_fn(params: dict, ref_params: Any, batch: dict[str, Array]) -> tuple[Array, Array, Array]:
            model = nnx.merge(graphdef, params if compute.cast is None else compute.cast(params))
            right = exact_matches(model, batch["tokens"], batch["loss_mask"], new, end)
            return jnp.sum(1.0 - right), jnp.asarray(right.shape[0], jnp.float32), jnp.sum(right)

        return eval_fn

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        return grpo.step_metrics(aux)

    def eval_metrics(self, sums: np.ndarray) -> tuple[float, dict[str, float], str]:
        prompts = max(sums[1], 1.0)
        accuracy = float(sums[2] / prompts)
        return float(sums[0] / prompts), {"accuracy": accuracy}, f"exact-match accuracy {accuracy:.3f}"

    def console(self, r: dict[str, float]) -> list[str]:
        return [f"reward {r['reward_mean']:.3f} (std {r['reward_std']:.3f}, flat groups {r['no_spread_groups']:.2f}) "
                f"kl {r['kl']:.4f} clip {r['clip_fraction']:.2f} entropy {r['entropy']:.3f} "
                f"len {r['completion_length']:.1f} "
                f"logp gap {r['logp_gap_max']:.1e} rollout {r['rollout_tokens_per_s']:,.0f} tok/s"]
