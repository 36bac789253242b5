"""A prepared corpus written to a bucket (`data.prepare --output gs://...` or `s3://...`).

`data.prepare` writes the corpus into a local temporary directory as for a local output, then
uploads it here. An object store has no rename, so the local rule (write aside, rename into
place) becomes an order: the previous corpus's `manifest.json` is deleted first (from then on the
prefix is no prepared corpus to any reader), its other files, then every shard and lengths file
is uploaded, and the manifest last. A command cut short at any moment leaves a prefix without a
manifest, which every reader refuses as unprepared and the next `data.prepare` replaces without
`--overwrite`; never a manifest beside shards of another corpus.
"""

from __future__ import annotations

import os

import storage
from data.manifest import MANIFEST, SPLITS, is_prepared_file, lengths_name


def corpus_files(manifest: dict) -> list[str]:
    """The names of a prepared corpus's files other than its manifest, shards first."""
    shards = [name for split in SPLITS for name in manifest["splits"][split]["shards"]]
    return shards + [lengths_name(split) for split in SPLITS]


def publish(local: str, url: str, manifest: dict, progress: bool) -> None:
    """Uploads the prepared corpus in the local directory `local` to the bucket prefix `url`,
    replacing the prepared corpus there (data.prepare's check refused any other file)."""
    previous = storage.listdir(url)
    if MANIFEST in previous:
        storage.remove(storage.join(url, MANIFEST))
    names = corpus_files(manifest)
    for name in previous:
        if name not in names and name != MANIFEST and is_prepared_file(name):
            storage.remove(storage.join(url, name))
    pairs = [(os.path.join(local, name), storage.join(url, name)) for name in names]
    storage.copy_files(pairs, f"upload {url}", progress)
    storage.copy_file(os.path.join(local, MANIFEST), storage.join(url, MANIFEST))
