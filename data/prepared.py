"""Reading a prepared corpus (`python -m data.prepare`): ArrayRecord shards of documents.

Each record is one document's token ids as little-endian uint32 without the end-of-document
token; `<split>.lengths.npy` holds every record's length, so the packing plan needs no reads.
The manifest names the tokenizer; a corpus prepared with another tokenizer than the config's
is refused.
"""

from __future__ import annotations

import json
import os

import grain
import numpy as np

from configs.schema import ConfigError
from data.packing import span_from_docs


class ArrayRecordDocuments:
    """One split of a prepared directory as random-access documents (eod appended on read)."""

    def __init__(self, directory: str, split: str, shards: list[str], eod_id: int):
        self.eod_id = eod_id
        paths = [os.path.join(directory, s) for s in shards]
        self.source = grain.sources.ArrayRecordDataSource(paths)
        lengths_path = os.path.join(directory, f"{split}.lengths.npy")
        raw = np.load(lengths_path)
        if len(raw) != len(self.source):
            raise ConfigError(
                f"{lengths_path}: {len(raw)} lengths for {len(self.source)} records; the directory is damaged, "
                "prepare it again"
            )
        self.lengths = raw.astype(np.int64) + 1
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, index: int) -> np.ndarray:
        tokens = np.frombuffer(self.source[index], dtype="<u4")
        return np.concatenate([tokens, np.array([self.eod_id], np.uint32)])

    def span(self, start: int, stop: int) -> np.ndarray:
        return span_from_docs(self, self.offsets, start, stop)


def read_manifest(directory: str) -> dict:
    """The manifest of a prepared directory. Raises ConfigError naming the file if it is missing
    or unreadable."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise ConfigError(f"data.path: {directory!r} is not a prepared corpus (no manifest.json); run python -m data.prepare")
    try:
        with open(path) as f:
            manifest = json.load(f)
        manifest["splits"], manifest["tokenizer"]  # noqa: B018 - both must exist
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: unreadable manifest ({e})") from None
    return manifest


def open_split(directory: str, split: str, fingerprint: str, eod_id: int) -> ArrayRecordDocuments | None:
    """The named split, or None if the corpus has none. Raises ConfigError if the corpus was
    prepared with another tokenizer."""
    manifest = read_manifest(directory)
    theirs = manifest["tokenizer"].get("fingerprint")
    if theirs != fingerprint:
        raise ConfigError(
            f"data.tokenizer: {directory!r} was prepared with tokenizer {theirs!r}, the config uses {fingerprint!r}"
        )
    shards = manifest["splits"].get(split, {}).get("shards", [])
    if not shards:
        return None
    for shard in shards:
        if not os.path.isfile(os.path.join(directory, shard)):
            raise ConfigError(f"{os.path.join(directory, shard)}: shard named in the manifest is missing")
    return ArrayRecordDocuments(directory, split, shards, eod_id)
