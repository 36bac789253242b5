"""The corpus formats: what `train.objective` (and `data.prepare --objective`) means to data/,
one module per format behind one registry (registry.py) that the pipeline and `data.prepare`
look formats up in by name, so no data code compares a format's name.

- lm.py: plain documents, packed; every next token trains.
- sft.py: documents with a loss mask of the assistant tokens, packed whole.
- dpo.py: preference pairs, [pairs, 2, seq_len + 1] padded rows with their loss masks.
- rl.py: prompts with reference answers, padded rows with the answer's mask (reinforcement learning).

    fmt = corpus_format.get(name)
    fmt.fields(cfg), fmt.shape(cfg)  # the arrays of a batch and their shape
    fmt.open(cfg, tokenizer)  # DataSources: training and held-out rows
    fmt.describe(sources, cfg)  # the log line
    fmt.examples, fmt.record(obj, template, encode_batch)  # data.prepare: JSONL examples -> records

A new format is a module here with a `CorpusFormat` subclass
decorated with `@register`, imported below; the configs' `train.objective` choices and rules
(configs/schema.py, configs/validate.py) name it too.
"""

# Each module registers its format on import, and this order is names()'s: the order of
# `data.prepare --objective`'s choices and of its error message.
from data.corpus_format import lm, sft, dpo, rl  # noqa: F401, I001
from data.corpus_format.registry import CorpusFormat, DataSources, Rows, get, names, register

__all__ = ["CorpusFormat", "DataSources", "Rows", "get", "names", "register"]
