"""LoRA dropout (`model.lora.dropout`, model/lora.py): PEFT's y + alpha / rank * B(A(dropout(x)))
in training steps only, with a mask that no layout, micro-batch split or pipeline changes.

Anchors: the adapter's output against a float64 NumPy computation with the mask rebuilt by an
independent NumPy implementation of its hash (model/lora.py's docstring says what it mixes);
`peft` reading the exported adapter_config.json; the one-device run for every other layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import trainer
from configs import ConfigError, load_config
from configs.lora import LORA_TARGETS, LoraConfig
from conftest import ROOT, require, stdlib_glob, stopped_at
from model import TokenInputs, Transformer, hf, lora
from model.layers import MLP
from trainer.objectives.lm import make_loss_fn
from trainer.step import step_noise

STEPS = 4
DROP = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(LORA_TARGETS)}]",
        "model.lora.dropout=0.5"]
TRAIN = ["train.log_every=1", f"train.steps={STEPS}", f"optim.decay_steps={STEPS}", "optim.warmup_steps=1",
         "optim.lr=3e-2", "checkpoint.every=2"]


# --- the mask and the adapter, against NumPy --------------------------------------------------

def mix64(h: np.ndarray) -> np.ndarray:
    """murmur3's finalizer in NumPy uint64 arithmetic, reduced to 32 bits after each product."""
    h = h.astype(np.uint64) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def keep64(noise: np.ndarray, layer: int, target: str, shape: tuple, rate: float) -> np.ndarray:
    """The dropout mask of one adapter, from the step's token noise, rebuilt in NumPy."""
    layer_noise = mix64(noise.astype(np.uint64) ^ mix64(np.uint64((layer % 2**32) * 0x9E3779B9 + 1) & 0xFFFFFFFF))
    salted = mix64(layer_noise ^ np.uint64((LORA_TARGETS.index(target) + 1) * 0x9E3779B9 % 2**32))
    feature = np.arange(np.prod(shape[2:]), dtype=np.uint64).reshape(shape[2:])
    h = mix64((salted.reshape(*shape[:2], *(1,) * (len(shape) - 2)) + feature * 0x85EBCA6B) & 0xFFFFFFFF)
    return h >= round(rate * 2**32)


@pytest.fixture(scope="module")
def mlp_case() -> dict:
    """A SwiGLU layer with adapters on gate, up and down, B random (so each adapter counts)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=4, alpha=8.0, targets=["gate", "up", "down"], dropout=0.3))
    rngs = nnx.Rngs(0)
    mlp = MLP(cfg, rngs=rngs)
    lora.add_adapters(mlp, ("gate", "up", "down"), cfg, rngs)
    for name in ("gate", "up", "down"):
        b = getattr(mlp, name + "_lora_b")
        b[...] = jax.random.normal(jax.random.key(len(name)), b.shape) * 0.1
    x = jax.random.normal(jax.random.key(1), (4, 32, cfg.d_model))
    noise = lora.token_noise(7, jnp.int32(3), (4, 32))
    return {"cfg": cfg, "mlp": mlp, "x": x, "noise": noise}


def test_the_mask_is_the_numpy_hash_and_drops_about_p(mlp_case):
    noise = mlp_case["noise"]
    shape = (4, 32, 16, 64)
    ours = np.asarray(lora.keep_mask(lora.for_layer(noise, 5), "o", shape, 0.3))
    theirs = keep64(np.asarray(noise), 5, "o", shape, 0.3)
    np.testing.assert_array_equal(ours, theirs)
    assert abs(1 - ours.mean() - 0.3) < 0.005, ours.mean()  # 131,072 draws: the sd is 0.0013
    # Another layer, target or step draws another mask, each about p apart from this one.
    others = [lora.keep_mask(lora.for_layer(noise, 6), "o", shape, 0.3),
              lora.keep_mask(lora.for_layer(noise, 5), "q", shape, 0.3),
              lora.keep_mask(lora.for_layer(lora.token_noise(7, jnp.int32(4), (4, 32)), 5), "o", shape, 0.3)]
    for other in others:
        assert abs(np.mean(np.asarray(other) != ours) - 2 * 0.3 * 0.7) < 0.01


def test_the_adapters_under_dropout_give_the_float64_numpy_output(mlp_case):
    cfg, mlp, x, noise = mlp_case["cfg"], mlp_case["mlp"], mlp_case["x"], mlp_case["noise"]
    layer_noise = lora.for_layer(noise, 2)
    ours = np.asarray(mlp(x, TokenInputs.of(layer_noise, noise=layer_noise)), np.float64)
    p, s = cfg.lora.dropout, cfg.lora.alpha / cfg.lora.rank
    w = {k: np.asarray(getattr(mlp, k)[...], np.float64) for k in ("gate", "up", "down")}
    ab = {k: [np.asarray(getattr(mlp, k + sfx)[...], np.float64) for sfx in lora.SUFFIXES] for k in w}
    x64, n64 = np.asarray(x, np.float64), np.asarray(noise)

    def adapted(name: str, h: np.ndarray) -> np.ndarray:
        dropped = h * keep64(n64, 2, name, h.shape, p) / (1 - p)
        return h @ w[name] + s * (dropped @ ab[name][0]) @ ab[name][1]

    gate, up = adapted("gate", x64), adapted("up", x64)
    theirs = adapted("down", gate / (1 + np.exp(-gate)) * up)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max())
    plain = np.asarray(mlp(x), np.float64)  # no noise: no dropout, and the masks really change the output
    assert np.abs(plain - ours).max() > 100 * 1e-5 * np.abs(theirs).max()


def test_the_loss_without_noise_has_no_dropout():
    """Eval, generation and export run the model without noise: the dropout-free model's loss,
    bitwise; the same batch with a step's noise gives another loss."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model
    on = dataclasses.replace(cfg, lora=LoraConfig(rank=4, targets=list(LORA_TARGETS), dropout=0.5))
    off = dataclasses.replace(on, lora=dataclasses.replace(on.lora, dropout=0.0))
    params = nnx.to_pure_dict(nnx.state(Transformer(on, rngs=nnx.Rngs(0))))
    params = jax.tree_util.tree_map_with_path(  # B random: the adapters count
        lambda path, a: jax.random.normal(jax.random.key(0), a.shape) * 0.05 if str(path[-1].key).endswith("_lora_b")
        else a,
        params)
    tokens = jax.random.randint(jax.random.key(2), (8, cfg.seq_len + 1), 0, cfg.vocab_size)

    def loss(c, batch: dict):  # noqa: ANN001, ANN202 (a ModelConfig; a scalar)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))  # the structure alone
        return jax.jit(make_loss_fn(graphdef))(params, batch)[0]

    assert loss(on, {"tokens": tokens}) == loss(off, {"tokens": tokens})
    noisy = {"tokens": tokens, "noise": step_noise(0, jnp.int32(1), tokens)}
    assert abs(float(loss(on, noisy)) - float(loss(on, {"tokens": tokens}))) > 1e-3


