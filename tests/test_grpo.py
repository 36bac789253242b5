"""GRPO's math (model/grpo.py) against an independent float64 NumPy computation from the same
inputs: advantages, the completion mask, the clipped loss with the k3 KL under both averagings,
and the importance ratio of 1 when the policy is the one that sampled."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from model.grpo import STATS, PolicyLoss, completion_mask, group_advantages, policy_loss

END = 0  # the end token id of these tests


def _np_advantages(rewards: np.ndarray, group: int, eps: float) -> np.ndarray:
    out = np.empty(len(rewards))
    for start in range(0, len(rewards), group):
        g = rewards[start:start + group].astype(np.float64)
        out[start:start + group] = (g - g.mean()) / (g.std() + eps)  # np.std is ddof 0
    return out


def _np_mask(completion: np.ndarray) -> np.ndarray:
    mask = np.zeros(completion.shape)
    for r, row in enumerate(completion):
        for t, token in enumerate(row):
            mask[r, t] = 1.0
            if token == END:
                break
    return mask


def _np_loss(logps: tuple[np.ndarray, np.ndarray, np.ndarray], adv: np.ndarray, mask: np.ndarray,
             spec: PolicyLoss) -> tuple[float, float, float, float]:
    """(loss sum, count, pg sum, kl sum) token by token in float64: the same inputs, other code."""
    logp, old, ref = (np.asarray(a, np.float64) for a in logps)
    clip, kl_coef, averaging = spec.clip, spec.kl_coef, spec.averaging
    total, count, pg_sum, kl_sum = 0.0, 0.0, 0.0, 0.0
    for r in range(logp.shape[0]):
        n = mask[r].sum()
        if n == 0:
            continue
        w = 1.0 if averaging == "token" else 1.0 / n
        count += n if averaging == "token" else 1.0
        for t in range(logp.shape[1]):
            if mask[r, t] == 0:
                continue
            ratio = np.exp(logp[r, t] - old[r, t])
            pg = -min(ratio * adv[r], min(max(ratio, 1 - clip), 1 + clip) * adv[r])
            d = ref[r, t] - logp[r, t]
            kl = np.exp(d) - d - 1
            total += w * (pg + kl_coef * kl)
            pg_sum += w * pg
            kl_sum += w * kl
    return total, count, pg_sum, kl_sum


@pytest.fixture(scope="module")
def rollout() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(0)
    rows, length, group = 6, 7, 3
    completion = rng.integers(0, 4, (rows, length))
    completion[1] = [3, 2, 1, 3, 2, 1, 3]  # no end token: every token counts
    completion[2, 0] = END  # ends at once: only the end token counts
    logp = rng.normal(-1.5, 0.5, (rows, length)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)  # some ratios past the clip
    ref = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.5, 0.5], np.float32)  # the second group has no spread
    return completion, logp, old, ref, rewards, group


def test_advantages_normalize_each_group(rollout):
    *_, rewards, group = rollout
    got = np.asarray(group_advantages(jnp.asarray(rewards), group))
    np.testing.assert_allclose(got, _np_advantages(rewards, group, 1e-4), rtol=1e-6, atol=1e-6)
    assert np.all(got[3:] == 0)  # equal rewards: no advantage, not 0/0


def test_completion_mask_stops_after_the_end_token(rollout):
    completion = rollout[0]
    got = np.asarray(completion_mask(jnp.asarray(completion), END))
    np.testing.assert_array_equal(got, _np_mask(completion))
    assert got[1].sum() == completion.shape[1] and got[2].sum() == 1


@pytest.mark.parametrize("averaging", ["token", "sequence"])
def test_policy_loss_equals_float64_numpy(rollout, averaging):
    completion, logp, old, ref, rewards, group = rollout
    mask = _np_mask(completion)
    adv = _np_advantages(rewards, group, 1e-4)
    spec = PolicyLoss(clip=0.2, kl_coef=0.3, averaging=averaging)
    total, count, stats = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref),
                                      jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32), spec)
    want_total, want_count, want_pg, want_kl = _np_loss((logp, old, ref), adv, mask, spec)
    assert float(count) == want_count
    np.testing.assert_allclose(float(total), want_total, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats[STATS.index("pg_loss")]), want_pg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats[STATS.index("kl")]), want_kl, rtol=1e-5, atol=1e-6)
    assert float(stats[STATS.index("clip_fraction")]) > 0  # the inputs do reach the clip


def test_ratio_is_exactly_one_when_the_policy_sampled(rollout):
    completion, logp, _, _, rewards, group = rollout
    mask = jnp.asarray(_np_mask(completion), jnp.float32)
    adv = group_advantages(jnp.asarray(rewards), group)
    total, count, stats = policy_loss(jnp.asarray(logp), jnp.asarray(logp), None, adv, mask, PolicyLoss())
    # Every counted token's ratio is exp(0) = 1 exactly: the ratio's sum is the count, bitwise,
    # nothing is clipped, there is no KL, and the loss is -sum(A) over the counted tokens.
    assert float(stats[STATS.index("ratio")]) == float(count)
    assert float(stats[STATS.index("clip_fraction")]) == 0.0 and float(stats[STATS.index("kl")]) == 0.0
    np.testing.assert_allclose(float(total), -float(jnp.sum(adv[:, None] * mask)), rtol=1e-6, atol=1e-6)
