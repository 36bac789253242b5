"""Rollouts (model/rollout.py): groups of completions the model samples with its own KV-cached
decoder, cut at the end token, and their sampler log-probs, which the trainer's own forward pass
(trainer/forward.py) over `training_rows` reproduces token for token; and nucleus sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.schema import ModelConfig
from model import Transformer
from model.decode import Sampling, sample, until_end
from model.preference import token_logps
from model.rollout import Rollout, RolloutSpec, completion_logps, rollout, training_rows
from trainer.compute import Compute
from trainer.forward import forward

CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=264, init_std=0.3)
END = 256
# Two prompts of 3 and 5 tokens, left-padded with the end token to 5.
PROMPTS = np.array([[END, END, 40, 41, 42], [50, 51, 52, 53, 54]], np.int32)
PAD = np.array([2, 0], np.int32)
SAMPLING = Sampling(temperature=1.3, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def drawn(model: Transformer) -> tuple[RolloutSpec, Rollout]:
    spec = RolloutSpec(group_size=3, max_new_tokens=6, sampling=SAMPLING, end_id=END)
    return spec, rollout(model, PROMPTS, PAD, spec, jax.random.key(7))


def test_a_rollout_is_groups_of_completions_of_each_prompt(model, drawn):
    spec, r = drawn
    assert r.completion.shape == r.mask.shape == r.logps.shape == (6, 6)
    np.testing.assert_array_equal(np.asarray(r.prompts), np.repeat(PROMPTS, 3, axis=0))
    np.testing.assert_array_equal(np.asarray(r.pad), np.repeat(PAD, 3))
    # At temperature 1.3 a group's completions differ; the same key draws the same again.
    assert len({tuple(row) for row in np.asarray(r.completion)}) > 2
    again = rollout(model, PROMPTS, PAD, spec, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(again.completion), np.asarray(r.completion))


def test_a_completion_stops_after_its_first_end_token(model, drawn):
    spec, r = drawn
    # Call the token row 0 drew third "end": the same draw, cut there.
    end = int(r.completion[0, 2])
    cut = rollout(model, PROMPTS, PAD, RolloutSpec(3, 6, SAMPLING, end), jax.random.key(7))
    tokens, mask = np.asarray(cut.completion), np.asarray(cut.mask)
    for row, drawn_row in zip(tokens, np.asarray(r.completion)):
        hits = np.nonzero(drawn_row == end)[0]
        stop = hits[0] + 1 if len(hits) else len(drawn_row)
        np.testing.assert_array_equal(row[:stop], drawn_row[:stop])
        assert np.all(row[stop:] == end)
    assert mask[0, :3].all() and not mask[0, 3:].any()
    assert np.all(np.asarray(cut.logps)[mask == 0] == 0)


def test_a_completions_text_is_its_tokens_before_the_first_end():
    """The ids generate.py prints, the rewards score and the headroom bench reads: up to the
    first end token, not including it, whatever follows; all of them when none ends."""
    assert until_end(np.array([65, 66, END, 67, END]), END) == [65, 66]
    assert until_end(jnp.array([[END, 65]]), END) == []
    assert until_end([65, 66], END) == [65, 66]


def test_the_trainers_forward_gives_the_samplers_log_probs(model, drawn):
    _, r = drawn
    rows = training_rows(r)
    # The weights cover exactly the completion tokens in the mask.
    assert float(jnp.sum(rows["weights"])) == float(jnp.sum(r.mask))
    graphdef, params = nnx.split(model)

    @jax.jit
    def trainer_logps(params: nnx.State, rows: dict[str, jax.Array]) -> jax.Array:
        out = forward(graphdef, Compute(), params, rows)
        logits = out.model.logits(out.x).astype(jnp.float32) / SAMPLING.temperature
        return completion_logps(token_logps(logits, out.targets) * out.weights, r)

    ours = np.asarray(trainer_logps(params, rows))
    sampler = np.asarray(r.logps)
    assert np.all(sampler[np.asarray(r.mask) > 0] < 0)
    gap = np.max(np.abs(ours - sampler))
    assert gap < 1e-4, gap  # float32: the cached decoder's and the whole-sequence pass's rounding


def test_nucleus_sampling_draws_only_from_the_top_mass():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.key(0), 4)
    drawn = {p: np.concatenate([np.asarray(sample(logits, k, Sampling(1.0, 0, p))) for k in keys])
             for p in (0.5, 0.75, 0.9, 1.0)}
    assert set(drawn[0.5]) == {0}  # the top token alone holds 0.5
    assert set(drawn[0.75]) == {0, 1}
    assert set(drawn[0.9]) == {0, 1, 2}
    assert set(drawn[1.0]) == {0, 1, 2, 3}


def test_the_held_out_exact_match_is_the_greedy_answer_token_for_token(model):
    from data.corpus_format.rl import prompts_and_answers
    from model.decode import generate
    from model.rollout import exact_matches, prompt_window

    greedy = np.asarray(generate(model, PROMPTS, 3, pad=PAD))
    end = int(greedy[0, 2])  # row 0's third greedy token plays the end token
    # Filled past the answers with a token of its own: what follows an answer is never compared.
    rows, mask = np.full((3, 10), 263, np.int32), np.zeros((3, 10), np.int32)
    for r, (prompt, pad) in enumerate([(PROMPTS[0], 2), (PROMPTS[0], 2), (PROMPTS[1], 0)]):
        n = 5 - pad
        rows[r, :n], rows[r, n:n + 3] = prompt[pad:], [*greedy[0, :2], end]
        mask[r, n:n + 3] = 1  # the answer and its end
    rows[1, 3 + 1] += 1  # row 1: the answer's second token wrong
    # Row 2: another prompt, whose greedy completion is (almost surely) not row 0's.
    # The window inside jit is the host's split of the same rows.
    host, host_pad, _ = prompts_and_answers(rows, mask, 5, end)
    device, device_pad = jax.jit(prompt_window, static_argnums=(2, 3))(rows, mask, 5, end)
    np.testing.assert_array_equal(np.asarray(device), host)
    np.testing.assert_array_equal(np.asarray(device_pad), host_pad)
    got = nnx.jit(exact_matches, static_argnums=(3, 4))(model, jnp.asarray(rows), jnp.asarray(mask), 5, end)
    assert greedy[1, :3].tolist() != greedy[0, :3].tolist()
    np.testing.assert_array_equal(np.asarray(got), [1.0, 0.0, 0.0])
