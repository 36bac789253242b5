"""The sequence split on 8 fake devices: every `context` layout and strategy gives the loss and
gradients of `context=1`, with concatenated rows and with packed documents; the compiled step
really splits the sequence (per-device activations T / C long, the strategy's collective on the
`context` axis); load balancing gives every device the same causal work; splash matches the
reference kernel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.procs import TINY
from configs import load_config

from model.attention import query_chunk, splash_attention, xla_attention
from planner.hlo import collectives
from sharding import activation_rules
from sharding.context import balanced_order
from trainer import abstract_program
from trainer.state import init_state
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate

LAYOUTS = {
    "context=2": ["mesh.data=4", "mesh.context=2"],
    "context=4": ["mesh.data=2", "mesh.context=4"],
    "context=2 x fsdp=2 x tensor=2": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2"],
    "context=2 x pipeline=2 x data=2": ["mesh.pipeline=2", "mesh.data=2", "mesh.context=2", "pipeline.microbatches=4"],
}
CASES = [(layout, strategy, "document") for layout in LAYOUTS for strategy in ("allgather", "ring")]
CASES += [("context=4", "allgather", "concat"), ("context=4", "ring", "concat"),
          ("context=4", "ring no load balancing", "concat"), ("context=1: data=8", "ring", "document")]
LAYOUTS["context=1: data=8"] = ["mesh.data=8"]  # ring on one shard: blockwise attention, no ring


def packed_batch(seq_len: int, documents: bool) -> dict[str, np.ndarray]:
    """16 random rows; with `documents`, each row packs documents of random lengths (segment ids
    from 1, positions restarting at 0) and ends in a little padding (segment 0)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 257, (16, seq_len + 1)).astype(np.int32)
    if not documents:
        return {"tokens": tokens}
    seg, pos = np.zeros_like(tokens), np.zeros_like(tokens)
    for row in range(16):
        at, doc, end = 0, 1, seq_len + 1 - int(rng.integers(0, 5))
        while at < end:
            n = min(int(rng.integers(1, seq_len // 2)), end - at)
            seg[row, at : at + n], pos[row, at : at + n] = doc, np.arange(n)
            at, doc = at + n, doc + 1
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


_INITIAL: dict[str, dict] = {}  # initial_params' host copies


def initial_params(program) -> dict:  # noqa: ANN001 (a Program)
    """Seed-0 parameters of the program's model, placed as the program shards them: created once
    per parameter shapes (on one device) and `device_put` into each layout, so a layout compared
    with another costs one compile (its loss and gradients), not two (its sharded init too).
    Each layout's own sharded init is what the training-curve tests start from."""
    key = repr(program.spec.model.shapes) + repr(program.spec.cfg.model.init_std)
    if key not in _INITIAL:
        _INITIAL[key] = jax.tree.map(np.asarray, init_state(program.spec.cfg.model, program.tx, 0, jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), program.state_sh)).params)
    return jax.device_put(_INITIAL[key], program.state_sh.params)


_COMPILED: dict[tuple, tuple[str, dict]] = {}  # loss_and_grads' compiled HLO and mesh sizes, by its arguments


def loss_and_grads(overrides: list[str], devices: list, documents: bool) -> tuple[float, dict]:
    """Loss and gradients of one batch under the layout of `overrides`; the compiled program's
    HLO is kept in _COMPILED for the tests that read what it does."""
    cfg = load_config(TINY, ["data.source=synthetic", *overrides])
    program = abstract_program(cfg, devices)
    params = initial_params(program)
    batch = {k: jax.device_put(v, program.batch_sh) for k, v in packed_batch(cfg.model.seq_len, documents).items()}
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute)
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        compiled = jax.jit(lambda p, b: accumulate(loss_fn, p, b, 1)).lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    _COMPILED[(tuple(overrides), len(devices), documents)] = compiled.as_text(), program.spec.layout.sizes
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[float, dict]]:
    return {packing: loss_and_grads(["mesh.data=1"], jax.devices()[:1], packing == "document")
            for packing in ("concat", "document")}


