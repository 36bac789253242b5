"""Decoding with the key/value cache (model/decode.py) and the sampling command (generate.py).

The reference is the training forward pass recomputed on the whole sequence at every step.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT
from bench.procs import cpu_env

import trainer
from configs.schema import ModelConfig, MoEConfig
from data.tokenizer import ByteTokenizer
from model import Transformer
from model.decode import Sampling, _generate, forward, generate, init_cache
from generate import main

# A large init scale spreads the logits, so argmax is far from ties that rounding could flip.
CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=264, init_std=0.3)
PROMPT = np.random.RandomState(0).randint(0, 256, (2, 5)).astype(np.int32)


# The same with every feed-forward a dropless mixture of experts (decoding runs its local dispatch).
MOE_CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=264, init_std=0.3,
                      moe=MoEConfig(num_experts=4, experts_per_token=2, d_ff=16))


# The cached forward under test and the references run jitted (as generate runs the former): op
# by op, every new sequence length would cost a compile of each op, more than one compile of all.
_cached_forward = nnx.jit(forward)


@nnx.jit
def _full_forward(model: Transformer, tokens: jax.Array) -> jax.Array:
    return model(tokens)


@nnx.jit
def _logits_at(model: Transformer, tokens: jax.Array, i: jax.Array) -> jax.Array:
    """The full forward's logits at position i (causal: the tokens after i do not matter), so one
    program serves every step of a greedy reference, and both checkpoints' models below."""
    return model(tokens)[:, i]


@pytest.fixture(scope="module", params=[CFG, MOE_CFG], ids=["dense", "moe"])
def model(request: pytest.FixtureRequest) -> Transformer:
    return Transformer(request.param, rngs=nnx.Rngs(0))


def test_cached_logits_match_the_full_forward(model):
    cache = init_cache(model, batch=2, max_len=8)
    prefill, cache = _cached_forward(model, jnp.asarray(PROMPT), cache, 0)
    full = np.asarray(_full_forward(model, jnp.asarray(PROMPT)))
    np.testing.assert_allclose(prefill, full, rtol=1e-5, atol=1e-5)
    nxt = np.array([[7], [11]], np.int32)
    step, _ = _cached_forward(model, jnp.asarray(nxt), cache, 5)
    full = np.asarray(_full_forward(model, jnp.asarray(np.concatenate([PROMPT, nxt], axis=1))))[:, -1]
    np.testing.assert_allclose(step[:, -1], full, rtol=1e-5, atol=1e-5)
    # The cache matters: the same token without its context scores differently.
    alone = np.asarray(_full_forward(model, jnp.asarray(nxt)))[:, -1]
    assert np.abs(alone - full).max() > 1e-2


def test_a_bf16_model_decodes_from_float32_logits():
    """A bf16 model's head writes bf16 logits (`model.logits_dtype=compute`); the cached forward
    hands sampling the same values in float32, so temperature, top-k and the draw run in float32."""
    bf16 = Transformer(dataclasses.replace(CFG, dtype="bfloat16"), rngs=nnx.Rngs(0))
    logits, _ = forward(bf16, jnp.asarray(PROMPT), init_cache(bf16, batch=2, max_len=8), 0)
    full = bf16(jnp.asarray(PROMPT))
    assert logits.dtype == jnp.float32 and full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(logits, full.astype(jnp.float32))


def test_greedy_with_the_cache_equals_argmax_of_full_recompute(model):
    new = np.asarray(generate(model, PROMPT, 6))
    seq = np.zeros((2, 11), np.int32)
    seq[:, :5] = PROMPT
    for i in range(5, 11):
        seq[:, i] = np.asarray(_logits_at(model, seq, i - 1)).argmax(-1)
    np.testing.assert_array_equal(new, seq[:, 5:])
    assert len(set(new[0].tolist())) > 1  # not stuck on one token, which a broken cache tends to give


