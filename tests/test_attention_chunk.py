"""Query-chunked XLA attention (`model.attention_chunk`): the same values and gradients as the
whole-sequence XLA attention and as a float64 NumPy computation, with the causal mask, packed
documents and grouped-query heads, without ever forming the [length, length] scores; and the
config rules around it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, real_target_env
from configs import ConfigError
from model import TokenInputs
from model.attention import attend
from model.attn_kernels.registry import Options
from sharding.hardware import HARDWARE
from planner.targets import has_compiler
from sharding import activation_rules
from trainer import abstract_program, prepare
from trainer.state import init_state
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate

B, T, H, KV, D, DV = 2, 16, 4, 2, 8, 6  # grouped (2 query heads a kv head), v narrower than q (as MLA's)


def _inputs() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, KV, D))
    v, w = rng.normal(size=(B, T, KV, DV)), rng.normal(size=(B, T, H, DV))
    cut = np.array([[5], [11]])  # two documents a row, each causal from position 0
    seg = np.where(np.arange(T) < cut, 1, 2).astype(np.int32)
    pos = np.where(np.arange(T) < cut, np.arange(T), np.arange(T) - cut).astype(np.int32)
    return q, k, v, w, pos, seg


def _numpy_reference(q, k, v, w, pos, seg) -> tuple[np.ndarray, ...]:
    """Output and the gradients of sum(out * w) for q, k, v, in float64, by the textbook formulas."""
    g = H // KV
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads kv head i // g
    mask = (pos[:, :, None] >= pos[:, None, :]) & (seg[:, :, None] == seg[:, None, :])  # [b, t, s]
    s = np.einsum("bthd,bshd->bhts", q, kk) * D**-0.5
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vv)
    dp = np.einsum("bthd,bshd->bhts", w, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * D**-0.5
    dq = np.einsum("bhts,bshd->bthd", ds, kk)
    dk = np.einsum("bhts,bthd->bshd", ds, q).reshape(B, T, KV, g, D).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, w).reshape(B, T, KV, g, DV).sum(3)
    return out, dq, dk, dv


def _largest_f32(stablehlo: str) -> int:
    """The element count of the largest float32 array in a lowered program."""
    shapes = re.findall(r"tensor<([0-9x]+)xf32>", stablehlo)
    return max(math.prod(int(n) for n in shape.split("x")) for shape in shapes)


def _attention(chunk: int):
    def f(q, k, v, w, pos, seg):
        out = attend(q, k, v, TokenInputs(pos, seg), impl="xla", opts=Options(chunk=chunk))
        return jnp.sum(out * w), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def test_chunked_attention_equals_the_whole_one_and_float64_numpy() -> None:
    q, k, v, w, pos, seg = _inputs()
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, w)] + [jnp.asarray(pos), jnp.asarray(seg)]
    ref_out, *ref_grads = _numpy_reference(q, k, v, w, pos, seg)
    results = {}
    for chunk in (0, 4):
        # The two programs differ: only the whole one holds an array as large as all the scores
        # (the chunked backward keeps no stack of every block's probabilities either).
        assert (_largest_f32(_attention(chunk).lower(*args).as_text()) >= B * H * T * T) == (chunk == 0), chunk
        (_, out), grads = _attention(chunk)(*args)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, ref_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        results[chunk] = (out, grads)
    np.testing.assert_allclose(results[4][0], results[0][0], rtol=1e-6, atol=1e-6)
    for got, want in zip(results[4][1], results[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(ref_grads[1]).max() > 0.1  # the key gradients are not all zero


def _loss_and_grads(cfg, batch: dict) -> tuple[float, dict]:
    program = abstract_program(cfg)
    params = init_state(cfg.model, program.tx, 0, program.state_sh).params
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute)
    batch = {k: jax.device_put(v, program.batch_sh) for k, v in batch.items()}
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        loss, grads = jax.jit(lambda p, b: accumulate(loss_fn, p, b, 1))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("layout", [["mesh.data=2", "mesh.tensor=4"], ["mesh.data=2", "mesh.context=4"]],
                         ids=["data=2 x tensor=4", "data=2 x context=4"])
def test_a_chunked_model_gives_the_whole_attention_loss_and_gradients(tiny, layout) -> None:
    """The tiny model on data=2 x tensor=4 (heads split) and on data=2 x context=4 (the sequence
    split: each 8-query block spread over the 4 devices, 2 queries each), packed documents, remat
    full: the loss and every gradient with 8-query blocks as with the whole sequence."""
    rng = np.random.default_rng(1)
    cut = rng.integers(1, 32, 16)[:, None]
    batch = {"tokens": rng.integers(0, 257, (16, 33)).astype(np.int32),
             "segment_ids": np.where(np.arange(33) < cut, 1, 2).astype(np.int32),
             "positions": np.where(np.arange(33) < cut, np.arange(33), np.arange(33) - cut).astype(np.int32)}
    base = [*layout, "model.remat=full"]
    whole, whole_grads = _loss_and_grads(tiny(*base), batch)
    chunked, chunked_grads = _loss_and_grads(tiny(*base, "model.attention_chunk=8"), batch)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), chunked_grads, whole_grads)
    assert np.abs(whole_grads["layers"]["attn"]["k"]).max() > 0


def test_the_chunk_must_divide_the_sequence_and_be_xla_attention(tiny) -> None:
    with pytest.raises(ConfigError, match="model.attention_chunk: 5 must be 0"):
        tiny("model.attention_chunk=5")
    with pytest.raises(ConfigError, match="model.attention_chunk: chunks model.attention=xla only"):
        tiny("model.attention_chunk=8", "model.attention=dot_product")


def test_the_chunk_under_a_sequence_split_is_a_multiple_of_it_and_not_the_rings(tiny) -> None:
    with pytest.raises(ConfigError, match="model.attention_chunk=4: each query block is spread over the sequence "
                                          "split, so it must be a multiple of mesh.context=8"):
        prepare(tiny("model.attention_chunk=4", "mesh.data=1", "mesh.context=8"), 8, with_data=False)
    with pytest.raises(ConfigError, match="model.attention_chunk=8: the ring .context.strategy=ring. scores its own"):
        prepare(tiny("model.attention_chunk=8", "mesh.data=4", "mesh.context=2", "context.strategy=ring"), 8,
                with_data=False)
    prepare(tiny("model.attention_chunk=8", "mesh.data=1", "mesh.context=8"), 8, with_data=False)


@pytest.mark.real_target
def test_libtpu_keeps_no_whole_scores_with_query_blocks(tmp_path) -> None:
    """A one-layer llama on a v5p-8 (2,048 positions, 4 heads), compiled by libtpu with and without
    512-query blocks: only the whole attention holds a [.., 2048, 2048] array, and the blocks need
    under half its temporaries (131 against 53 MB when this was written)."""
    if not has_compiler(HARDWARE["tpu-v5p"]):
        pytest.skip("tpu-v5p's compiler is not installed (make compilers)")
    shape = ["mesh.data=1", "mesh.fsdp=8", "train.global_batch=8", "model.num_layers=1", "model.d_model=256",
             "model.num_heads=4", "model.num_kv_heads=2", "model.d_ff=512", "model.vocab_size=512",
             "model.seq_len=2048", "model.attention=xla"]
    temps, whole_scores = {}, {}
    for chunk in (0, 512):
        dump, out = tmp_path / f"hlo{chunk}", tmp_path / f"plan{chunk}.json"
        done = subprocess.run([sys.executable, "plan.py", "--config", os.path.join(ROOT, "configs", "llama3-8b.yaml"),
                               "--devices", "8", "--hardware", "tpu-v5p", "--dump-hlo", str(dump), "--out", str(out),
                               *shape, f"model.attention_chunk={chunk}"],
                              cwd=ROOT, env=real_target_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (text,) = [f.read_text() for f in dump.iterdir()]
        whole_scores[chunk] = bool(re.search(r"\[[0-9,]*2048,2048\]", text))
        temps[chunk] = json.loads(out.read_text())["plans"][0]["memory"]["temps"]
    assert whole_scores == {0: True, 512: False}, whole_scores
    assert temps[512] < 0.5 * temps[0], temps