def strategy_overrides(strategy: str) -> list[str]:
    if strategy == "ring no load balancing":
        return ["context.strategy=ring", "context.load_balance=false"]
    return [f"context.strategy={strategy}"]


def test_packed_documents_really_change_the_loss(reference):
    # Otherwise the document cases below would test nothing the concat ones do not.
    assert abs(reference["concat"][0] - reference["document"][0]) > 1e-3


@pytest.mark.parametrize("layout, strategy, packing", CASES)
def test_context_split_gives_the_loss_and_gradients_of_context_1(reference, layout, strategy, packing):
    loss, grads = loss_and_grads(LAYOUTS[layout] + strategy_overrides(strategy), jax.devices(), packing == "document")
    ref_loss, ref_grads = reference[packing]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_load_balancing_gives_each_device_chunks_i_and_2c_minus_1_minus_i():
    order = balanced_order(16, 4)  # 8 chunks of 2
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    # Causal work (query-key pairs a device scores) per device, for 8 devices over 1024 positions:
    # equal with load balancing; the last device does 15 times the first's without it.
    work = lambda blocks: [int((b[:, None] >= np.arange(1024)[None]).sum()) for b in blocks]  # noqa: E731
    balanced = work(balanced_order(1024, 8).reshape(8, -1))
    plain = work(np.arange(1024).reshape(8, -1))
    assert len(set(balanced)) == 1 and plain[-1] > 10 * plain[0]


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[str, list]]:
    """strategy -> (compiled HLO, its collectives) of the context=4 x data=2 loss and gradients
    on concatenated rows (the programs of those cases of the test above, compiled again only
    when it did not run)."""
    out = {}
    for strategy in ("allgather", "ring"):
        key = (tuple(LAYOUTS["context=4"] + strategy_overrides(strategy)), len(jax.devices()), False)
        if key not in _COMPILED:
            loss_and_grads(list(key[0]), jax.devices(), documents=False)
        text, sizes = _COMPILED[key]
        out[strategy] = text, collectives(text, sizes, 8)[0]
    return out


@pytest.mark.parametrize("strategy, kind", [("allgather", "all-gather"), ("ring", "collective-permute")])
def test_the_compiled_step_splits_the_sequence(compiled, strategy, kind):
    text, found = compiled[strategy]
    # Per device: batch 16 / data=2 = 8 rows of seq_len 32 / context=4 = 8 positions, d_model 64;
    # the whole-length [8,32,64] activation never appears, forward or backward.
    assert re.search(r"f32\[8,8,64\]", text) and not re.search(r"f32\[8,32,64\]", text)
    on_context = {c.kind for c in found if c.axes == ("context",)}
    assert kind in on_context, found
    # Keys of the whole sequence ([8 rows, 32 positions, 8 kv heads, 8]) exist only where they
    # are gathered; the ring never holds more than one device's block.
    assert bool(re.search(r"f32\[8,32,8,8\]", text)) == (strategy == "allgather")


