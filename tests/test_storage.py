"""Run directories and checkpoints on object stores (docs/storage.md), against real servers
started once per session (tests/storage_servers.py): moto's S3 server and gcp-storage-emulator.
The path layer on a local directory and on both buckets; a tiny run on each bucket, resumed,
equal bit for bit to the same run uninterrupted on local disk; a missing bucket and an
unreachable endpoint refused with one line before anything compiles."""

from __future__ import annotations

import json
import os
import uuid

import jax
import pytest

import storage
import train
import trainer
from configs import load_config
from conftest import stdlib_glob
from bench.procs import TINY
from storage_servers import free_port, gcs_bucket, s3_bucket  # noqa: F401  (fixtures)


@pytest.fixture(params=["local", "s3", "gs"])
def root(request, tmp_path) -> str:
    """A fresh directory: local, or a fresh prefix in each server's bucket."""
    if request.param == "local":
        return str(tmp_path)
    bucket = request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")
    return f"{bucket}/{uuid.uuid4().hex[:8]}"


def test_the_path_layer_reads_writes_lists_and_removes(root):
    d = storage.join(root, "run")
    assert not storage.exists(d) and not storage.isdir(d) and storage.listdir(d) == []
    storage.makedirs(d)
    storage.write_text(storage.join(d, "a.txt"), "one\n")
    storage.write_text(storage.join(d, "b.json"), "{}", atomic=True)
    storage.makedirs(storage.join(d, "sub"))
    storage.write_bytes(storage.join(d, "sub", "c.bin"), b"\x00\x01")
    assert storage.isdir(d) and storage.listdir(d) == ["a.txt", "b.json", "sub"]
    assert storage.read_text(storage.join(d, "a.txt")) == "one\n"
    assert storage.read_bytes(storage.join(d, "sub", "c.bin")) == b"\x00\x01"
    storage.rename(storage.join(d, "sub"), storage.join(d, "moved"))
    assert storage.listdir(d) == ["a.txt", "b.json", "moved"]
    storage.remove(storage.join(d, "a.txt"))
    assert not storage.exists(storage.join(d, "a.txt"))
    with pytest.raises(FileNotFoundError):
        storage.read_text(storage.join(d, "a.txt"))
    assert storage.parent(storage.join(d, "b.json")) == d and storage.basename(d) == "run"
