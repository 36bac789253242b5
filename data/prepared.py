"""Reading a prepared corpus (`python -m data.prepare`): ArrayRecord shards of documents.

Each record is one document's token ids as little-endian uint32 without the end-of-document
token; `<split>.lengths.npy` holds every record's length, so the packing plan needs no reads.
The manifest names the tokenizer; a corpus prepared with another tokenizer than the config's
is refused. A corpus on a bucket is read from this host's local copy (data.corpus_cache).
"""

from __future__ import annotations

import os

import numpy as np

import storage
from configs.schema import ConfigError, DataConfig
from data.chat import decode_sequence
from data.corpus_cache import local_corpus, remote_manifest
from data.manifest import lengths_name, read_manifest, verify_shards
from data.packing import span_from_docs
from data.shards import Shards
from data.tokenizer import Tokenizer


class ArrayRecordDocuments:
    """One split of a prepared directory as random-access documents (eod appended on read).
    `masked`: records of an SFT corpus, whose trained tokens `doc_and_mask` also gives."""

    def __init__(self, directory: str, split: str, shards: list[str], eod_id: int, masked: bool = False):
        self.eod_id, self.masked = eod_id, masked
        self.source = Shards(directory, shards)
        lengths_path = os.path.join(directory, lengths_name(split))
        raw = np.load(lengths_path)
        if len(raw) != len(self.source):
            raise ConfigError(
                f"{lengths_path}: {len(raw)} lengths for {len(self.source)} records; prepare the corpus again"
            )
        self.lengths = raw.astype(np.int64) + 1  # the end-of-document token appended on read
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, index: int) -> np.ndarray:
        return self.doc_and_mask(index)[0]

    def doc_and_mask(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, which are trained as 0/1, or None for a corpus without a loss mask)."""
        record = np.frombuffer(self.source[index], dtype="<u4")
        if self.masked:
            return decode_sequence(record, self.eod_id)
        return np.concatenate([record, np.array([self.eod_id], np.uint32)]), None

    def span(self, start: int, stop: int) -> np.ndarray:
        return span_from_docs(self, self.offsets, start, stop)


def open_manifest(path: str, tokenizer: Tokenizer, fmt: str, data: DataConfig, key: str = "data.path") -> tuple[str, dict]:
    """(the local directory, the manifest) of the prepared corpus at `path` after checking it was
    prepared with this tokenizer and for this corpus format (the manifest's `objective`,
    `train.objective`), its shards' sizes, and with `data.verify` their bytes. A corpus on a
    bucket is read from this host's copy in `data.cache_dir` (data.corpus_cache: downloaded and
    checked first when there is none). Raises ConfigError naming the key or file."""
    if storage.is_remote(path):
        raw, manifest = remote_manifest(path, key)
        _check_made_for(manifest, path, tokenizer, fmt, key)  # before a download
        directory = local_corpus(path, raw, data.cache_dir, data.verify)  # its own checks, data.verify's too
        return directory, read_manifest(directory, key)
    manifest = read_manifest(path, key)
    if data.verify:
        verify_shards(path, manifest)
    _check_made_for(manifest, path, tokenizer, fmt, key)
    return path, manifest


def _check_made_for(manifest: dict, path: str, tokenizer: Tokenizer, fmt: str, key: str) -> None:
    """The corpus at `path` was prepared with `tokenizer` and for corpus format `fmt`."""
    theirs, ours = manifest["tokenizer"], tokenizer.describe()
    if theirs["fingerprint"] != ours["fingerprint"]:
        raise ConfigError(
            f"data.tokenizer={ours['path'] or 'byte'}: {path!r} was prepared with tokenizer "
            f"{theirs['fingerprint']!r} (from {theirs.get('path') or 'byte'}), this config's is "
            f"{ours['fingerprint']!r}; set data.tokenizer to the corpus's or prepare it again with this one"
        )
    prepared_for = manifest.get("objective", "lm")
    if prepared_for != fmt:
        raise ConfigError(f"{key}: {path!r} was prepared with --objective {prepared_for}, the config has "
                          f"train.objective={fmt}")


def open_corpus(
    directory: str, manifest: dict, eod_id: int, masked: bool = False
) -> tuple[ArrayRecordDocuments | None, ArrayRecordDocuments | None]:
    """(train, eval) documents of a prepared directory whose manifest `open_manifest` checked
    (None for an empty split); `masked`: its records carry a loss mask (data/corpus_format/).
    Raises ConfigError naming a damaged shard."""
    shards = {split: manifest["splits"][split]["shards"] for split in ("train", "eval")}
    return tuple(ArrayRecordDocuments(directory, s, shards[s], eod_id, masked) if shards[s] else None
                 for s in shards)
