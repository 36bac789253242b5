"""Data: the byte tokenizer, windows over real text, per-process slicing of the global batch,
reshuffling per epoch, and an iterator that resumes at the right element."""

from __future__ import annotations

import os

import numpy as np
import pytest

from configs import ConfigError, load_config
from conftest import stdlib_glob
from data import ByteTokenizer, open_source, process_dataset
from data.sources import SyntheticWindows, TokenWindows, stdlib_files, text_files, token_stream


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
    stream = token_stream(text_files(str(tmp_path / "*.txt")), ByteTokenizer())
    assert stream.tolist() == [97, 98, 99, 256, 100, 101, 256]


def test_windows_overlap_by_one_token():
    windows = TokenWindows(np.arange(100, dtype=np.uint16), seq_len=8)
    assert len(windows) == 12
    assert windows[0].tolist() == list(range(9)) and windows[1][0] == windows[0][-1]
    assert windows[0].dtype == np.int32


def test_synthetic_windows_are_a_function_of_seed_and_index():
    a, b = SyntheticWindows(264, 16, seed=1), SyntheticWindows(264, 16, seed=1)
    np.testing.assert_array_equal(a[5], b[5])
    assert not np.array_equal(a[5], a[6]) and not np.array_equal(a[5], SyntheticWindows(264, 16, seed=2)[5])


def test_a_path_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match="data.path: no file matches"):
        text_files("/nonexistent/*.txt")


def _source():
    cfg = load_config("tiny", [f"data.path={stdlib_glob('json')}"])
    return open_source(cfg)


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
    source = TokenWindows(np.arange(16 * 8 + 1, dtype=np.uint16), seq_len=8)  # exactly 16 windows
    ds = process_dataset(source, 4, seed=0, process_index=0, process_count=1)
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
    source = open_source(cfg)

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
