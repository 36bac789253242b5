"""Prepared corpora on object stores (docs/storage.md), against the real servers of
tests/storage_servers.py: `data.prepare` reading its inputs from a bucket and writing its output
there (the same bytes as on local disk, the manifest last), and runs training from such a corpus
through this host's cache (downloaded once, reused, downloaded again when damaged) with the
losses of the same corpus on local disk, alone and in a mixture."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import uuid

import numpy as np
import pytest

import storage
import trainer
from bench.procs import TINY
from configs import ConfigError, load_config
from conftest import stdlib_glob
from data.corpus_cache import local_corpus
from data.manifest import MANIFEST
from data.prepare import prepare

BUCKETS = ["s3_bucket", "gcs_bucket"]


def fresh(request: pytest.FixtureRequest, bucket: str) -> str:
    """A new prefix in the bucket fixture's bucket."""
    return f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}"


def lines(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog by seven wise owls".split()
    return b"".join(json.dumps({"text": " ".join(rng.choice(words, 6)) + f" {i}."}).encode() + b"\n" for i in range(n))


def files(directory: str) -> dict[str, bytes]:
    """Every file of a prepared corpus, local or on a bucket, but its manifest."""
    return {n: storage.read_bytes(storage.join(directory, n)) for n in storage.listdir(directory) if n != MANIFEST}


def manifest(directory: str) -> dict:
    return json.loads(storage.read_text(storage.join(directory, MANIFEST)))


@pytest.mark.parametrize("bucket", BUCKETS)
def test_prepare_reads_and_writes_a_bucket(request: pytest.FixtureRequest, tmp_path: pathlib.Path, bucket: str) -> None:
    """Inputs on the bucket (one gzipped, streamed) prepared into the bucket: the files of the
    same inputs prepared on local disk. An upload cut short (no manifest) is no corpus and is
    replaced without --overwrite; a corpus of other inputs needs it, and its extra shards go."""
    root = fresh(request, bucket)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(lines(40, 0))
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(lines(30, 1)))
    for name in ("a.jsonl", "b.jsonl.gz"):
        storage.copy_file(str(tmp_path / "in" / name), f"{root}/in/{name}")
    options = dict(progress=False, shard_docs=16, eval_fraction=0.2)
    local = prepare([str(tmp_path / "in" / "*.jsonl*")], str(tmp_path / "out"), **options)
    out = f"{root}/corpus"
    remote = prepare([f"{root}/in/*.jsonl*"], out, **options)
    assert len(remote["splits"]["train"]["shards"]) >= 3 and remote["content_hash"] == local["content_hash"]
    assert files(out) == files(str(tmp_path / "out")) and manifest(out) == remote
    assert [i["path"] for i in remote["inputs"]] == [f"{root}/in/a.jsonl", f"{root}/in/b.jsonl.gz"]
    assert [i["documents"] for i in remote["inputs"]] == [i["documents"] for i in local["inputs"]] == [40, 30]

    storage.remove(f"{out}/{MANIFEST}")  # an upload cut short before its last object
    with pytest.raises(ConfigError, match="is not a prepared corpus"):
        local_corpus(out, "data.path", str(tmp_path / "cache"), False)
    only_a = prepare([f"{root}/in/a.jsonl"], out, progress=False, shard_docs=16, eval_fraction=0.2)
    with pytest.raises(ConfigError, match="other inputs.*--overwrite"):
        prepare([f"{root}/in/b.jsonl.gz"], out, progress=False)
    assert manifest(out) == only_a, "the refused run left the corpus as it was"
    one = prepare([f"{root}/in/b.jsonl.gz"], out, progress=False, overwrite=True)
    assert sorted(files(out)) == ["eval.lengths.npy", "train-00000-of-00001.array_record", "train.lengths.npy"]
    assert manifest(out) == one and one["splits"]["train"]["documents"] == 30
    storage.write_text(f"{root}/mine/notes.md", "keep me")
    with pytest.raises(ConfigError, match=r"did not write \(notes.md\)"):
        prepare([f"{root}/in/a.jsonl"], f"{root}/mine", progress=False, overwrite=True)
    assert storage.listdir(f"{root}/mine") == ["notes.md"]
