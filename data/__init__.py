"""Grain input pipeline: sources, tokenizer, per-process slicing and global batch assembly.

The names below load their modules on first use (PEP 562), so a command of this package
(`python -m data.prepare --help`) answers without importing Grain and JAX."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(("DataSources", "batch_fields", "batch_shape", "describe", "eval_batches", "global_batches",
                     "make_iterator", "open_source", "process_dataset", "to_global"), "data.pipeline"),
    "ByteTokenizer": "data.tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
