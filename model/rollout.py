"""Rollouts for reinforcement learning: completions the model samples from its own prompts with
its own KV-cached decoder (model/decode.py), with what the learner needs to score and train on them.

`rollout` repeats each prompt `group_size` times (a group's rows consecutive, as
model/grpo.py's `group_advantages` reads them), samples `max_new_tokens` tokens per row in one
compiled program, and cuts each completion after its first end token: the tokens after it become
the end token and leave the mask. The sampler's log-probabilities of the drawn tokens come with
them (`sampled_logps`: softmax at the sampling temperature, before top-k/top-p).

`training_rows` lays a rollout out as rows of the training forward pass: each prompt moved to the
start of its row (its left padding wrapped to the end, behind the completion, where causal
attention never sees it), so the positions are the decoder's and no segment ids are needed;
`completion_logps` picks each completion token's log-prob back out of that forward's per-target
log-probs, so a trainer's log-probs and the sampler's compare token for token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.decode import Sampling, generate_with_logps
from model.grpo import completion_mask
from model.transformer import Transformer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What a rollout samples (rl.group_size, rl.max_new_tokens, the sampling keys, end-of-text)."""

    group_size: int
    max_new_tokens: int
    sampling: Sampling
    end_id: int  # the tokenizer's end-of-document id: a completion stops after it


class Rollout(NamedTuple):
    """One batch of completions, `group_size` consecutive rows per prompt."""

    prompts: Array  # int32 [rows, L]: each prompt left-padded with the end token
    pad: Array  # int32 [rows]: each prompt's left padding
    completion: Array  # int32 [rows, T]: sampled tokens, the end token after the first one
    mask: Array  # float32 [rows, T]: 1 on each token up to and including the first end token
    logps: Array  # float32 [rows, T]: the sampler's log-prob of each token (0 outside the mask)


def rollout(model: Transformer, prompts: Array, pad: Array, spec: RolloutSpec, key: Array) -> Rollout:
    """prompts int32 [P, L] left-padded by `pad` [P] -> a Rollout of P x group_size rows, drawn
    from `key` (a trainer folds the step into its seed, so a resumed run draws the same)."""
    prompts = jnp.repeat(jnp.asarray(prompts, jnp.int32), spec.group_size, axis=0)
    pad = jnp.repeat(jnp.asarray(pad, jnp.int32), spec.group_size, axis=0)
    tokens, logps = generate_with_logps(model, prompts, spec.max_new_tokens, sampling=spec.sampling, seed=key, pad=pad)
    completion, mask, logps = _cut(tokens, logps, spec.end_id)
    return Rollout(prompts, pad, completion, mask, logps)


@jax.jit
def _cut(tokens: Array, logps: Array, end_id: Array | int) -> tuple[Array, Array, Array]:
    """Each completion stopped after its first end token: later tokens become it, out of the mask."""
    mask = completion_mask(tokens, end_id)
    return jnp.where(mask > 0, tokens, end_id).astype(jnp.int32), mask, logps * mask


def _to_front(a: Array, pad: Array) -> Array:
    """Each row of a [rows, n] array rotated left by its `pad`: the left padding goes to the end."""
    n = a.shape[1]
    return jnp.take_along_axis(a, (jnp.arange(n)[None, :] + pad[:, None]) % n, axis=1)


def training_rows(r: Rollout) -> dict[str, Array]:
    """The rollout as rows of the training forward pass ({"inputs", "targets", "weights"}
    [rows, L + T - 1]): prompt then completion from position 0, the weights on the targets that
    are completion tokens in the mask (prompt and padding carry no loss)."""
    seq = _to_front(jnp.concatenate([r.prompts, r.completion], axis=1), r.pad)
    mask = _to_front(jnp.concatenate([jnp.zeros(r.prompts.shape, jnp.float32), r.mask], axis=1), r.pad)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "weights": mask[:, 1:]}


def completion_logps(target_logps: Array, r: Rollout) -> Array:
    """Per-target log-probs [rows, L + T - 1] of `training_rows` -> those of the completion
    tokens [rows, T] (0 outside the mask), aligned with `r.logps`."""
    length, new = r.prompts.shape[1], r.completion.shape[1]
    # Completion token t sits at L + t - pad in the row, so it is the target at L - 1 - pad + t.
    index = length - 1 - r.pad[:, None] + jnp.arange(new)[None, :]
    return jnp.take_along_axis(target_logps, index, axis=1) * r.mask


def prompt_window(tokens: Array, mask: Array, prompt_len: int, end_id: int) -> tuple[Array, Array]:
    """Padded rows of prompt, answer and end ([rows, n] tokens, the answer's mask) -> (the prompts
    left-padded with `end_id` to prompt_len [rows, prompt_len], their padding [rows]), inside jit:
    the host's data/corpus_format/rl.py `prompts_and_answers` as arrays. A longer prompt keeps its end."""
    first = jnp.argmax(mask, axis=1).astype(jnp.int32)  # where the answer starts
    index = first[:, None] - prompt_len + jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
    picked = jnp.take_along_axis(tokens, jnp.maximum(index, 0), axis=1)
    return jnp.where(index >= 0, picked, end_id).astype(jnp.int32), jnp.maximum(prompt_len - first, 0)


def exact_matches(model: Transformer, tokens: Array, mask: Array, max_new_tokens: int, end_id: int) -> Array:
    """float32 [rows]: 1 where the greedy completion of a row's prompt is its answer then the end
    token, token for token (rows as `prompt_window` reads them; an answer longer than
    max_new_tokens never matches). The held-out accuracy of reinforcement learning, inside jit."""
    prompt_len = tokens.shape[1] - max_new_tokens
    prompts, pad = prompt_window(tokens, mask, prompt_len, end_id)
    completion, _ = generate_with_logps(model, prompts, max_new_tokens, pad=pad)
    # The answer and its end, max_new_tokens long from where the answer starts (past the row: not answer).
    at = jnp.argmax(mask, axis=1)[:, None] + jnp.arange(max_new_tokens)[None, :]
    inside = at < tokens.shape[1]
    answer = jnp.take_along_axis(tokens, jnp.minimum(at, tokens.shape[1] - 1), axis=1)
    wanted = inside & (jnp.take_along_axis(mask, jnp.minimum(at, tokens.shape[1] - 1), axis=1) > 0)
    whole = jnp.sum(mask, axis=1) <= max_new_tokens  # the answer and its end fit in the completion
    return (jnp.all((completion == answer) | ~wanted, axis=1) & whole).astype(jnp.float32)