def test_dropout_needs_adapters_and_a_rate_below_one(tiny):
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        tiny("model.lora.dropout=0.1")
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        tiny("model.lora.rank=4", "model.lora.dropout=1.0")


def test_peft_reads_the_exported_dropout():
    peft = require("peft", "hf")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), DROP).model
    written = hf.peft_config(cfg, "base")
    assert written["lora_dropout"] == 0.5
    assert peft.LoraConfig(**{k: v for k, v in written.items() if k != "peft_type"}).lora_dropout == 0.5
    json.dumps(written)  # what the export writes


# --- runs: every layout draws the one-device masks -------------------------------------------

def losses(history: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in history])


class Runs:
    """name -> history of a tiny LoRA run with dropout, each trained once per module."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp, self.runs, self.dirs = tmp_path_factory, {}, {}

    def dir(self, name: str) -> pathlib.Path:
        """The run directory of the run `name` (trained already)."""
        return self.dirs[name]

    def __call__(self, name: str, devices: int, *overrides: str) -> np.ndarray:
        if name not in self.runs:
            self.dirs[name] = self.tmp.mktemp(name) / "run"
            cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
                f"run.dir={self.dirs[name]}", f"data.path={stdlib_glob('json')}", *TRAIN, *DROP, *overrides])
            self.runs[name] = losses(trainer.run(cfg, devices=jax.devices()[:devices]))
        return self.runs[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


def test_dropout_changes_the_training_losses(runs):
    with_dropout = runs("one", 1, "mesh.data=1")
    without = runs("none", 1, "mesh.data=1", "model.lora.dropout=0")
    assert with_dropout[0] == without[0]  # B starts at zero: the first loss is the base model's either way
    assert np.abs(with_dropout[1:] - without[1:]).min() > 2e-4, (with_dropout, without)


@pytest.mark.parametrize("name, devices, layout", [
    ("layout", 8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("context", 8, ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"]),
    # Circular: stage s runs layer groups s and S + s, whose global indices the masks must use.
    ("gpipe", 2, ["mesh.data=1", "mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.repeats=2"]),
    ("interleaved_1f1b", 2, ["mesh.data=1", "mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.repeats=2",
                             "pipeline.schedule=interleaved_1f1b"]),
    ("accumulated", 1, ["mesh.data=1", "train.grad_accum=4"]),
])
def test_other_layouts_draw_the_one_device_masks(runs, name, devices, layout):
    one, without = runs("one", 1, "mesh.data=1"), runs("none", 1, "mesh.data=1", "model.lora.dropout=0")
    assert one[-1] < one[0] - 0.1, "a comparison of flat curves proves nothing"
    other = runs(name, devices, *layout)
    np.testing.assert_allclose(other, one, rtol=2e-6)
    assert np.abs(other[1:] - without[1:]).min() > 20 * 2e-6 * one.max()  # dropout really ran there


def test_resume_is_bitwise_exact(runs, tmp_path, capsys):
    """The straight 8-device run's checkpoint at step 2, alone in a copy of its run directory,
    resumed: its last losses, bitwise (the resumed steps draw the masks of their step numbers)."""
    straight = runs("layout", 8, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    stopped_at(runs.dir("layout"), tmp_path / "run", 2)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"run.dir={tmp_path / 'run'}", f"data.path={stdlib_glob('json')}", *TRAIN, *DROP, "mesh.data=2",
        "mesh.fsdp=2", "mesh.tensor=2"])
    capsys.readouterr()
    second = trainer.run(cfg)
    assert "resumed from step 2" in capsys.readouterr().out
    np.testing.assert_array_equal(losses(second), straight[2:])
