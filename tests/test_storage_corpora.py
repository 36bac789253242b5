"""Prepared corpora on object stores (docs/storage.md), against the real servers of
tests/storage_servers.py: `data.prepare` reading its inputs from a bucket and writing its output
there (the same bytes as on local disk, the manifest last), and runs training from such a corpus
through this host's cache (downloaded once, reused, downloaded again when damaged, one process
of a host at a time) with the losses of the same corpus on local disk, alone and in a mixture;
a missing bucket, a prefix without a corpus and an unwritable cache refused with one line."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import pathlib
import uuid

import numpy as np
import pytest

import storage
import trainer
from bench.procs import TINY
from configs import ConfigError, load_config
from configs.schema import DataConfig
from conftest import stdlib_glob
from data.corpus_cache import local_corpus, remote_manifest
from data.manifest import MANIFEST
from data.prepare import prepare
from data.prepared import open_manifest
from data.shards import SOURCE, Shards
from data.tokenizer import ByteTokenizer
from train import main as train_main

BUCKETS = ["s3_bucket", "gcs_bucket"]


def fresh(request: pytest.FixtureRequest, bucket: str) -> str:
    """A new prefix in the bucket fixture's bucket."""
    return f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}"


def lines(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog by seven wise owls".split()
    return b"".join(json.dumps({"text": " ".join(rng.choice(words, 6)) + f" {i}."}).encode() + b"\n" for i in range(n))


def files(directory: str) -> dict[str, bytes]:
    """Every file of a prepared corpus, local or on a bucket, but its manifest (and a host's
    copy's note of where it came from)."""
    return {n: storage.read_bytes(storage.join(directory, n)) for n in storage.listdir(directory)
            if n not in (MANIFEST, SOURCE)}


def manifest(directory: str) -> dict:
    return json.loads(storage.read_text(storage.join(directory, MANIFEST)))


def copy_of(corpus: str, cache: str, verify: bool = False) -> str:
    """This host's copy of the prepared corpus on a bucket, in the cache folder `cache`."""
    return local_corpus(corpus, remote_manifest(corpus, "data.path")[0], cache, verify)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_prepare_reads_and_writes_a_bucket(request: pytest.FixtureRequest, tmp_path: pathlib.Path, bucket: str) -> None:
    """Inputs on the bucket (one gzipped, streamed) prepared into the bucket: the files of the
    same inputs prepared on local disk. An upload cut short (no manifest) is no corpus and is
    replaced without --overwrite; a corpus of other inputs needs it, and its extra shards go; a
    prefix holding other files is refused, even with --overwrite."""
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
        copy_of(out, str(tmp_path / "cache"))
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


def test_worker_processes_read_text_files_from_a_bucket(s3_bucket: str, tmp_path: pathlib.Path) -> None:
    """Text files are read by the tokenizing workers themselves (jsonl and parquet by the main
    process): with 2 workers reading from the bucket, the corpus of the same files on disk. The
    workers' forkserver is started first without the server's variables, as one started by an
    earlier local prepare in the same process would be: the workers get the caller's."""
    env = storage.client_env()
    storage.use_client_env({})
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        assert pool.apply(int, ("3",)) == 3
    storage.use_client_env(env)
    root = f"{s3_bucket}/{uuid.uuid4().hex[:8]}"
    for i in range(3):
        (tmp_path / f"{i}.txt").write_bytes(lines(5, i))
        storage.copy_file(str(tmp_path / f"{i}.txt"), f"{root}/in/{i}.txt")
    local = prepare([str(tmp_path / "*.txt")], str(tmp_path / "out"), progress=False)
    remote = prepare([f"{root}/in/*.txt"], f"{root}/out", progress=False, workers=2)
    assert remote["content_hash"] == local["content_hash"] and files(f"{root}/out") == files(str(tmp_path / "out"))
    assert remote["splits"]["train"]["documents"] == 3


def train(run_dir: str, data: str, cache: str = "") -> list[float]:
    """The losses of 3 tiny steps on the prepared corpus `data` names (`data.path=...` or
    `data.mixture=...`), a bucket's copied into `cache`."""
    # tests/test_storage.py's horizon and the preset's mesh: the suite's one compiled step.
    overrides = [f"run.dir={run_dir}", "data.source=prepared", "data.path=", data, "train.steps=3", "train.log_every=1",
                 "optim.decay_steps=12", f"data.cache_dir={cache}"]
    return [r["loss"] for r in trainer.run(load_config(TINY, overrides)) if "loss" in r]


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The references on local disk: the json package's corpus alone, and mixed 0.7/0.3 with the
    email package's; their losses."""
    root = tmp_path_factory.mktemp("corpora")
    for package in ("json", "email"):
        prepare([stdlib_glob(package)], str(root / package), progress=False, eval_fraction=0.2)
    return {"email": str(root / "email"), "one": train(str(root / "one"), f"data.path={root / 'json'}"),
            "mix": train(str(root / "mix"), f"data.mixture={root / 'json'}:0.7,{root / 'email'}:0.3")}


@pytest.mark.parametrize("bucket", BUCKETS)
def test_a_run_trains_from_a_corpus_on_a_bucket_through_the_hosts_cache(
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture, tmp_path: pathlib.Path, bucket: str,
        on_disk: dict) -> None:
    """prepare -> the bucket -> train: the first run downloads the corpus into data.cache_dir, a
    second (the corpus in a mixture with a local one) reads that copy without a download; both
    train the losses of the same corpora on local disk."""
    root = fresh(request, bucket)
    corpus = f"{root}/json"
    prepare([stdlib_glob("json")], corpus, progress=False, eval_fraction=0.2)
    cache = tmp_path / "cache"
    capfd.readouterr()
    first = train(str(tmp_path / "one"), f"data.path={corpus}", str(cache))
    out = capfd.readouterr().err
    copy = cache / manifest(corpus)["content_hash"]
    assert f"download {corpus}: " in out and f"data: {corpus} downloaded to {copy}" in out, out
    assert sorted(os.listdir(cache)) == [copy.name, copy.name + ".lock"] and files(str(copy)) == files(corpus)
    assert (copy / SOURCE).read_text() == corpus + "\n"
    assert first == on_disk["one"] and len(first) == 3
    mixed = train(str(tmp_path / "mix"), f"data.mixture={corpus}:0.7,{on_disk['email']}:0.3", str(cache))
    out = capfd.readouterr().err
    assert f"data: {corpus} read from this host's copy {copy}" in out and "download" not in out, out
    assert mixed == on_disk["mix"] and mixed != first


@pytest.mark.parametrize("bucket", BUCKETS)
def test_a_damaged_copy_is_downloaded_again_and_a_damaged_download_refused(
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture, tmp_path: pathlib.Path, bucket: str) -> None:
    """A truncated shard in the cache (found by its size), a changed byte (found under
    data.verify) or a killed download's leftovers: downloaded again. A shard on the bucket that
    differs from the manifest is one line naming it, and leaves no copy behind; a corpus made for
    another objective, or a prefix without a manifest, is refused before any download."""
    corpus = f"{fresh(request, bucket)}/corpus"
    prepare([stdlib_glob("json")], corpus, progress=False, eval_fraction=0.2, shard_docs=2)
    cache = str(tmp_path / "cache")
    copy = copy_of(corpus, cache)
    shard = manifest(corpus)["splits"]["train"]["shards"][1]
    whole = files(copy)
    assert files(corpus) == whole and copy == os.path.join(cache, manifest(corpus)["content_hash"])
    capfd.readouterr()

    def again(verify: bool) -> str:
        assert copy_of(corpus, cache, verify) == copy
        return capfd.readouterr().err

    with open(os.path.join(copy, shard), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=rf"unreadable shard .*; it is this host's copy of {corpus}: delete {copy} and "
                                          "the next run downloads it again$"):
        Shards(copy, [shard])  # the run's reader, had the sizes not been checked first: what to do names the copy
    assert f"{copy}/{shard}: 100 bytes, the manifest says {len(whole[shard])}" in again(False)
    assert files(copy) == whole
    middle = len(whole[shard]) // 3  # inside a record (tests/test_damaged_corpus.py)
    with open(os.path.join(copy, shard), "r+b") as f:
        f.seek(middle)
        f.write(bytes([whole[shard][middle] ^ 0xFF]))
    assert "download" not in again(False), "without data.verify only sizes are checked"
    assert f"{copy}/{shard}: its sha256 differs from the manifest's" in again(True)
    assert files(copy) == whole
    os.rename(copy, copy + ".partial-1")  # a download killed before its rename
    assert "downloaded to" in again(False) and not os.path.exists(copy + ".partial-1")
    storage.write_bytes(f"{corpus}/{shard}", whole[shard][:50] + bytes([whole[shard][50] ^ 1]) + whole[shard][51:])
    other = str(tmp_path / "other")
    with pytest.raises(ConfigError, match=rf"^{corpus}/{shard}: its sha256 as downloaded differs from the manifest's"):
        copy_of(corpus, other)
    assert sorted(os.listdir(other)) == [manifest(corpus)["content_hash"] + ".lock"], "no copy left behind"
    third = str(tmp_path / "third")
    with pytest.raises(ConfigError, match=rf"^data.path: '{corpus}' was prepared with --objective lm, the config has "
                                          "train.objective=sft"):
        open_manifest(corpus, ByteTokenizer(), "sft", DataConfig(cache_dir=third))
    assert not os.path.exists(third), "a corpus made for another objective is refused before any download"
    capfd.readouterr()
    empty = f"{corpus}-not-prepared"
    code = train_main(["--config", TINY, f"run.dir={tmp_path / 'run'}", "data.source=prepared",
                       f"data.cache_dir={tmp_path / 'unused'}", f"data.path={empty}"])
    out = capfd.readouterr()
    assert code == 2 and (out.out + out.err).strip() == (
        f"error: data.path: {empty!r} is not a prepared corpus (no manifest.json); run python -m data.prepare "
        f"--output {empty}"), out
    kind = corpus.split("://")[0]
    missing = f"{kind}://no-such-bucket-{uuid.uuid4().hex[:6]}/corpus"
    code = train_main(["--config", TINY, f"run.dir={tmp_path / 'run'}", "data.source=prepared",
                       f"data.cache_dir={tmp_path / 'unused'}", f"data.mixture={missing}:0.5,{corpus}:0.5"])
    out = capfd.readouterr()
    assert code == 2 and (out.out + out.err).strip().splitlines()[-1] == (
        f"error: data.mixture={missing}: bucket {missing.split('/')[2]} does not exist at "
        f"{os.environ['AWS_ENDPOINT_URL' if kind == 's3' else 'STORAGE_EMULATOR_HOST']}"), out
    with pytest.raises(ConfigError, match=r"^data.cache_dir=/proc/meshlm: /proc is not a writable directory"):
        local_corpus(corpus, remote_manifest(corpus, "data.path")[0], "/proc/meshlm", False)


def test_the_processes_of_a_host_take_turns_and_copy_once(s3_bucket: str, tmp_path: pathlib.Path) -> None:
    """While one process of this host holds the corpus's lock and copies it, another waits, then
    reads that copy without downloading (a second Python process; the first is this one)."""
    import fcntl
    import subprocess
    import sys

    from conftest import ROOT
    from data import corpus_cache

    corpus = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/json"
    prepare([stdlib_glob("json")], corpus, progress=False)
    raw, found = corpus_cache.remote_manifest(corpus, "data.path")
    cache = tmp_path / "cache"
    cache.mkdir()
    target = str(cache / found["content_hash"])
    code = (f"from data.corpus_cache import local_corpus; print(local_corpus({corpus!r}, {raw!r}, {str(cache)!r}, "
            "False))")
    with open(target + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        other = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        try:
            assert other.stderr.readline().startswith(f"data: waiting for another process of this host to copy {corpus}")
            corpus_cache._download(corpus, target, raw, found)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = other.communicate(timeout=60)
    assert other.returncode == 0 and out.strip() == target, err
    assert err == f"data: {corpus} read from this host's copy {target}\n", err
