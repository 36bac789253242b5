"""The Grain pipeline: windows -> shuffled (a new order each epoch) -> this process's rows of each
global batch -> prefetching iterator -> one global `jax.Array`.

Row r of the global batch at step k is shuffled window `k * global_batch + r`, whatever the
number of processes: process p of P reads rows [p*B/P, (p+1)*B/P), which is Grain batch
`k * P + p` of size B/P. The iterator's state is the step count, so a checkpoint taken with one
process count resumes exactly with another.
"""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from configs.schema import Config, ConfigError
from data.sources import SyntheticWindows, TokenWindows, stdlib_files, text_files, token_stream
from data.tokenizer import ByteTokenizer


def open_source(cfg: Config) -> TokenWindows | SyntheticWindows:
    """The window source named by `data.source`. Raises ConfigError for a bad path or size."""
    seq_len = cfg.model.seq_len
    if cfg.data.source == "synthetic":
        return SyntheticWindows(cfg.model.vocab_size, seq_len, cfg.run.seed)
    tokenizer = ByteTokenizer()
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {tokenizer.name} tokenizer's "
            f"{tokenizer.vocab_size} tokens"
        )
    files = text_files(cfg.data.path) if cfg.data.path else stdlib_files()
    windows = TokenWindows(token_stream(files, tokenizer), seq_len)
    if len(windows) < cfg.train.global_batch:
        where = cfg.data.path or "the standard library"
        raise ConfigError(
            f"data.path: {where} holds {len(windows)} windows of model.seq_len={seq_len}, fewer than "
            f"one global batch of {cfg.train.global_batch}"
        )
    return windows


def process_dataset(
    source: TokenWindows | SyntheticWindows,
    global_batch: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> grain.MapDataset:
    """Element k: {'tokens': int32 [global_batch / process_count, seq_len + 1]}, this process's
    rows of global batch k."""
    local_batch = global_batch // process_count
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    ds = ds.batch(local_batch, drop_remainder=True)[process_index::process_count]
    return ds.map(lambda rows: {"tokens": np.asarray(rows, dtype=np.int32)})


def make_iterator(cfg: Config, source: TokenWindows | SyntheticWindows) -> grain.DatasetIterator:
    ds = process_dataset(source, cfg.train.global_batch, cfg.run.seed, jax.process_index(), jax.process_count())
    options = grain.ReadOptions(num_threads=cfg.data.read_threads, prefetch_buffer_size=cfg.data.prefetch)
    return iter(ds.to_iter_dataset(options))


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding, global_batch: int) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over the batch axes (single- or multi-process)."""
    return {
        name: jax.make_array_from_process_local_data(sharding, rows, (global_batch,) + rows.shape[1:])
        for name, rows in local.items()
    }


def global_batches(
    iterator: Iterator[dict[str, np.ndarray]], sharding: NamedSharding, global_batch: int
) -> Iterator[dict[str, jax.Array]]:
    for local in iterator:
        yield to_global(local, sharding, global_batch)
