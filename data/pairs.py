"""DPO rows: each element is one preference pair, its chosen and rejected sequences side by side.

An element is {"tokens", "loss_mask"}, each int32 [2, seq_len + 1] (chosen first): a batch of
them is [pairs, 2, seq_len + 1], so the two sequences of a pair are always in the same batch and,
the batch dim being the one that is sharded, on the same data shard and micro-batch. A sequence
is prompt then response then the end-of-document token, padded to seq_len + 1 tokens with the
end-of-document token; the mask marks the response (data.chat). A longer sequence loses the
start of its prompt first, then the end of its response.
"""

from __future__ import annotations

import numpy as np

from data.chat import decode_pair
from data.shards import RecordRows


class PairRows(RecordRows):
    """One split of a DPO corpus (`data.prepare --objective dpo`) as pairs of padded rows."""

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.full((2, self.capacity), self.eod_id, np.int32)
        mask = np.zeros((2, self.capacity), np.int32)
        for row, (seq, trained) in enumerate(decode_pair(np.frombuffer(self.source[index], "<u4"), self.eod_id)):
            # Too long: the prompt loses its start first, so that as much of the response as fits stays.
            start = min(max(len(seq) - self.capacity, 0), int(np.argmax(trained)))
            n = min(len(seq) - start, self.capacity)
            tokens[row, :n], mask[row, :n] = seq[start : start + n], trained[start : start + n]
        return {"tokens": tokens, "loss_mask": mask}
