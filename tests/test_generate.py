"""Decoding with the key/value cache (model/decode.py) and the sampling CLI (model/generate.py).

The reference is the training forward pass recomputed on the whole sequence at every step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT

import trainer
from configs.schema import ModelConfig
from model import Transformer
from model.decode import forward, generate, init_cache
from model.generate import main

# A large init scale spreads the logits, so argmax is far from ties that rounding could flip.
CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=264, init_std=0.3)
PROMPT = np.random.RandomState(0).randint(0, 256, (2, 5)).astype(np.int32)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(CFG, rngs=nnx.Rngs(0))


def test_cached_logits_match_the_full_forward(model):
    cache = init_cache(model, batch=2, max_len=8)
    prefill, cache = forward(model, jnp.asarray(PROMPT), cache, 0)
    full = np.asarray(model(jnp.asarray(PROMPT)))
    np.testing.assert_allclose(prefill, full, rtol=1e-5, atol=1e-5)
    nxt = np.array([[7], [11]], np.int32)
    step, _ = forward(model, jnp.asarray(nxt), cache, 5)
    full = np.asarray(model(jnp.asarray(np.concatenate([PROMPT, nxt], axis=1))))[:, -1]
    np.testing.assert_allclose(step[:, -1], full, rtol=1e-5, atol=1e-5)
    # The cache matters: the same token without its context scores differently.
    alone = np.asarray(model(jnp.asarray(nxt)))[:, -1]
    assert np.abs(alone - full).max() > 1e-2


def test_greedy_with_the_cache_equals_argmax_of_full_recompute(model):
    new = np.asarray(generate(model, PROMPT, 6))
    seq = PROMPT
    for _ in range(6):
        logits = np.asarray(model(jnp.asarray(seq)))[:, -1]
        seq = np.concatenate([seq, logits.argmax(-1)[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(new, seq[:, 5:])
    assert len(set(new[0].tolist())) > 1  # not stuck on one token, which a broken cache tends to give


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    a = np.asarray(generate(model, PROMPT, 8, temperature=2.0, seed=1))
    b = np.asarray(generate(model, PROMPT, 8, temperature=2.0, seed=1))
    c = np.asarray(generate(model, PROMPT, 8, temperature=2.0, seed=2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = np.asarray(generate(model, PROMPT, 8))
    np.testing.assert_array_equal(np.asarray(generate(model, PROMPT, 8, temperature=1.0, top_k=1, seed=3)), greedy)
    assert (a != greedy).any()


def test_cli_samples_from_a_sharded_checkpoint(tiny, capsys):
    cfg = tiny("mesh.fsdp=2", "mesh.tensor=2", "train.steps=2", "checkpoint.every=2")
    trainer.run(cfg)
    capsys.readouterr()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    greedy = ["--run-dir", cfg.run.dir, "--prompt", "import json", "--max-new-tokens", "12"]
    cmd = [sys.executable, "-m", "model.generate", *greedy]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("import json")
    # In this process (8 devices) the same greedy continuation, then a sampled one.
    assert main(greedy) == 0
    assert capsys.readouterr().out == proc.stdout
    args = ["--run-dir", cfg.run.dir, "--prompt", "import json", "--temperature", "1.5", "--top-k", "50", "--seed", "4"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("import json")
    assert main(["--run-dir", cfg.run.dir, "--prompt", "x", "--step", "9"]) == 2
    assert "--step: no checkpoint for step 9" in capsys.readouterr().err
