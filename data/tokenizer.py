"""The built-in byte-level tokenizer: token i < 256 is byte i, 256 ends a document.

No download, no vocabulary file; the model's vocab_size may be larger (padded for sharding).
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        """Bytes -> token ids (a zero-copy uint8 view; every id fits)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")
