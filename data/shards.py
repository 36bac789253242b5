"""A prepared corpus's ArrayRecord shards as one random-access record source whose damage is named.

A truncated shard fails when it is opened (its footer is gone), a flipped byte when its record is
read (Riegeli's chunk hash): either is one ConfigError naming the shard and saying to prepare the
corpus again, not the reader's traceback. A run stops on it with exit 2 before anything is
compiled (at open) or, mid-run, with the last checkpoint as it was. Which shard failed is worked
out only then, by opening each one alone: the reading path stays the one multi-file source.
"""

from __future__ import annotations

import os

import grain
import numpy as np

from configs.schema import ConfigError

AGAIN = "prepare the corpus again (python -m data.prepare)"
# Beside the shards of a host's copy of a corpus on a bucket (data.corpus_cache): the corpus's URL.
SOURCE = "downloaded_from.txt"


def _reason(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:200]}"


class RecordRows:
    """Rows of `seq_len + 1` tokens made from one record each of a prepared corpus's shards (a DPO
    pair, an RL prompt); a subclass decodes a record in `__getitem__`."""

    def __init__(self, directory: str, shards: list[str], eod_id: int, seq_len: int) -> None:
        self.source = Shards(directory, shards)
        self.eod_id, self.capacity = eod_id, seq_len + 1

    def __len__(self) -> int:
        return len(self.source)


class Shards:
    """The records of `names` in `directory`, in order, as bytes."""

    def __init__(self, directory: str, names: list[str]):
        self.paths = [os.path.join(directory, n) for n in names]
        try:
            self.source = grain.sources.ArrayRecordDataSource(self.paths)
        except Exception as e:  # noqa: BLE001 (Riegeli's own errors: one line naming the shard instead)
            raise ConfigError(f"{self._unreadable()}: unreadable shard ({_reason(e)}); {self._again()}") from None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> bytes:
        try:
            return self.source[index]
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{self._holding(index)}: record unreadable ({_reason(e)}); the shard is damaged; "
                              f"{self._again()}") from None

    def _again(self) -> str:
        """What to do about a damaged shard: prepare the corpus again, or for this host's copy of
        a corpus on a bucket (whose content the same corpus prepared again would share), delete
        the copy so that the next run downloads it again."""
        folder = os.path.dirname(self.paths[0]) if self.paths else ""
        try:
            with open(os.path.join(folder, SOURCE)) as f:
                url = f.read().strip()
        except OSError:
            return AGAIN
        return f"it is this host's copy of {url}: delete {folder} and the next run downloads it again"

    def _each(self) -> tuple[list[int], str | None]:
        """Each shard opened alone: the record counts of those that open, up to the first that
        does not (None when all do)."""
        counts = []
        for path in self.paths:
            try:
                counts.append(len(grain.sources.ArrayRecordDataSource([path])))
            except Exception:  # noqa: BLE001
                return counts, path
        return counts, None

    def _unreadable(self) -> str:
        """The first shard that cannot be opened alone (all of them, if each can)."""
        return self._each()[1] or ", ".join(self.paths)

    def _holding(self, index: int) -> str:
        """The shard that holds record `index`, or the first that cannot be opened."""
        counts, unreadable = self._each()
        return unreadable or self.paths[int(np.searchsorted(np.cumsum(counts), index, side="right"))]
