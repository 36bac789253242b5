"""GRPO's trainer side (trainer/grpo.py) on a tiny model and one device: a rollout batch's old
log-probs come from the trainer's forward, so the first update's importance ratio is exactly 1
(and the KL to equal reference weights exactly 0); the sampler agrees with the trainer; the loss
micro-batches as the step does; and a few updates raise a reward the samples can earn."""

from __future__ import annotations

from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import load_config
from configs.schema import ModelConfig
from data.tokenizer import load_tokenizer
from model import Transformer
from model.grpo import STATS
from trainer import rewards
from trainer.compute import Compute
from trainer.grpo import GRPO, GRPOSpec, grpo_spec, make_grpo_loss_fn, step_metrics
from trainer.step import accumulate_stats

CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=264, init_std=0.3)
PROMPTS = np.array([[256, 256, 49, 43, 50, 61], [51, 55, 43, 52, 56, 61]], np.int32)  # "1+2=", "37+48="
PAD = np.array([2, 0], np.int32)
EXAMPLES = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "37+48=", "answer": "85"}]
REWARD = "def lower(prompt, completion, example):\n    return float(sum('a' <= c <= 'z' for c in completion))\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GRPO, GRPOSpec, nnx.State, Callable]]:
    root = tmp_path_factory.mktemp("reward")
    (root / "grpo_step_reward.py").write_text(REWARD)
    import sys
    sys.path.insert(0, str(root))
    cfg = load_config(None, ["rl.group_size=8", "rl.max_new_tokens=6", "rl.kl_coef=0.1",
                             "rl.reward=grpo_step_reward:lower", "rl.temperature=1.0"])
    spec = grpo_spec(cfg, end_id=256)
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    grpo = GRPO(graphdef, Compute(), spec, rewards.build(cfg.rl), load_tokenizer("byte").decode)
    loss_fn = make_grpo_loss_fn(graphdef, Compute(), spec)
    yield grpo, spec, params, loss_fn
    sys.path.remove(str(root))


def test_the_first_updates_ratio_is_exactly_one(setup):
    grpo, spec, params, loss_fn = setup
    batch, metrics = grpo.rollout_batch(params, params, PROMPTS, PAD, EXAMPLES, jax.random.key(0))
    assert batch["inputs"].shape == batch["advantages"].shape == (16, 11)
    # The sampler's and the trainer's log-probs of the same tokens: float32 rounding apart.
    assert 0 <= metrics["logp_gap_max"] < 1e-4, metrics
    assert 0 < metrics["completion_length"] <= 6 and metrics["reward_std"] > 0
    (total, (count, stats)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    # In the gradient's own program the new log-probs equal the old bitwise: every ratio is 1,
    # nothing is clipped, and the KL to the (equal) reference is 0.
    assert float(stats[STATS.index("ratio")]) == float(count) > 0
    assert float(stats[STATS.index("clip_fraction")]) == 0.0 and float(stats[STATS.index("kl")]) == 0.0
    # So the loss is -sum(advantage) over the completion tokens.
    want = -np.sum(np.asarray(batch["advantages"]) * np.asarray(batch["weights"]), dtype=np.float64)
    np.testing.assert_allclose(float(total), want, rtol=1e-5, atol=1e-5)
    assert np.isfinite(float(optax.tree.norm(grads))) and float(optax.tree.norm(grads)) > 0
    # The policy's entropy over the completion tokens, against float64 NumPy from the model's logits.
    logits = np.asarray(nnx.merge(grpo.graphdef, params)(batch["inputs"]), np.float64) / spec.temperature
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = np.sum(-(np.exp(logp) * logp).sum(-1) * np.asarray(batch["weights"])) / float(count)
    np.testing.assert_allclose(float(step_metrics((count, stats))["entropy"]), want, rtol=1e-5)


def test_micro_batches_give_the_whole_batchs_loss_and_gradients(setup):
    grpo, spec, params, loss_fn = setup
    batch, _ = grpo.rollout_batch(params, params, PROMPTS, PAD, EXAMPLES, jax.random.key(1))
    # Rows moved a little off the sampler, so the ratios and the clip are not trivial.
    batch = {**batch, "old_logps": batch["old_logps"] + 0.3 * batch["weights"] * jnp.sin(jnp.arange(11.0))}
    one = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, 1))(params, batch)
    two = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, 2))(params, batch)
    np.testing.assert_allclose(float(two[0]), float(one[0]), rtol=1e-5, atol=1e-6)  # a sum near 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), two[1], one[1])
    assert float(step_metrics(one[2])["clip_fraction"]) > 0


def test_a_few_updates_raise_the_reward(setup):
    grpo, spec, params, loss_fn = setup
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def update(params: nnx.State, opt_state: optax.OptState, batch: dict) -> tuple[nnx.State, optax.OptState]:
        _, grads, _ = accumulate_stats(loss_fn, params, batch, 1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ref, means = params, []
    for step in range(8):
        batch, metrics = grpo.rollout_batch(params, ref, PROMPTS, PAD, EXAMPLES, jax.random.key(100 + step))
        means.append(metrics["reward_mean"])
        params, opt_state = update(params, opt_state, batch)
    assert np.mean(means[-2:]) > 2 * np.mean(means[:2]) + 0.5, means