def test_left_padded_rows_decode_as_each_row_alone(model):
    """Prompts of different lengths in one batch, left-padded (`pad`): each row's tokens equal
    its own unpadded greedy decoding, which the test above holds to full recompute."""
    short, long = PROMPT[0, 2:], PROMPT[1]
    batch = np.stack([np.concatenate([np.full(2, 99, np.int32), short]), long])
    padded = np.asarray(generate(model, batch, 6, pad=np.array([2, 0])))
    alone = [np.asarray(generate(model, row[None], 6))[0] for row in (short, long)]
    np.testing.assert_array_equal(padded[0], alone[0])
    np.testing.assert_array_equal(padded[1], alone[1])
    # The padding is really hidden: read as tokens, the same row decodes otherwise.
    unmasked = np.asarray(generate(model, batch, 6))[0]
    assert not np.array_equal(unmasked, alone[0])


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    programs = _generate.jitted_fn._cache_size()
    a = np.asarray(generate(model, PROMPT, 8, sampling=Sampling(2.0), seed=1))
    b = np.asarray(generate(model, PROMPT, 8, sampling=Sampling(2.0), seed=1))
    c = np.asarray(generate(model, PROMPT, 8, sampling=Sampling(2.0), seed=2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert _generate.jitted_fn._cache_size() == programs + 1, "three calls that differ in the seed: one program"
    greedy = np.asarray(generate(model, PROMPT, 8))
    np.testing.assert_array_equal(np.asarray(generate(model, PROMPT, 8, sampling=Sampling(1.0, top_k=1), seed=3)), greedy)
    assert (a != greedy).any()


def _checkpoint_model(cfg, step: int) -> Transformer:
    """The model at a checkpoint, read with Orbax's plain restore (not trainer.checkpoint.restore_params)."""
    import orbax.checkpoint as ocp

    path = os.path.join(cfg.run.dir, "checkpoints", str(step), "state")
    params = jax.tree.map(np.asarray, ocp.StandardCheckpointer().restore(path)["params"])
    graphdef, state = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _text(prompt: str, new_tokens) -> str:
    """What the CLI prints for `new_tokens`: the prompt, then the tokens up to an end of document."""
    tokens = [int(t) for t in new_tokens]
    eod = ByteTokenizer.eod_id
    return prompt + ByteTokenizer().decode(tokens[: tokens.index(eod)] if eod in tokens else tokens) + "\n"


def _greedy_by_full_forward(model: Transformer, prompt: np.ndarray, n: int) -> np.ndarray:
    """Greedy decoding without the cache: each token the argmax of the whole sequence's forward."""
    seq = np.zeros((1, prompt.shape[1] + n), np.int32)
    seq[:, : prompt.shape[1]] = prompt
    for i in range(prompt.shape[1], seq.shape[1]):
        logits = np.asarray(_logits_at(model, seq, i - 1))[0]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4, "a near tie: rounding could pick either token"
        seq[0, i] = logits.argmax()
    return seq[0, prompt.shape[1]:]


def test_cli_samples_from_a_sharded_checkpoint(tiny, tmp_path, capsys):
    """The CLI's text is what the checkpoint's model produces: greedy, the argmax of the full
    forward at every step; sampled, model.decode's draw for that seed, temperature and top-k;
    from the step asked for, which decodes differently from the newest one."""
    # Text that counts: a few steps teach the next digit, so greedy text depends on the context.
    for i in range(4):
        (tmp_path / f"count{i}.txt").write_text("0123456789" * 100)
    # 30 steps: with 20 or fewer, greedy text can stay stuck on one digit after the prompt.
    cfg = tiny("mesh.fsdp=2", "mesh.tensor=2", "train.steps=30", "checkpoint.every=15", "optim.lr=1e-2",
               "optim.warmup_steps=0", "train.log_every=30", f"data.path={tmp_path}/count*.txt", "data.eval_fraction=0")
    trainer.run(cfg)
    capsys.readouterr()
    prompt_text, n = "34567", 12
    prompt = ByteTokenizer().encode(prompt_text).astype(np.int32)[None]
    newest, oldest = _checkpoint_model(cfg, 30), _checkpoint_model(cfg, 15)
    expected = _text(prompt_text, _greedy_by_full_forward(newest, prompt, n))
    expected_step_15 = _text(prompt_text, _greedy_by_full_forward(oldest, prompt, n))
    assert expected != expected_step_15, ("the checkpoints must decode differently", expected)
    assert len(set(expected)) > 3, (expected, expected_step_15)

    greedy = ["--run-dir", cfg.run.dir, "--prompt", prompt_text, "--max-new-tokens", str(n)]
    proc = subprocess.run([sys.executable, "generate.py", *greedy], cwd=ROOT, env=cpu_env(1),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == expected
    # In this process (8 devices): the same greedy text; another step; then sampled text.
    assert main(greedy) == 0
    out = capsys.readouterr()
    assert out.out == expected and "warning" not in out.err, out.err
    assert main([*greedy, "--step", "15"]) == 0
    assert capsys.readouterr().out == expected_step_15
    sampling = ["--temperature", "1.5", "--top-k", "50", "--seed", "4"]
    assert main([*greedy, *sampling]) == 0
    sampled = capsys.readouterr().out
    assert sampled == _text(prompt_text, np.asarray(generate(newest, prompt, n, sampling=Sampling(1.5, top_k=50), seed=4))[0])
    assert sampled != expected, "sampling at temperature 1.5 must leave the greedy path"
    # 5 + 28 tokens reach past the trained 32: one warning line, and the text still comes.
    assert main([*greedy[:-1], "28"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(prompt_text) and out.err == ("warning: the prompt (5 tokens) and --max-new-tokens 28 reach "
                                                           "past the length the model was trained on (model.seq_len=32)\n")
    assert main(["--run-dir", cfg.run.dir, "--prompt", "x", "--step", "9"]) == 2
    assert "--step: no checkpoint for step 9" in capsys.readouterr().err