@pytest.mark.parametrize("segments", [False, True])
def test_splash_matches_the_reference_kernel(segments):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    b, t, h, g, d = 2, 128, 4, 2, 16
    q = jax.random.normal(kq, (b, t, h, d))
    k = jax.random.normal(kk, (b, t, h // g, d))
    v = jax.random.normal(kv, (b, t, h // g, d))
    seg = jnp.array([[1] * 50 + [2] * 70 + [0] * 8, [1] * 128]) if segments else None
    pos = None if seg is None else jnp.array([list(range(50)) + list(range(70)) + [0] * 8, list(range(128))])
    ours = jax.jit(splash_attention)(q, k, v, seg)
    ref = jax.jit(xla_attention)(q, k, v, seg, pos)
    real = slice(None, 120)  # padding (segment 0) attends by array order in splash, by position in the reference
    np.testing.assert_allclose(np.asarray(ours)[:, real], np.asarray(ref)[:, real], rtol=2e-5, atol=2e-5)
    grad = lambda f, *a: jax.jit(jax.grad(lambda q: (f(q, k, v, *a)[:, real] ** 2).sum()))(q)  # noqa: E731
    np.testing.assert_allclose(grad(splash_attention, seg), grad(xla_attention, seg, pos), rtol=2e-4, atol=2e-5)


def test_splash_train_step_on_a_mesh_matches_xla():
    """The splash kernel under shard_map (data=2 x tensor=2 x fsdp=2), in the train step, with
    packed documents; its tile needs 128 positions."""
    ref_loss, ref_grads = loss_and_grads(["mesh.data=1", "model.seq_len=128"], jax.devices()[:1], documents=True)
    loss, grads = loss_and_grads(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.attention=splash",
                                  "model.seq_len=128"], jax.devices(), documents=True)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for r, g in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


def test_ring_attention_in_pieces_matches_the_reference():
    """Four devices on the ring, 32 local positions taken 8 keys at a time (the tiny model's
    blocks are one piece each), load-balanced order, packed documents."""
    from jax.sharding import Mesh, PartitionSpec as P

    from model.attention import block_mask
    from sharding.context import Ring, ring_attention

    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    b, t, h, g, d = 2, 128, 4, 2, 8
    q = jax.random.normal(kq, (b, t, h, d))
    k = jax.random.normal(kk, (b, t, h // g, d))
    v = jax.random.normal(kv, (b, t, h // g, d))
    seg = np.stack([np.repeat([1, 2, 3], [40, 60, 28]), np.ones(t, int)])
    pos = np.stack([np.concatenate([np.arange(40), np.arange(60), np.arange(28)]), np.arange(t)])
    order = balanced_order(t, 4)
    args = [jnp.asarray(a[:, order]) for a in (q, k, v, pos, seg)]
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    row, qkv = P(None, "context"), P(None, "context", None, None)
    ring = lambda *a: ring_attention(*a, Ring("context", 4, block_mask, piece=8))  # noqa: E731
    ours = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=(qkv, qkv, qkv, row, row), out_specs=qkv,
                                 check_vma=False))(*args)  # as sharded_ring calls it
    ref = xla_attention(q, k, v, jnp.asarray(seg), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref)[:, order], rtol=2e-5, atol=2e-5)


def span_mask(lengths: np.ndarray, starts: np.ndarray, t: int) -> np.ndarray:
    """[b, 1, t, t]: what cuDNN's packed layout attends (PADDING_CAUSAL per run), from the spans."""
    mask = np.zeros((len(lengths), 1, t, t), bool)
    for row, (ls, ss) in enumerate(zip(lengths, starts)):
        for n, s in zip(ls, ss):
            if n > 0:
                mask[row, 0, s : s + n, s : s + n] = np.tril(np.ones((n, n), bool))
    return mask


def test_cudnn_document_spans_attend_what_segment_ids_and_positions_do():
    """cuDNN (GPU only) takes packed documents as run starts and lengths; the mask those spans
    give equals the reference's mask from segment ids and positions for every real token, and
    keeps padding to itself."""
    from data.packing import DocumentRows, StreamDocuments
    from model.attention import block_mask, document_spans

    t, most = 64, 6
    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 99, n).astype(np.uint32) for n in rng.integers(1, 20, 200)]
    rows = DocumentRows(StreamDocuments(texts, 99), seq_len=t, seed=0, max_pieces=most)
    batch = [rows[i] for i in range(len(rows))]
    seg = np.stack([r["segment_ids"][:-1] for r in batch])
    pos = np.stack([r["positions"][:-1] for r in batch])
    assert seg.max() == most and (seg == 0).any()  # full rows and padded ones
    lengths, starts = map(np.asarray, jax.jit(document_spans, static_argnums=1)(jnp.asarray(seg), most + 1))
    used = lengths >= 0
    assert (lengths.sum(1, where=used) == t).all() and (starts[:, -1] == -1).all()
    got = span_mask(lengths, starts, t)
    want = np.asarray(block_mask(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg)))
    real = (seg > 0)[:, None, :, None]
    np.testing.assert_array_equal(np.where(real, got, False), np.where(real, want, False))
    pad_query, pad_key = (seg == 0)[:, None, :, None], (seg == 0)[:, None, None, :]
    assert not (got & pad_query & ~pad_key).any()


def test_cudnn_with_packed_documents_says_when_it_builds_a_dense_mask():
    from trainer.kernels import attention_notes

    packed = ["model.attention=cudnn", "data.packing=document"]
    assert "dense [batch, 1, T, T] mask" in attention_notes(load_config(TINY, packed))[0]
    assert attention_notes(load_config(TINY, [*packed, "model.max_documents=8"])) == []
    assert attention_notes(load_config(TINY, ["model.attention=cudnn"])) == []


def _step_temps(overrides: list[str]) -> int:
    """Per-device temporary bytes of the train step's loss and gradients (memory_analysis) on 8
    devices, for 16 rows of 512 tokens packed with documents."""
    cfg = load_config(TINY, ["data.source=synthetic", "model.seq_len=512", *overrides])
    program = abstract_program(cfg, jax.devices())
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          program.abstract_state().params, program.state_sh.params)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=program.batch_sh)
             for k, v in packed_batch(512, True).items()}
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        compiled = jax.jit(lambda p, b: accumulate(loss_fn, p, b, 1)).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_sequence_split_scores_only_its_own_queries():
    """context=8 holds 16 rows x 64 of the 512 positions per device, data=8 2 rows x 512: the same
    tokens, so the same [rows, heads, queries, keys] scores per device (2 x 16 x 512 x 512 floats,
    34 MB a layer). The split's temporaries stay within a quarter of data=8's, and below 8 layers'
    worth of the whole [16, 16, 512, 512] scores that a device scoring every query would hold
    (every query was gathered to every device when the query heads' group was the major part of
    the merged query dim)."""
    whole = ["model.attention_chunk=0"]  # every query at once: the scores this test is about
    split, rows = _step_temps(["mesh.data=1", "mesh.context=8", *whole]), _step_temps(["mesh.data=8", *whole])
    whole_scores = 16 * 16 * 512 * 512 * 4
    assert split <= 1.25 * rows and split < 8 * whole_scores, (split, rows)


