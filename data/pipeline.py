"""The Grain pipeline: documents -> rows (packed) -> shuffled (a new order each epoch), mixed
when several corpora are named -> this process's rows of each global batch -> prefetching
iterator -> one global `jax.Array` per field.

Row r of the global batch at step k is shuffled row `k * global_batch + r`, whatever the number
of processes: process p of P reads rows [p*B/P, (p+1)*B/P), which is Grain batch `k * P + p`
of size B/P. The iterator's state is the step count, so a checkpoint taken with one process
count (or device count) resumes exactly with another.
"""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from configs.schema import Config, ConfigError
from data import corpus_format
from data.corpus_format import DataSources
from data.sources import SyntheticRows
from data.tokenizer import load_tokenizer


def batch_fields(cfg: Config, fmt: str) -> tuple[str, ...]:
    """The int32 arrays of `batch_shape` a batch of corpus format `fmt` holds (data/corpus_format/)."""
    return corpus_format.get(fmt).fields(cfg)


def batch_shape(cfg: Config, fmt: str) -> tuple[int, ...]:
    """[global_batch, seq_len + 1]; for a format of several rows an example (DPO) [pairs, 2, seq_len + 1]."""
    return corpus_format.get(fmt).shape(cfg)


def open_source(cfg: Config, fmt: str) -> DataSources:
    """The rows named by `data.*`, read as corpus format `fmt`. Raises ConfigError for a bad path,
    tokenizer or size."""
    d = cfg.data
    form = corpus_format.get(fmt)
    if d.source == "synthetic":  # no documents and no tokenizer: random rows of tokens
        return DataSources([(SyntheticRows(cfg.model.vocab_size, cfg.model.seq_len, cfg.run.seed), 1.0)], None,
                           ("tokens",))
    tokenizer = load_tokenizer(d.tokenizer)
    if not tokenizer.vocab_size <= cfg.model.vocab_size < tokenizer.vocab_size + 128:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} does not match the {d.tokenizer!r} tokenizer's "
            f"{tokenizer.vocab_size} tokens (it may be padded by at most 127 for sharding)"
        )
    return form.open(cfg, tokenizer)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([r[name] for r in rows]).astype(np.int32) for name in rows[0]}


def process_dataset(
    sources: DataSources, global_batch: int, seed: int, process_index: int, process_count: int
) -> grain.MapDataset:
    """Element k: this process's rows of global batch k, {field: int32 [B/P, seq_len + 1]}."""
    parts = [
        grain.MapDataset.source(rows).shuffle(seed=seed + i).repeat(None) for i, (rows, _) in enumerate(sources.train)
    ]
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [w for _, w in sources.train])
    ds = ds.batch(global_batch // process_count, drop_remainder=True, batch_fn=_stack)
    return ds[process_index::process_count]


def eval_batches(
    sources: DataSources, global_batch: int, batches: int, seed: int, process_index: int, process_count: int
) -> list[dict[str, np.ndarray]]:
    """This process's rows of the first `batches` held-out batches: the same rows at every eval,
    in a seeded order (a fixed sample of the whole split, not its first files)."""
    assert sources.eval is not None
    local = global_batch // process_count
    ds = grain.MapDataset.source(sources.eval).shuffle(seed=seed).repeat(None)
    ds = ds.batch(local, drop_remainder=True, batch_fn=_stack)[process_index::process_count]
    return [ds[k] for k in range(batches)]


def make_iterator(cfg: Config, sources: DataSources) -> grain.DatasetIterator:
    ds = process_dataset(sources, cfg.train.global_batch, cfg.run.seed, jax.process_index(), jax.process_count())
    options = grain.ReadOptions(num_threads=cfg.data.read_threads, prefetch_buffer_size=cfg.data.prefetch)
    it = ds.to_iter_dataset(options)
    if cfg.data.workers > 0:
        from absl import flags  # Grain's worker processes read absl flags, which nobody parsed here

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.data.workers))
    return iter(it)


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


def describe(sources: DataSources, cfg: Config, fmt: str) -> str:
    """One log line about the data of corpus format `fmt`."""
    return corpus_format.get(fmt).describe(sources, cfg)
