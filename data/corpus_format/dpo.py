"""`dpo`: preference pairs, a chosen and a rejected sequence side by side, each padded to
seq_len + 1 tokens with its loss mask of the response (data/pairs.py); nothing is packed. A batch
is [pairs, 2, seq_len + 1], so `train.global_batch` counts pairs.

`data.prepare --objective dpo` reads JSONL lines or parquet rows {"prompt", "chosen", "rejected"}, strings or
lists of messages (then through the chat template); a record is [chosen length] + chosen +
rejected (data/chat.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from configs.schema import Config
from data.chat import ChatTemplate, Skip, encode, encode_pair, prompt_segments
from data.corpus_format.registry import CorpusFormat, DataSources, open_examples, register
from data.pairs import PairRows
from data.tokenizer import Tokenizer


@register
class PreferencePairs(CorpusFormat):
    """Pairs of padded rows, chosen then rejected (`train.objective=dpo`)."""

    name = "dpo"
    rows = 2
    masked = True
    examples = True

    def fields(self, cfg: Config) -> tuple[str, ...]:
        return ("tokens", "loss_mask")  # what PairRows gives: padded rows, no documents to tell apart

    def open(self, cfg: Config, tokenizer: Tokenizer) -> DataSources:
        """One element is one pair (data/pairs.py)."""
        return open_examples(cfg, tokenizer, self.name, PairRows, "pairs")

    def describe(self, sources: DataSources, cfg: Config) -> str:
        pairs = sum(len(r) for r, _ in sources.train)
        held = f", {len(sources.eval)} held-out pairs" if sources.eval is not None else ""
        return f"data: {pairs} preference pairs of 2 rows of {cfg.model.seq_len + 1} tokens{held} (train.objective=dpo)"

    def record(self, obj: Any, template: ChatTemplate,
               encode_batch: Callable[[list[str]], list[np.ndarray]]) -> np.ndarray:
        if not isinstance(obj, dict):
            raise Skip("not_object")
        chosen, rejected = (encode(s, encode_batch) for s in prompt_segments(obj, template, ("chosen", "rejected")))
        return encode_pair(chosen, rejected)
