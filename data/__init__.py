"""Grain input pipeline: sources, tokenizer, per-process slicing and global batch assembly."""

from data.pipeline import (
    DataSources,
    batch_fields,
    batch_shape,
    describe,
    eval_batches,
    global_batches,
    make_iterator,
    open_source,
    process_dataset,
    to_global,
)
from data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataSources",
    "batch_fields",
    "batch_shape",
    "describe",
    "eval_batches",
    "global_batches",
    "make_iterator",
    "open_source",
    "process_dataset",
    "to_global",
]
