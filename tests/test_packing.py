"""Packing: concat windows over documents read from memory or disk, first-fit document packing
with segment ids and restarting positions, and the loss that respects document boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from data.packing import ConcatRows, DocumentRows, StreamDocuments, pack_plan, span_from_docs

EOD = 99


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, EOD, n).astype(np.uint32) for n in lengths]


def test_concat_rows_are_the_joined_stream_cut_with_one_token_overlap():
    docs = StreamDocuments(_docs([5, 3, 11]), EOD)
    stream = np.concatenate([np.append(d, EOD) for d in _docs([5, 3, 11])])
    rows = ConcatRows(docs, seq_len=4)
    assert len(rows) == (len(stream) - 1) // 4
    for i in range(len(rows)):
        np.testing.assert_array_equal(rows[i]["tokens"], stream[4 * i : 4 * i + 5])


def test_reading_a_span_document_by_document_equals_slicing_the_stream():
    docs = StreamDocuments(_docs([5, 3, 11, 1, 7]), EOD)
    for start, stop in [(0, 6), (4, 9), (5, 6), (2, 31), (9, 10), (20, 29)]:
        np.testing.assert_array_equal(span_from_docs(docs, docs.offsets, start, stop), docs.span(start, stop))


@pytest.mark.parametrize("seed", [0, 1])
def test_every_token_is_packed_exactly_once_and_rows_never_overflow(seed):
    lengths = np.random.default_rng(seed).integers(1, 40, 500)
    pieces, row_starts = pack_plan(lengths, capacity=17, seed=seed)
    sizes = np.add.reduceat(pieces[:, 2], row_starts[:-1])
    assert sizes.max() <= 17 and row_starts[-1] == len(pieces)
    covered = np.zeros(lengths.sum(), bool)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for doc, start, size in pieces:
        assert start + size <= lengths[doc]
        span = slice(offsets[doc] + start, offsets[doc] + start + size)
        assert not covered[span].any()
        covered[span] = True
    assert covered.all()
    # First fit over 64 open rows wastes little: rows are mostly full.
    assert sizes.sum() / (len(sizes) * 17) > 0.9


def test_document_rows_carry_segments_and_positions_that_restart():
    texts = _docs([3, 20, 6, 2, 9], seed=3)
    rows = DocumentRows(StreamDocuments(texts, EOD), seq_len=9, seed=0)
    seen = []
    for i in range(len(rows)):
        row = rows[i]
        tokens, segments, positions = row["tokens"], row["segment_ids"], row["positions"]
        assert tokens.shape == segments.shape == positions.shape == (10,)
        for seg in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == seg)
            assert (np.diff(where) == 1).all() and positions[where].tolist() == list(range(len(where)))
            seen.append(tokens[where])
        assert (segments[len(np.flatnonzero(segments)) :] == 0).all()  # padding only at the end
    # Whole documents survive (the 21-token one is split into 10 + 10 + 1 pieces), each once.
    whole = sorted(np.append(t, EOD).tolist() for t in texts)
    joined = np.concatenate(seen).tolist()
    assert sorted(joined) == sorted(sum(whole, []))
    assert any(p.tolist() == np.append(texts[0], EOD).tolist() for p in seen)


def test_a_packed_row_gives_each_document_the_loss_it_has_alone(tiny):
    import jax
    import jax.numpy as jnp

    from trainer.program import abstract_program
    from trainer.state import init_state
    from trainer.objectives.lm import make_loss_fn

    cfg = tiny("mesh.data=1")
    program = abstract_program(cfg, jax.devices()[:1])
    params = init_state(cfg.model, program.tx, 0, program.state_sh).params
    sums = jax.jit(make_loss_fn(program.spec.model.graphdef))

    def loss_fn(params: dict, batch: dict) -> jax.Array:  # the mean over the batch's targets
        total, count = sums(params, batch)
        return total / count

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 12), rng.integers(0, 256, 21)  # 12 + 21 = seq_len + 1 tokens
    row = lambda x: jnp.asarray(x, jnp.int32)[None]  # noqa: E731
    packed = {
        "tokens": row(np.concatenate([a, b])),
        "segment_ids": row([1] * 12 + [2] * 21),
        "positions": row(list(range(12)) + list(range(21))),
    }
    alone = (11 * loss_fn(params, {"tokens": row(a)}) + 20 * loss_fn(params, {"tokens": row(b)})) / 31
    together = loss_fn(params, packed)
    np.testing.assert_allclose(together, alone, rtol=1e-5)
    # The same tokens without document boundaries attend across them: a different loss.
    assert abs(float(loss_fn(params, {"tokens": packed["tokens"]})) - float(alone)) > 1e-4
    # Padding (segment 0) carries no loss whatever its tokens are.
    padded = {k: jnp.concatenate([v[:, :12], jnp.zeros((1, 21), jnp.int32) + (7 if k == "tokens" else 0)], 1)
              for k, v in packed.items()}
    np.testing.assert_allclose(loss_fn(params, padded), loss_fn(params, {"tokens": row(a)}), rtol=1e-5)


def test_a_row_holds_at_most_max_pieces_documents():
    lengths = np.random.default_rng(2).integers(1, 6, 400)  # short documents: many per row
    free_pieces, free_starts = pack_plan(lengths, capacity=33, seed=0)
    pieces, row_starts = pack_plan(lengths, capacity=33, seed=0, max_pieces=4)
    assert np.diff(free_starts).max() > 4  # the bound really binds
    assert np.diff(row_starts).max() == 4 and row_starts[-1] == len(pieces) == len(free_pieces)
    assert sorted(map(tuple, pieces)) == sorted(map(tuple, free_pieces))  # the same pieces, regrouped
