"""Random-access sources of training windows, each `seq_len + 1` tokens long.

`text`: files matching a glob (default: the running Python's standard-library `*.py` files,
which every machine has), sorted, tokenized, joined with an end-of-document token, and cut into
consecutive windows that overlap by one token (so every token is a target exactly once).
`synthetic`: uniformly random tokens, a pure function of (seed, index), for benchmarks.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

from configs.schema import ConfigError
from data.tokenizer import ByteTokenizer


def stdlib_files() -> list[str]:
    """The standard library's *.py files, sorted; installed packages are not part of it."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def text_files(pattern: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"data.path: no file matches {pattern!r}")
    return files


def token_stream(files: list[str], tokenizer: ByteTokenizer) -> np.ndarray:
    """All documents, each followed by the end-of-document token, as one uint16 array."""
    docs = []
    for path in files:
        with open(path, "rb") as f:
            docs.append(tokenizer.encode(f.read()))
    stream = np.full(sum(len(d) + 1 for d in docs), tokenizer.eod_id, dtype=np.uint16)
    offset = 0
    for doc in docs:
        stream[offset : offset + len(doc)] = doc
        offset += len(doc) + 1
    return stream


class TokenWindows:
    """Window i = stream[i * seq_len : i * seq_len + seq_len + 1] as int32."""

    def __init__(self, stream: np.ndarray, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self._len = max(0, (len(stream) - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.stream[start : start + self.seq_len + 1].astype(np.int32)


class SyntheticWindows:
    """Random tokens; the same (seed, index) always gives the same window."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self._len = vocab_size, seq_len, seed, length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)
