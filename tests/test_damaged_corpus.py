"""A damaged prepared corpus, for real: a truncated shard, a flipped byte, a shard changed in place.
Each stops train.py with one line naming the shard and saying to prepare the corpus again, exit 2:
before anything is compiled where it shows at open (a truncated shard: its size against the
manifest's, or its own footer in a corpus prepared before sizes were recorded; any change, with
`data.verify=true`), and mid-run where only reading the record shows it, the last checkpoint as
it was."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import stdlib_glob
from data.prepare import prepare
from train import main as train_main

AGAIN = "prepare the corpus again (python -m data.prepare)"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The email package's sources as 3 shards of up to 10 documents."""
    out = str(tmp_path_factory.mktemp("corpus") / "prepared")
    prepare([stdlib_glob("email")], out, progress=False, shard_docs=10)
    return out


def _copy(corpus: str, tmp_path) -> str:
    path = str(tmp_path / "corpus")
    shutil.copytree(corpus, path)
    return path


def _flip(path: str) -> None:
    """One byte a third of the way in flipped: inside a record, the file's size unchanged."""
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _sizes(directory) -> dict[str, int]:
    return {os.path.join(d, p): os.path.getsize(os.path.join(d, p)) for d, _, ps in os.walk(directory) for p in ps}


def _refused(capsys, *overrides: str) -> str:
    assert train_main(["--config", "tiny", "data.source=prepared", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_truncated_shard_is_refused_at_open(corpus, tmp_path, capsys):
    path = _copy(corpus, tmp_path)
    shard = os.path.join(path, "train-00002-of-00003.array_record")
    size = os.path.getsize(shard)
    os.truncate(shard, 100_000)
    run_dir = tmp_path / "run"
    err = _refused(capsys, f"data.path={path}", f"run.dir={run_dir}")
    assert err == (f"error: {shard}: 100000 bytes, the manifest says {size}: the shard is truncated or was changed; "
                   f"{AGAIN}")
    assert not run_dir.exists()
    # A corpus prepared before shards had their sizes recorded: the shard's own footer tells.
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    for split in manifest["splits"].values():
        del split["shard_bytes"], split["shard_sha256"]
    open(os.path.join(path, "manifest.json"), "w").write(json.dumps(manifest))
    err = _refused(capsys, f"data.path={path}", f"run.dir={run_dir}")
    assert err.startswith(f"error: {shard}: unreadable shard (RuntimeError: ") and err.endswith(AGAIN), err
    assert not run_dir.exists()


def test_a_flipped_byte_is_refused_at_open_when_verified(corpus, tmp_path, capsys):
    path = _copy(corpus, tmp_path)
    shard = os.path.join(path, "train-00001-of-00003.array_record")
    _flip(shard)
    err = _refused(capsys, f"data.path={path}", f"run.dir={tmp_path / 'run'}", "data.verify=true")
    assert err == (f"error: {shard}: its sha256 differs from the manifest's (data.verify): the shard is damaged or "
                   f"was changed; {AGAIN}")


def test_a_record_unreadable_mid_run_stops_it_with_the_checkpoint_intact(corpus, tmp_path, capsys):
    """4 steps on the sound corpus, its checkpoint at 4; a shard damaged; the resumed run reads
    the damaged record and stops, step 4's checkpoint as it was."""
    path = _copy(corpus, tmp_path)
    run = [f"data.path={path}", f"run.dir={tmp_path / 'run'}", "checkpoint.every=4"]
    assert train_main(["--config", "tiny", "data.source=prepared", *run, "train.steps=4"]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    before = _sizes(checkpoints)
    shard = os.path.join(path, "train-00001-of-00003.array_record")
    _flip(shard)
    capsys.readouterr()
    err = _refused(capsys, *run, "train.steps=40")
    assert err.startswith(f"error: {shard}: record unreadable (RuntimeError: ") and err.endswith(
        f"the shard is damaged; {AGAIN}"), err
    assert sorted(os.listdir(checkpoints)) == ["4"]
    assert _sizes(checkpoints) == before
