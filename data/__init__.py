"""Grain input pipeline: sources, tokenizer, per-process slicing and global batch assembly."""

from data.pipeline import global_batches, make_iterator, open_source, process_dataset, to_global
from data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "global_batches", "make_iterator", "open_source", "process_dataset", "to_global"]
