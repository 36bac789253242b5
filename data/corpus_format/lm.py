"""`lm`: plain documents, packed into rows (concatenated, or whole documents under
`data.packing=document`); every next token trains. The rows of `data.source=text` (files
tokenized in memory) and of `data.source=prepared` (`data.prepare --objective lm`, one corpus or
a weighted `data.mixture`). `sft` (sft.py) is this format with a loss mask.
"""

from __future__ import annotations

from configs.schema import Config, ConfigError
from data.corpus_format.registry import CorpusFormat, DataSources, Rows, register
from data.packing import ConcatRows, Documents, DocumentRows
from data.prepared import open_corpus, open_manifest
from data.sources import stdlib_files, text_documents, text_files
from data.tokenizer import Tokenizer

# (where, train documents, held-out documents or None, mixture weight) of one corpus
Corpus = tuple[str, Documents | None, Documents | None, float]


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


def document_rows(docs: Documents, cfg: Config) -> Rows:
    """Documents packed into rows of seq_len + 1 tokens as `data.packing` says."""
    if cfg.data.packing == "document":
        return DocumentRows(docs, cfg.model.seq_len, cfg.run.seed, cfg.model.max_documents)
    return ConcatRows(docs, cfg.model.seq_len)


@register
class PlainDocuments(CorpusFormat):
    """Documents whose every token trains (`train.objective=lm`)."""

    name = "lm"

    def corpora(self, cfg: Config, tokenizer: Tokenizer) -> list[Corpus]:
        """The corpora `data.*` names, each split into training and held-out documents."""
        d = cfg.data
        if d.source == "text":
            files = text_files(d.path) if d.path else stdlib_files()
            train_docs, eval_docs = text_documents(files, tokenizer, d.eval_fraction)
            return [(d.path or "the standard library", train_docs, eval_docs, 1.0)]
        key = "data.mixture" if d.mixture else "data.path"
        named = parse_mixture(d.mixture) if d.mixture else [(d.path, 1.0)]
        corpora = []
        for path, weight in named:
            local, manifest = open_manifest(path, tokenizer, self.name, d, key)
            corpora.append((path, *open_corpus(local, manifest, tokenizer.eod_id, self.masked), weight))
        return corpora

    def open(self, cfg: Config, tokenizer: Tokenizer) -> DataSources:
        corpora = self.corpora(cfg, tokenizer)
        train = []
        for where, docs, _, weight in corpora:
            rows = document_rows(docs, cfg) if docs is not None and len(docs) else []
            if len(rows) < cfg.train.global_batch:
                raise ConfigError(
                    f"data.path: {where} holds {len(rows)} rows of model.seq_len={cfg.model.seq_len}, fewer than one "
                    f"global batch of {cfg.train.global_batch}"
                )
            train.append((rows, weight))
        # Eval reads the first corpus's held-out split: one fixed yardstick, whatever the mixture.
        held = corpora[0][2]
        return DataSources(train, document_rows(held, cfg) if held is not None else None, self.fields(cfg))

    def describe(self, sources: DataSources, cfg: Config) -> str:
        rows = sum(len(r) for r, _ in sources.train)
        fill = [r.fill() for r, _ in sources.train if isinstance(r, DocumentRows)]
        held = f", {len(sources.eval)} held-out rows" if sources.eval is not None else ""
        packing = f", packing {cfg.data.packing}" + (f" ({100 * min(fill):.1f}% filled)" if fill else "")
        mixture = f" from {len(sources.train)} corpora" if len(sources.train) > 1 else ""
        tokens = cfg.model.seq_len + 1
        return f"data: {cfg.data.source}{mixture}, {rows} training rows of {tokens} tokens{held}{packing}"
