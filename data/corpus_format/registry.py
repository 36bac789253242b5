"""The corpus formats by name: what a format is, and the one way to look it up.

A corpus format owns everything that differs between the kinds of prepared data: the fields and
shape of a batch, how the training and held-out rows are opened, the log line about them, and its
`data.prepare` side (whether it reads JSONL examples through a chat template, and how one example
becomes a record). The names are `train.objective`'s and `data.prepare --objective`'s, and the
`objective` field of a prepared corpus's manifest (data/manifest.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from configs.schema import Config, ConfigError
from configs.registry import Registry, api
from data.chat import ChatTemplate
from data.prepared import open_manifest
from data.shards import RecordRows
from data.tokenizer import Tokenizer

__all__ = ["CorpusFormat", "DataSources", "Rows", "get", "names", "register"]

Rows = Sequence[dict[str, np.ndarray]]


@dataclasses.dataclass
class DataSources:
    """Training rows (one or more weighted corpora), held-out rows, and the fields of a row."""

    train: list[tuple[Rows, float]]
    eval: Rows | None
    fields: tuple[str, ...]  # "tokens", plus "segment_ids" and "positions" for document packing


class CorpusFormat:
    """One kind of prepared corpus and the rows a batch of it holds."""

    name: ClassVar[str]
    rows: ClassVar[int] = 1  # sequences per example: a batch is [global_batch, rows, seq_len + 1] when > 1
    masked: ClassVar[bool] = False  # rows carry a `loss_mask` of the tokens that train
    examples: ClassVar[bool] = False  # prepared from JSONL examples through a chat template, not documents

    def fields(self, cfg: Config) -> tuple[str, ...]:
        """The int32 arrays of `shape` a batch holds: tokens, plus segments and positions for
        document packing, plus the loss mask of a masked format."""
        fields = ("tokens", "segment_ids", "positions") if cfg.data.packing == "document" else ("tokens",)
        return fields + ("loss_mask",) if self.masked else fields

    def shape(self, cfg: Config) -> tuple[int, ...]:
        """[global_batch, seq_len + 1], with the `rows` of an example between when there are several."""
        rows = (self.rows,) if self.rows > 1 else ()
        return (cfg.train.global_batch, *rows, cfg.model.seq_len + 1)

    def open(self, cfg: Config, tokenizer: Tokenizer) -> DataSources:
        """The training and held-out rows `data.*` names. Raises ConfigError naming the key."""
        raise NotImplementedError

    def describe(self, sources: DataSources, cfg: Config) -> str:
        """One log line about the data."""
        raise NotImplementedError

    def record(self, obj: Any, template: ChatTemplate,
               encode_batch: Callable[[list[str]], list[np.ndarray]]) -> np.ndarray:
        """A JSONL example -> its record (data/chat.py) for a format of `examples`. Raises
        data.chat.Skip with the reason a row is no example."""
        raise NotImplementedError(f"corpus format {self.name} is prepared from documents, not examples")


_FORMATS: Registry[CorpusFormat] = Registry(
    "train.objective", unknown="{key}: no corpus format {name!r}; expected one of {names}")
register, get, names = api(_FORMATS)  # a CorpusFormat subclass decorated with `register`, in registration order


def open_examples(cfg: Config, tokenizer: Tokenizer, fmt: str, rows: type[RecordRows], unit: str) -> DataSources:
    """The train and held-out rows of a prepared corpus of examples at data.path (one `rows`
    element per record: DPO pairs, RL prompts). Raises ConfigError naming data.path when the
    training split holds fewer `unit` than one global batch."""
    local, manifest = open_manifest(cfg.data.path, tokenizer, fmt, cfg.data)
    shards = {split: manifest["splits"][split]["shards"] for split in ("train", "eval")}
    train = rows(local, shards["train"], tokenizer.eod_id, cfg.model.seq_len)
    if len(train) < cfg.train.global_batch:
        raise ConfigError(f"data.path: {cfg.data.path} holds {len(train)} {unit}, fewer than one global batch of "
                          f"{cfg.train.global_batch} (train.global_batch counts {unit} for a corpus of {fmt} examples)")
    held = rows(local, shards["eval"], tokenizer.eod_id, cfg.model.seq_len) if shards["eval"] else None
    return DataSources([(train, 1.0)], held, ("tokens", "loss_mask"))
