"""Data: the byte tokenizer, rows over real text, the held-out split, per-process slicing of
the global batch, reshuffling per epoch, mixtures, and an iterator that resumes at the right
element."""

from __future__ import annotations

import os

import numpy as np
import pytest

from configs import ConfigError, load_config
from conftest import stdlib_glob
from data import ByteTokenizer, open_source, process_dataset
from data.packing import ConcatRows, StreamDocuments
from data.pipeline import DataSources
from data.sources import SyntheticRows, held_out, stdlib_files, text_documents, text_files


def test_byte_tokenizer_round_trips_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text


def test_stdlib_corpus_is_sorted_real_python():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f for f in files)
    assert any(f.endswith(os.path.join("json", "decoder.py")) for f in files)


def test_documents_are_joined_with_end_of_document_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("de")
    (tmp_path / "c.txt").write_text("")  # empty files are not documents
    train, held = text_documents(text_files(str(tmp_path / "*.txt")), ByteTokenizer(), eval_fraction=0.0)
    assert train.stream.tolist() == [97, 98, 99, 256, 100, 101, 256] and held is None


def test_windows_overlap_by_one_token():
    rows = ConcatRows(StreamDocuments([np.arange(99)], eod_id=99), seq_len=8)
    assert len(rows) == 12
    assert rows[0]["tokens"].tolist() == list(range(9)) and rows[1]["tokens"][0] == rows[0]["tokens"][-1]
    assert rows[0]["tokens"].dtype == np.int32


def test_the_held_out_split_is_chosen_by_content_not_by_order(tmp_path):
    texts = [f"document number {i}\n" * (i % 7 + 1) for i in range(200)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i:03d}.txt").write_text(text)
    files = text_files(str(tmp_path / "*.txt"))
    train, held = text_documents(files, ByteTokenizer(), eval_fraction=0.1)
    assert 5 <= len(held) <= 40 and len(train) + len(held) == 200
    # The same documents are held out whatever the file order or the other files.
    chosen = {t for t in texts if held_out(t.encode(), 0.1)}
    _, held_reversed = text_documents(files[::-1][:150], ByteTokenizer(), eval_fraction=0.1)
    assert len(held_reversed) == len({t for t in texts[50:] if t in chosen})
    assert not held_out(b"anything", 0.0)


def test_synthetic_rows_are_a_function_of_seed_and_index():
    a, b = SyntheticRows(264, 16, seed=1), SyntheticRows(264, 16, seed=1)
    np.testing.assert_array_equal(a[5]["tokens"], b[5]["tokens"])
    assert not np.array_equal(a[5]["tokens"], a[6]["tokens"])
    assert not np.array_equal(a[5]["tokens"], SyntheticRows(264, 16, seed=2)[5]["tokens"])


def test_a_path_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match="data.path: no file matches"):
        text_files("/nonexistent/*.txt")


def _source():
    cfg = load_config("tiny", [f"data.path={stdlib_glob('json')}"])
    return open_source(cfg, cfg.train.objective)


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_read_disjoint_slices_of_the_same_global_batch(processes):
    source = _source()
    whole = process_dataset(source, 16, seed=3, process_index=0, process_count=1)
    parts = [process_dataset(source, 16, seed=3, process_index=p, process_count=processes) for p in range(processes)]
    for step in (0, 1, 7, 200):  # 200 lies in a later epoch
        rows = np.concatenate([part[step]["tokens"] for part in parts])
        np.testing.assert_array_equal(rows, whole[step]["tokens"])
    assert parts[0][0]["tokens"].shape == (16 // processes, 33)


def test_each_epoch_has_a_new_order_of_the_same_windows():
    rows = ConcatRows(StreamDocuments([np.arange(16 * 8)], eod_id=999), seq_len=8)  # exactly 16 windows
    ds = process_dataset(DataSources([(rows, 1.0)], None, ("tokens",)), 4, seed=0, process_index=0, process_count=1)
    epoch = lambda e: np.concatenate([ds[4 * e + i]["tokens"][:, 0] for i in range(4)])  # noqa: E731
    first, second = epoch(0), epoch(1)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 128, 8))
    assert first.tolist() != second.tolist()


def test_iterator_resumes_at_the_right_element(tmp_path):
    import grain
    import jax

    from trainer.checkpoint import Checkpointer
    from trainer.state import TrainState

    cfg = load_config("tiny", [f"data.path={stdlib_glob('json')}"])
    source = open_source(cfg, cfg.train.objective)

    def fresh():
        ds = process_dataset(source, 16, cfg.run.seed, 0, 1)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))

    reference = fresh()
    expected = [next(reference)["tokens"] for _ in range(6)]
    it = fresh()
    for _ in range(3):
        next(it)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), cfg.checkpoint)
    dummy = TrainState(step=jax.numpy.zeros((), "int32"), params={}, opt_state=())
    ckpt.save(3, dummy, it)
    ckpt.wait()
    restored = fresh()
    ckpt.restore(3, dummy, restored)
    ckpt.close()
    for want in expected[3:]:
        np.testing.assert_array_equal(next(restored)["tokens"], want)
    assert not np.array_equal(expected[3], expected[4])


def test_a_mixture_draws_in_proportion_deterministically_and_slices_per_process():
    a = ConcatRows(StreamDocuments([np.arange(0, 400) % 500], eod_id=999), seq_len=8)
    b = ConcatRows(StreamDocuments([np.arange(500, 900)], eod_id=999), seq_len=8)
    sources = DataSources([(a, 0.75), (b, 0.25)], None, ("tokens",))
    ds = process_dataset(sources, 16, seed=0, process_index=0, process_count=1)
    firsts = np.concatenate([ds[k]["tokens"][:, 0] for k in range(20)])
    share = float(np.mean(firsts < 500))
    assert 0.7 <= share <= 0.8, share
    again = process_dataset(sources, 16, seed=0, process_index=0, process_count=1)
    np.testing.assert_array_equal(again[13]["tokens"], ds[13]["tokens"])
    halves = [process_dataset(sources, 16, seed=0, process_index=p, process_count=2)[13]["tokens"] for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), ds[13]["tokens"])
