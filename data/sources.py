"""Where documents come from, before packing into rows.

`text`: files matching a glob (default: the running Python's standard-library `*.py` files,
which every machine has), sorted, one file per document, tokenized in memory; the glob may be on
a `gs://` or `s3://` bucket (storage.glob_files).
`prepared`: ArrayRecord shards written by `python -m data.prepare` (see data.prepared).
`synthetic`: uniformly random rows, a pure function of (seed, index), for benchmarks.

A document goes to the held-out (eval) split by a hash of its content, so the split does not
depend on file order or on which other files exist; `data.prepare` uses the same rule.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from typing import Any

import numpy as np

import storage
from configs.schema import ConfigError
from data.packing import StreamDocuments


def stdlib_files() -> list[str]:
    """The standard library's *.py files, sorted; installed packages are not part of it."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def text_files(pattern: str) -> list[str]:
    """The files of `pattern`, sorted: a local glob, or one on a `gs://` or `s3://` bucket."""
    files = storage.glob_files(pattern)
    if not files:
        raise ConfigError(f"data.path: no file matches {pattern!r}")
    return files


def held_out(content: bytes, fraction: float) -> bool:
    """Whether a document belongs to the eval split: its hash, not its place, decides."""
    if fraction <= 0:
        return False
    bucket = int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "little") % 1_000_000
    return bucket < fraction * 1_000_000


def text_documents(
    files: list[str], tokenizer: Any, eval_fraction: float
) -> tuple[StreamDocuments, StreamDocuments | None]:
    """(train, eval) documents of the given files; eval is None when no file is held out."""
    splits: tuple[list, list] = ([], [])
    for path in files:
        content = storage.read_bytes(path)
        if not content:
            continue
        data = content if tokenizer.kind == "byte" else content.decode("utf-8", errors="replace")
        splits[held_out(content, eval_fraction)].append(tokenizer.encode(data))
    train, held = splits
    return StreamDocuments(train, tokenizer.eod_id), StreamDocuments(held, tokenizer.eod_id) if held else None


class SyntheticRows:
    """Random tokens; the same (seed, index) always gives the same row."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self._len = vocab_size, seq_len, seed, length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        return {"tokens": rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)}
