"""`python -m data.prepare`: formats and bad data, determinism, the eval split, real tokenizers,
the on-disk contract (read back with Grain) and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grain
import numpy as np
import pytest

from configs.schema import ConfigError
from conftest import require
from data import formats
from data.manifest import read_manifest
from data.prepare import prepare
from data.tokenizer import ByteTokenizer, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls sing about rivers and stone bridges "
    "under pale winter skies where hungry wolves wander past quiet villages making yellow candles glow"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) + f" {i}." for i in range(n)]


def write_jsonl(path, rows: list) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def records(directory, split: str) -> list[np.ndarray]:
    """Every record of a split, read through Grain as the training reader does."""
    shards = read_manifest(str(directory))["splits"][split]["shards"]
    if not shards:
        return []
    source = grain.sources.ArrayRecordDataSource([os.path.join(directory, s) for s in shards])
    return [np.frombuffer(source[i], dtype="<u4") for i in range(len(source))]


def dir_bytes(directory) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def run(inputs, output, **kw) -> dict:
    return prepare([str(i) for i in inputs], str(output), progress=False, **kw)


def test_jsonl_bad_data_is_counted_and_the_rest_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "JSONL_TASK_BYTES", 64)  # a few lines per task: line numbers cross tasks
    good = sentences(5)
    write_jsonl(tmp_path / "a.jsonl", [
        {"text": good[0]}, "{not json", {"body": "no text field"}, {"text": 7}, {"text": "   "}, "",
        {"text": good[1], "id": 1}, [1, 2],
    ])
    with open(tmp_path / "a.jsonl", "ab") as f:  # line 9: invalid UTF-8 inside a string (kept, repaired)
        f.write(b'{"text": "caf\xe9 ' + good[2].encode() + b'"}\n')
    (tmp_path / "b.jsonl").write_text("")  # an empty file: no document, no error
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in good[3:]])
    manifest = run([tmp_path / "*.jsonl"], tmp_path / "out")
    a, b, c = manifest["inputs"]
    assert a["path"].endswith("a.jsonl") and manifest["format"] == "jsonl" and manifest["field"] == "text"
    assert (a["documents"], a["skipped"], a["replaced"]) == (3, 6, 1)
    assert a["bad_lines"] == [2, 3, 4, 5, 6, 8, 9]
    assert a["skip_reasons"] == {"blank": 2, "no_field": 2, "not_json": 1, "not_string": 1}
    assert (b["documents"], b["skipped"], c["documents"]) == (0, 0, 2)
    decoded = [ByteTokenizer().decode(r) for r in records(tmp_path / "out", "train")]
    assert decoded == [good[0], good[1], "caf\ufffd " + good[2], good[3], good[4]]  # file order, then line order
    train = manifest["splits"]["train"]
    assert train["documents"] == 5 and train["tokens"] == sum(len(d.encode()) for d in decoded)
    assert manifest["splits"]["eval"] == {"documents": 0, "tokens": 0, "shards": [], "shard_bytes": [], "shard_sha256": []}


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_compressed_inputs_give_the_same_corpus(tmp_path, monkeypatch, suffix):
    """`a.jsonl.gz` is JSONL and `b.txt.bz2` text; the tokens equal those of the plain files."""
    import bz2
    import gzip
    import lzma

    monkeypatch.setattr(formats, "JSONL_TASK_BYTES", 256)  # several tasks inside one compressed file
    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix]
    (tmp_path / "plain").mkdir()
    (tmp_path / "packed").mkdir()
    write_jsonl(tmp_path / "plain" / "a.jsonl", [{"text": t} for t in sentences(40)])
    (tmp_path / "plain" / "b.txt").write_text(" ".join(sentences(3, seed=1)))
    for name in ("a.jsonl", "b.txt"):
        (tmp_path / "packed" / (name + suffix)).write_bytes(compress((tmp_path / "plain" / name).read_bytes()))
    for fmt, name in (("jsonl", "a.jsonl"), ("text", "b.txt")):
        plain = run([tmp_path / "plain" / name], tmp_path / f"{fmt}-plain")
        packed = run([tmp_path / "packed" / (name + suffix)], tmp_path / f"{fmt}-packed")
        assert packed["format"] == fmt
        assert packed["splits"]["train"]["documents"] == plain["splits"]["train"]["documents"] > 0
        got, want = records(tmp_path / f"{fmt}-packed", "train"), records(tmp_path / f"{fmt}-plain", "train")
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    broken = compress((tmp_path / "plain" / "a.jsonl").read_bytes())
    (tmp_path / "packed" / ("c.jsonl" + suffix)).write_bytes(broken[: len(broken) // 2])
    with pytest.raises(ConfigError, match=rf"c\.jsonl\{suffix}: does not decompress"):
        run([tmp_path / "packed" / ("c.jsonl" + suffix)], tmp_path / "broken")


def test_text_files_are_documents_with_bad_ones_counted(tmp_path):
    (tmp_path / "1.txt").write_text("first document\nwith two lines\n")
    (tmp_path / "2.txt").write_text("")
    (tmp_path / "3.txt").write_text("  \n\t\n")
    (tmp_path / "4.txt").write_bytes(b"bad \xff\xfe bytes")
    manifest = run([tmp_path / "*.txt"], tmp_path / "out")
    got = [(i["documents"], i["skipped"], i["replaced"], i["skip_reasons"]) for i in manifest["inputs"]]
    assert got == [(1, 0, 0, {}), (0, 1, 0, {"empty": 1}), (0, 1, 0, {"blank": 1}), (1, 0, 1, {})]
    decoded = [ByteTokenizer().decode(r) for r in records(tmp_path / "out", "train")]
    assert decoded == ["first document\nwith two lines\n", "bad \ufffd\ufffd bytes"]


def test_parquet_rows_and_its_refusals(tmp_path):
    pa = require("pyarrow", "data")
    pq = require("pyarrow.parquet", "data")
    good = sentences(3)
    table = pa.table({"content": [good[0], None, " ", good[1], good[2]], "n": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "d.parquet")
    manifest = run([tmp_path / "d.parquet"], tmp_path / "out", field="content")
    (entry,) = manifest["inputs"]
    assert (entry["documents"], entry["skipped"], entry["bad_lines"]) == (3, 2, [2, 3])
    assert entry["skip_reasons"] == {"blank": 1, "null": 1} and manifest["format"] == "parquet"
    assert [ByteTokenizer().decode(r) for r in records(tmp_path / "out", "train")] == good
    with pytest.raises(ConfigError, match=r"d\.parquet: no column 'text'"):
        run([tmp_path / "d.parquet"], tmp_path / "out2")
    with pytest.raises(ConfigError, match=r"column 'n' holds int64"):
        run([tmp_path / "d.parquet"], tmp_path / "out2", field="n")


def test_output_is_byte_identical_across_reruns_and_worker_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "JSONL_TASK_BYTES", 1024)  # many tasks in flight at once
    for i in range(3):
        write_jsonl(tmp_path / f"part{i}.jsonl", [{"text": t} for t in sentences(60, seed=i)])
    options = dict(eval_fraction=0.2, shard_docs=25)
    first = run([tmp_path / "*.jsonl"], tmp_path / "w1", workers=1, **options)
    assert len(first["splits"]["train"]["shards"]) > 2 and first["splits"]["eval"]["documents"] > 0
    snapshot = dir_bytes(tmp_path / "w1")
    again = run([tmp_path / "*.jsonl"], tmp_path / "w1", workers=1, **options)  # same inputs: may rerun in place
    assert dir_bytes(tmp_path / "w1") == snapshot and again["content_hash"] == first["content_hash"]
    run([tmp_path / "*.jsonl"], tmp_path / "w2", workers=2, **options)
    assert dir_bytes(tmp_path / "w2") == snapshot
    # The comparison can fail: other content gives another hash.
    write_jsonl(tmp_path / "part0.jsonl", [{"text": t} for t in sentences(60, seed=9)])
    changed = run([tmp_path / "*.jsonl"], tmp_path / "w3", workers=2, **options)
    assert changed["content_hash"] != first["content_hash"]


def test_eval_split_is_by_content(tmp_path):
    texts = sentences(600)
    write_jsonl(tmp_path / "all.jsonl", [{"text": t} for t in texts])
    manifest = run([tmp_path / "all.jsonl"], tmp_path / "out", eval_fraction=0.2)
    decode = ByteTokenizer().decode
    train = {decode(r) for r in records(tmp_path / "out", "train")}
    held = {decode(r) for r in records(tmp_path / "out", "eval")}
    assert not train & held and train | held == set(texts)
    assert 80 <= len(held) <= 160 and manifest["splits"]["eval"]["documents"] == len(held)
    assert manifest["splits"]["eval"]["shards"] == ["eval-00000-of-00001.array_record"]
    # Another order and a subset: every document lands on the same side.
    write_jsonl(tmp_path / "other.jsonl", [{"text": t} for t in texts[::-1][:300]])
    run([tmp_path / "other.jsonl"], tmp_path / "out2", eval_fraction=0.2)
    held2 = {decode(r) for r in records(tmp_path / "out2", "eval")}
    assert held2 and held2 == held & set(texts[::-1][:300])


def _hf_tokenizer(tmp_path, name: str, special: list[str]) -> str:
    tokenizers = require("tokenizers", "data")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"] + special, show_progress=False)
    tok.train_from_iterator(sentences(200), trainer)
    path = tmp_path / name / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_json(tmp_path):
    path = _hf_tokenizer(tmp_path, "gpt", ["<|endoftext|>"])
    tok = load_tokenizer(path)
    assert tok.kind == "hf" and tok.eod_id == 1 and tok.vocab_size <= 200
    assert tok.fingerprint().startswith("hf:") and tok.describe()["path"] == path
    ids = tok.encode("the lazy dog sings")
    assert ids.dtype == np.uint32 and 0 < len(ids) < len("the lazy dog sings") and tok.eod_id not in ids
    assert tok.decode(ids) == "the lazy dog sings"
    texts = sentences(20, seed=3)
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    manifest = run([tmp_path / "c.jsonl"], tmp_path / "out", tokenizer=path)
    assert manifest["tokenizer"]["fingerprint"] == tok.fingerprint()
    assert [tok.decode(r) for r in records(tmp_path / "out", "train")] == texts
    # No known end-of-document token: refused, unless a tokenizer_config.json names one.
    bare = _hf_tokenizer(tmp_path, "bare", ["<sep>"])
    with pytest.raises(ConfigError, match="no end-of-document token"):
        load_tokenizer(bare)
    (tmp_path / "bare" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<sep>"}))
    assert load_tokenizer(bare).eod_id == 1


def test_sentencepiece_model(tmp_path):
    spm = require("sentencepiece", "data")
    (tmp_path / "train.txt").write_text("\n".join(sentences(300)) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=80, minloglevel=2
    )
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.kind == "sentencepiece" and tok.vocab_size == 80 and tok.eod_id == 2
    assert tok.fingerprint().startswith("sentencepiece:")
    ids = tok.encode("the quick owls sing")
    assert ids.dtype == np.uint32 and tok.eod_id not in ids and tok.decode(ids) == "the quick owls sing"
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in sentences(10, seed=4)])
    run([tmp_path / "c.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "sp.model"), workers=2)
    assert [tok.decode(r) for r in records(tmp_path / "out", "train")] == sentences(10, seed=4)


def test_unknown_tokenizer_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer: no file"):
        load_tokenizer(str(tmp_path / "missing.json"), "--tokenizer")
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ConfigError, match="neither a tokenizer.json"):
        load_tokenizer(str(tmp_path / "vocab.txt"))


def test_refuses_to_replace_other_data(tmp_path):
    (tmp_path / "a.txt").write_text("alpha document")
    (tmp_path / "b.txt").write_text("beta document")
    run([tmp_path / "a.txt"], tmp_path / "out")
    before = dir_bytes(tmp_path / "out")
    with pytest.raises(ConfigError, match="other inputs.*--overwrite"):
        run([tmp_path / "b.txt"], tmp_path / "out")
    assert dir_bytes(tmp_path / "out") == before
    run([tmp_path / "b.txt"], tmp_path / "out", overwrite=True)
    assert [ByteTokenizer().decode(r) for r in records(tmp_path / "out", "train")] == ["beta document"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    with pytest.raises(ConfigError, match="did not write \\(notes.md\\)"):
        run([tmp_path / "a.txt"], tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.md").read_text() == "keep me"


def test_a_failed_run_leaves_nothing_behind(tmp_path):
    write_jsonl(tmp_path / "1.jsonl", [{"text": t} for t in sentences(30)])
    write_jsonl(tmp_path / "2.jsonl", [{"body": t} for t in sentences(30)])  # wrong field throughout
    with pytest.raises(ConfigError, match=r"2\.jsonl: no document in 30 lines \(30 no_field\); check --field"):
        run([tmp_path / "*.jsonl"], tmp_path / "out", shard_docs=10)
    assert sorted(os.listdir(tmp_path)) == ["1.jsonl", "2.jsonl"]  # no output, no temporary directory


def test_a_killed_runs_staging_directory_is_removed_by_the_next_run(tmp_path):
    """kill -9 leaves `.out.prepare-PID` behind; the next run for that output deletes it, but not
    one whose process still runs (a concurrent prepare)."""
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in sentences(30)])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (dead.pid, alive.pid):
            (tmp_path / f".out.prepare-{pid}").mkdir()
            (tmp_path / f".out.prepare-{pid}" / "train-00000-of-00001.array_record").write_bytes(b"half")
        run([tmp_path / "c.jsonl"], tmp_path / "out", shard_docs=10)
        assert sorted(os.listdir(tmp_path)) == sorted([".out.prepare-%d" % alive.pid, "c.jsonl", "out"])
    finally:
        alive.kill()


def test_read_manifest_names_the_damaged_file(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in sentences(30)])
    run([tmp_path / "c.jsonl"], tmp_path / "out", shard_docs=10)
    out = tmp_path / "out"
    assert read_manifest(str(out))["splits"]["train"]["documents"] == 30
    np.save(out / "train.lengths.npy", np.zeros(29, np.int64))
    with pytest.raises(ConfigError, match=r"train\.lengths\.npy: 29 lengths"):
        read_manifest(str(out))
    os.remove(out / "train-00001-of-00003.array_record")
    with pytest.raises(ConfigError, match=r"train-00001-of-00003\.array_record: shard named in the manifest"):
        read_manifest(str(out))
    (out / "manifest.json").write_text("{")
    with pytest.raises(ConfigError, match=r"manifest\.json: unreadable"):
        read_manifest(str(out))
    with pytest.raises(ConfigError, match="not a prepared corpus"):
        read_manifest(str(tmp_path))


def test_cli_exit_status_2_for_a_glob_that_matches_nothing(tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "data.prepare", *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)

    bad = cli("--input", str(tmp_path / "nothing*.jsonl"), "--output", str(tmp_path / "out"))
    assert bad.returncode == 2 and not (tmp_path / "out").exists()
    assert bad.stderr.strip().splitlines() == [f"error: --input: no file matches '{tmp_path / 'nothing*.jsonl'}'"]
    write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}, "oops"])
    ok = cli("--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "out"), "--workers", "1")
    assert ok.returncode == 0, ok.stderr
    assert f"warning: {tmp_path / 'c.jsonl'}: skipped 1 (1 not_json); first bad lines/rows 2" in ok.stderr
    assert "train: 1 documents, 5 tokens, 1 shard(s)" in ok.stdout
