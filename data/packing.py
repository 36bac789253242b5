"""Documents -> fixed-length training rows, with random access (so Grain shuffles globally and a
resumed run continues at exactly the next row).

A row is `seq_len + 1` tokens: inputs are row[:-1], targets row[1:]. Every document is followed
by the end-of-document token. Two packings (`data.packing`):

- `concat`: documents joined into one stream and cut into windows that overlap by one token,
  so every token is a target exactly once. Attention crosses document boundaries.
- `document`: documents (split into `seq_len + 1` pieces when longer) packed whole into rows by
  first fit over a bounded set of open rows, padded with segment id 0. Each row carries
  `segment_ids` (1, 2, ... per document, 0 for padding) and `positions` that restart at 0 for
  every document, so attention never crosses documents and rotary positions restart.

The packing plan is computed once from document lengths (no token is read) with NumPy; reading a
row is a few slices, never a per-token Python loop.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Documents(Protocol):
    """Random-access documents, each already followed by its end-of-document token."""

    lengths: np.ndarray  # int64 [num_docs], end-of-document token included

    def __len__(self) -> int: ...

    def doc(self, index: int) -> np.ndarray: ...

    def span(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenation of all documents."""
        ...


class StreamDocuments:
    """Documents held in memory as one flat stream (the `text` source)."""

    def __init__(self, docs: list[np.ndarray], eod_id: int):
        self.lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.stream = np.full(int(self.offsets[-1]), eod_id, dtype=np.uint32)
        for doc, start in zip(docs, self.offsets[:-1]):
            self.stream[start : start + len(doc)] = doc

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, index: int) -> np.ndarray:
        return self.stream[self.offsets[index] : self.offsets[index + 1]]

    def span(self, start: int, stop: int) -> np.ndarray:
        return self.stream[start:stop]


def span_from_docs(docs: Documents, offsets: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the concatenation, read document by document (for sources on
    disk). `offsets` is [0, cumsum(lengths)]."""
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop, side="left"))
    pieces = [docs.doc(i) for i in range(first, last)]
    joined = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    begin = start - int(offsets[first])
    return joined[begin : begin + stop - start]


class ConcatRows:
    """Row i = stream[i * seq_len : i * seq_len + seq_len + 1]."""

    def __init__(self, docs: Documents, seq_len: int):
        self.docs, self.seq_len = docs, seq_len
        self._len = max(0, (int(docs.lengths.sum()) - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = index * self.seq_len
        return {"tokens": self.docs.span(start, start + self.seq_len + 1).astype(np.int32)}


def pack_plan(lengths: np.ndarray, capacity: int, seed: int, open_rows: int = 64,
              max_pieces: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """First-fit packing of documents into rows of `capacity` tokens.

    Documents longer than a row are cut into row-sized pieces first. Pieces are visited in a
    seeded random order and each goes into the first of at most `open_rows` partly filled rows
    with room for it (else a new row; the oldest open row is closed when there are too many).
    With `max_pieces` > 0 a row is closed once it holds that many pieces (cuDNN's packed
    attention is sized for a fixed number of documents per row).
    Returns (pieces [n, 3] = (doc, start, length) in row order, row_starts [rows + 1]).
    """
    counts = -(-lengths // capacity)  # pieces per document
    doc_ids = np.repeat(np.arange(len(lengths)), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    starts = (np.arange(len(doc_ids)) - np.repeat(first, counts)) * capacity
    sizes = np.minimum(capacity, lengths[doc_ids] - starts)
    order = np.random.default_rng(seed).permutation(len(doc_ids))
    # The only Python loop is over pieces, once per run at start-up; it is the scan that decides
    # the plan (rows are then read by slicing). A full row is closed at once.
    row_of = np.empty(len(order), dtype=np.int64)
    free: list[int] = []  # room left in each open row
    ids: list[int] = []  # row id of each open row
    held: list[int] = []  # pieces in each open row
    rows = 0
    sizes_list = sizes[order].tolist()
    for j, size in enumerate(sizes_list):
        slot = next((k for k, room in enumerate(free) if room >= size), -1)
        if slot < 0:
            if len(free) == open_rows:
                free.pop(0), ids.pop(0), held.pop(0)
            free.append(capacity), ids.append(rows), held.append(0)
            rows, slot = rows + 1, len(free) - 1
        row_of[j] = ids[slot]
        free[slot] -= size
        held[slot] += 1
        if free[slot] == 0 or held[slot] == max_pieces:
            free.pop(slot), ids.pop(slot), held.pop(slot)
    by_row = np.argsort(row_of, kind="stable")
    chosen = order[by_row]
    pieces = np.stack([doc_ids[chosen], starts[chosen], sizes[chosen]], axis=1)
    row_starts = np.searchsorted(row_of[by_row], np.arange(rows + 1))
    return pieces, row_starts


class DocumentRows:
    """Rows of whole documents with segment ids and per-document positions; see `pack_plan`."""

    def __init__(self, docs: Documents, seq_len: int, seed: int, max_pieces: int = 0):
        self.docs, self.capacity = docs, seq_len + 1
        self.pieces, self.row_starts = pack_plan(docs.lengths, self.capacity, seed, max_pieces=max_pieces)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def fill(self) -> float:
        """The fraction of row tokens that are real (not padding)."""
        return float(self.pieces[:, 2].sum()) / (len(self) * self.capacity)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.zeros(self.capacity, np.int32)
        segments = np.zeros(self.capacity, np.int32)
        positions = np.zeros(self.capacity, np.int32)
        masked = getattr(self.docs, "masked", False)  # an SFT corpus: its trained tokens too
        loss_mask = np.zeros(self.capacity, np.int32)
        at = 0
        for seg, (doc, start, size) in enumerate(self.pieces[self.row_starts[index] : self.row_starts[index + 1]], 1):
            if masked:
                doc_tokens, doc_mask = self.docs.doc_and_mask(int(doc))
                loss_mask[at : at + size] = doc_mask[start : start + size]
            else:
                doc_tokens = self.docs.doc(int(doc))
            tokens[at : at + size] = doc_tokens[start : start + size]
            segments[at : at + size] = seg
            positions[at : at + size] = np.arange(size)
            at += size
        row = {"tokens": tokens, "segment_ids": segments, "positions": positions}
        return {**row, "loss_mask": loss_mask} if masked else row