def test_query_blocks_under_the_sequence_split_stay_on_their_devices():
    """`model.attention_chunk=64` at context=8: each block's 64 queries are spread 8 per device, so
    the split's temporaries stay within twice data=8's with the same blocks (1.4x here: the
    gathered keys). Contiguous blocks put a whole block on one device and held 4.4x."""
    split = _step_temps(["mesh.data=1", "mesh.context=8", "model.attention_chunk=64"])
    rows = _step_temps(["mesh.data=8", "model.attention_chunk=64"])
    unchunked = _step_temps(["mesh.data=1", "mesh.context=8", "model.attention_chunk=0"])
    assert split <= 2 * rows and split < unchunked / 4, (split, rows, unchunked)


def test_by_default_a_long_sequence_is_scored_a_block_of_queries_at_a_time():
    """`model.attention_chunk=-1` (the default) at 512 tokens runs its queries in 4 blocks of 128:
    data=8's temporaries are those of an explicit 128 and under half of every query at once; at
    256 tokens (and at any length 4 blocks do not divide) every query is scored at once, as `0`."""
    auto, explicit = _step_temps(["mesh.data=8"]), _step_temps(["mesh.data=8", "model.attention_chunk=128"])
    whole = _step_temps(["mesh.data=8", "model.attention_chunk=0"])
    assert auto == explicit and auto < whole / 2, (auto, explicit, whole)
    assert [query_chunk(-1, t) for t in (256, 384, 511, 512, 520, 8192)] == [0, 0, 0, 128, 130, 2048]
    assert query_chunk(0, 8192) == 0 and query_chunk(64, 512) == 64
