"""The Grain pipeline: documents -> rows (packed) -> shuffled (a new order each epoch), mixed
when several corpora are named -> this process's rows of each global batch -> prefetching
iterator -> one global `jax.Array` per field.

Row r of the global batch at step k is shuffled row `k * global_batch + r`, whatever the number
of processes: process p of P reads rows [p*B/P, (p+1)*B/P), which is Grain batch `k * P + p`
of size B/P. The iterator's state is the step count, so a checkpoint taken with one process
count (or device count) resumes exactly with another.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from configs.schema import Config, ConfigError
from data.packing import ConcatRows, Documents, DocumentRows
from data.pairs import PairRows
from data.prepared import open_corpus, open_manifest
from data.sources import SyntheticRows, stdlib_files, text_documents, text_files
from data.tokenizer import load_tokenizer

Rows = Sequence[dict[str, np.ndarray]]


@dataclasses.dataclass
class DataSources:
    """Training rows (one or more weighted corpora), held-out rows, and the fields of a row."""

    train: list[tuple[Rows, float]]
    eval: Rows | None
    fields: tuple[str, ...]  # "tokens", plus "segment_ids" and "positions" for document packing


def parse_mixture(text: str) -> list[tuple[str, float]]:
    """'DIR_A:0.7,DIR_B:0.3' -> [(DIR_A, 0.7), (DIR_B, 0.3)]. Raises ConfigError if malformed."""
    parts = []
    for item in text.split(","):
        path, sep, weight = item.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not sep or not path or value <= 0:
            raise ConfigError(f"data.mixture: expected DIR:WEIGHT[,DIR:WEIGHT...] with weights > 0, got {item.strip()!r}")
        parts.append((path, value))
    return parts


def batch_fields(cfg: Config) -> tuple[str, ...]:
    """The int32 arrays of `batch_shape` a batch holds: tokens, plus segments and positions for
    document packing, plus the loss mask of train.objective=sft|dpo."""
    fields = ("tokens", "segment_ids", "positions") if cfg.data.packing == "document" else ("tokens",)
    return fields + ("loss_mask",) if cfg.train.objective != "lm" else fields


def batch_shape(cfg: Config) -> tuple[int, ...]:
    """[global_batch, seq_len + 1]; for DPO [pairs, 2 (chosen, rejected), seq_len + 1]."""
    rows = (cfg.train.global_batch, 2) if cfg.train.objective == "dpo" else (cfg.train.global_batch,)
    return rows + (cfg.model.seq_len + 1,)


def _rows(docs: Documents, cfg: Config) -> Rows:
    if cfg.data.packing == "document":
        return DocumentRows(docs, cfg.model.seq_len, cfg.run.seed, cfg.model.max_documents)
    return ConcatRows(docs, cfg.model.seq_len)


def open_source(cfg: Config) -> DataSources:
    """The rows named by `data.*`. Raises ConfigError for a bad path, tokenizer or size."""
    d, seq_len = cfg.data, cfg.model.seq_len
    fields = batch_fields(cfg)
    if d.source == "synthetic":
        return DataSources([(SyntheticRows(cfg.model.vocab_size, seq_len, cfg.run.seed), 1.0)], None, ("tokens",))
    tokenizer = load_tokenizer(d.tokenizer)
    if not tokenizer.vocab_size <= cfg.model.vocab_size < tokenizer.vocab_size + 128:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} does not match the {d.tokenizer!r} tokenizer's "
            f"{tokenizer.vocab_size} tokens (it may be padded by at most 127 for sharding)"
        )
    if cfg.train.objective == "dpo":
        return _pair_source(cfg, tokenizer.fingerprint(), tokenizer.eod_id)
    if d.source == "text":
        files = text_files(d.path) if d.path else stdlib_files()
        train_docs, eval_docs = text_documents(files, tokenizer, d.eval_fraction)
        corpora = [(d.path or "the standard library", train_docs, eval_docs, 1.0)]
    else:
        key = "data.mixture" if d.mixture else "data.path"
        named = parse_mixture(d.mixture) if d.mixture else [(d.path, 1.0)]
        corpora = [
            (path, *open_corpus(path, tokenizer.fingerprint(), tokenizer.eod_id, key, cfg.train.objective), weight)
            for path, weight in named
        ]
    train = []
    for where, docs, _, weight in corpora:
        rows = _rows(docs, cfg) if docs is not None and len(docs) else []
        if len(rows) < cfg.train.global_batch:
            raise ConfigError(
                f"data.path: {where} holds {len(rows)} rows of model.seq_len={seq_len}, fewer than one global "
                f"batch of {cfg.train.global_batch}"
            )
        train.append((rows, weight))
    # Eval reads the first corpus's held-out split: one fixed yardstick, whatever the mixture.
    held = corpora[0][2]
    return DataSources(train, _rows(held, cfg) if held is not None else None, fields)


def _pair_source(cfg: Config, fingerprint: str, eod_id: int) -> DataSources:
    """The preference pairs of a DPO corpus: one element is one pair (data/pairs.py)."""
    manifest = open_manifest(cfg.data.path, fingerprint, "dpo")
    shards = {split: manifest["splits"][split]["shards"] for split in ("train", "eval")}
    train = PairRows(cfg.data.path, shards["train"], eod_id, cfg.model.seq_len)
    if len(train) < cfg.train.global_batch:
        raise ConfigError(f"data.path: {cfg.data.path} holds {len(train)} pairs, fewer than one global batch of "
                          f"{cfg.train.global_batch} (train.global_batch counts pairs under train.objective=dpo)")
    held = PairRows(cfg.data.path, shards["eval"], eod_id, cfg.model.seq_len) if shards["eval"] else None
    return DataSources([(train, 1.0)], held, batch_fields(cfg))


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


def describe(sources: DataSources, cfg: Config) -> str:
    """One log line about the data."""
    rows = sum(len(r) for r, _ in sources.train)
    if cfg.train.objective == "dpo":
        held = f", {len(sources.eval)} held-out pairs" if sources.eval is not None else ""
        return f"data: {rows} preference pairs of 2 rows of {cfg.model.seq_len + 1} tokens{held} (train.objective=dpo)"
    fill = [r.fill() for r, _ in sources.train if isinstance(r, DocumentRows)]
    held = f", {len(sources.eval)} held-out rows" if sources.eval is not None else ""
    packing = f", packing {cfg.data.packing}" + (f" ({100 * min(fill):.1f}% filled)" if fill else "")
    mixture = f" from {len(sources.train)} corpora" if len(sources.train) > 1 else ""
    return f"data: {cfg.data.source}{mixture}, {rows} training rows of {cfg.model.seq_len + 1} tokens{held}{packing}"
