"""Tokenize raw corpora once into ArrayRecord shards that `data.source=prepared` reads.

    python -m data.prepare --input 'corpus/*.jsonl' --output prepared/corpus --tokenizer tokenizer.json

Documents are read in a fixed order (sorted files, in-file order) and tokenized by a pool of
`--workers` processes whose results are written back in that order, so the output is
byte-identical whatever the worker count and on every rerun. A document goes to the eval split
by a hash of its content (data.sources.held_out), independent of order. Everything is written to
a hidden sibling directory and renamed into place at the end: a crash never leaves a directory
that looks complete. `--input` and `--output` may be on a `gs://` or `s3://` bucket: inputs are
streamed through the path layer, and a bucket output is written locally then uploaded with its
manifest last (data.publish). The contract of the output is in data.manifest.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = ("--output is as it was (a corpus is written aside and swapped in whole), or on a bucket "
        "cut short mid-upload holds no manifest.json and is no corpus; run the same command again")

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import array
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from typing import TYPE_CHECKING, Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

import storage
from configs import ConfigError, guarded, on_interrupt
from configs import check_output as check_destination
from data.chat import ChatTemplate, Skip, template_file
from data.formats import (FORMATS, Documents, FileStats, Matched, Task, detect_format, expand_inputs, example_rows,
                          plan_tasks, read_task)
from data.manifest import FORMAT_VERSION, MANIFEST, SPLITS, corpus_digests, is_prepared_file, lengths_name, shard_name
from data.publish import publish
from data.sources import held_out
from data.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # the formats import Grain and JAX: loaded on first use (_format)
    from data.corpus_format import CorpusFormat

# A tokenizer call takes up to this many documents or characters: enough to amortize the call and
# use the tokenizer's threads, few enough that its per-token bookkeeping stays small.
ENCODE_DOCS, ENCODE_CHARS = 256, 1 << 20


@dataclasses.dataclass
class Chunk:
    """A task's result: its documents' tokens as one flat array, with lengths and split flags."""

    tokens: np.ndarray  # <u4 [sum(lengths)]
    lengths: np.ndarray  # int64 [documents]
    held: np.ndarray  # bool [documents]: goes to the eval split
    stats: dict[str, FileStats]
    task: Task  # without its payload: size and last flag, for progress and per-file checks


# (tokenizer, options, chat template for sft/dpo) of this process
_worker: tuple[Tokenizer, Options, ChatTemplate | None] | None = None


def _format(name: str) -> CorpusFormat:
    """The corpus format `name` (data/corpus_format, loaded on first use: it imports Grain and JAX)."""
    from data import corpus_format

    return corpus_format.get(name)


def _format_names() -> tuple[str, ...]:
    from data import corpus_format

    return tuple(corpus_format.names())


def _init_worker(opts: Options, pooled: bool, client_env: dict[str, str] | None = None) -> None:
    """Loads the tokenizer once per process (a tokenizer does not pickle cheaply, a spec does);
    a pooled worker reaches the object stores with the caller's variables (storage.client_env)."""
    global _worker
    if pooled:  # one thread per worker: the pool is the parallelism, not the tokenizer's own threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if client_env is not None:
        storage.use_client_env(client_env)
    template = _chat_template(opts)
    _worker = (load_tokenizer(opts.tokenizer, "--tokenizer"), opts, template)


def tokenize_task(task: Task) -> Chunk:
    """Reads, tokenizes and splits one task's documents (in a worker, or inline for one worker)."""
    assert _worker is not None, "_init_worker runs first"
    tokenizer, opts, template = _worker
    if template is not None:
        return _tokenize_examples(task, tokenizer, opts, template)
    field, fraction = opts.field, opts.eval_fraction
    docs: Documents = read_task(task, field)
    ids: list[np.ndarray] = []
    start = chars = 0
    for stop, text in enumerate(docs.texts, 1):
        chars += len(text)
        if chars >= ENCODE_CHARS or stop - start == ENCODE_DOCS or stop == len(docs.texts):
            ids += tokenizer.encode_batch(docs.texts[start:stop])
            start, chars = stop, 0
    kept, held = [], []
    for doc, key, (path, line) in zip(ids, docs.keys, docs.origins):
        stats = docs.stats[path]
        if len(doc) == 0:  # text the tokenizer maps to nothing (e.g. only characters it strips)
            stats.documents -= 1
            stats.skip("no_tokens", line)
            continue
        stats.tokens += len(doc)
        kept.append(doc)
        held.append(held_out(key, fraction))
    tokens = np.concatenate(kept).astype("<u4") if kept else np.zeros(0, "<u4")
    meta = dataclasses.replace(task, payload=None)
    return Chunk(tokens, np.array([len(d) for d in kept], np.int64), np.array(held, bool), docs.stats, meta)


def _tokenize_examples(task: Task, tokenizer: Tokenizer, opts: Options, template: ChatTemplate) -> Chunk:
    """A task of examples (SFT, DPO, RL; jsonl lines or parquet rows) -> their records (the corpus
    format's `record`); rows that are no example are counted under their reason."""
    path = task.paths[0]
    stats = FileStats(path)
    kept, held = [], []
    for line, raw, obj in example_rows(task, stats):
        try:
            record = _format(opts.objective).record(obj, template, tokenizer.encode_batch)
        except Skip as why:
            stats.skip(str(why), line)
            continue
        stats.documents += 1
        stats.tokens += len(record)
        kept.append(record)
        held.append(held_out(raw, opts.eval_fraction))
    tokens = np.concatenate(kept).astype("<u4") if kept else np.zeros(0, "<u4")
    lengths = np.array([len(r) for r in kept], np.int64)
    return Chunk(tokens, lengths, np.array(held, bool), {path: stats}, dataclasses.replace(task, payload=None))


def run_tasks(tasks: Iterator[Task], opts: Options, workers: int) -> Iterator[Chunk]:
    """Task results in task order. With several workers, at most 2 per worker are in flight, so
    memory stays bounded however large the corpus (Pool.imap would read every input ahead)."""
    if workers == 1:
        _init_worker(opts, pooled=False)
        yield from map(tokenize_task, tasks)
        return
    # forkserver, not fork: a caller that has loaded JAX (or a tokenizer's thread pool) is
    # multithreaded, and a forked copy of it can deadlock on a lock held by another thread.
    context = multiprocessing.get_context("forkserver")
    with context.Pool(workers, _init_worker, (opts, True, storage.client_env())) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(tokenize_task, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class SplitWriter:
    """Writes one split's records into shards of at most `shard_docs` documents."""

    def __init__(self, directory: str, split: str, shard_docs: int):
        self.directory, self.split, self.shard_docs = directory, split, shard_docs
        self.lengths = array.array("q")  # 8 bytes a document, whatever the corpus size
        self.shards: list[str] = []  # provisional names; the count is known only at the end
        self._writer: ArrayRecordWriter | None = None

    def write(self, doc: np.ndarray) -> None:
        """Appends one document's <u4 token ids as the next record."""
        if len(self.lengths) % self.shard_docs == 0:
            self._open_next()
        self._writer.write(doc.tobytes())
        self.lengths.append(len(doc))

    def _open_next(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.shards.append(f"{self.split}-{len(self.shards):05d}.partial")
        # group_size:1 makes every record its own chunk: random access reads one document only.
        self._writer = ArrayRecordWriter(os.path.join(self.directory, self.shards[-1]), "group_size:1")

    def close(self) -> dict:
        """Gives the shards their final names, writes the lengths; the split's manifest entry."""
        if self._writer is not None:
            self._writer.close()
        names = [shard_name(self.split, i, len(self.shards)) for i in range(len(self.shards))]
        for old, new in zip(self.shards, names):
            os.rename(os.path.join(self.directory, old), os.path.join(self.directory, new))
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if self.lengths else np.zeros(0, np.int64)
        np.save(os.path.join(self.directory, lengths_name(self.split)), lengths)
        return {"documents": len(lengths), "tokens": int(lengths.sum()), "shards": names}


class Progress:
    """A one-line progress report on stderr: redrawn on a terminal, a line a minute otherwise."""

    def __init__(self, total_bytes: int):
        self.total, self.done, self.docs, self.tokens = max(total_bytes, 1), 0, 0, 0
        self.start = self._last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, size: int, docs: int, tokens: int) -> None:
        self.done, self.docs, self.tokens = self.done + size, self.docs + docs, self.tokens + tokens
        now = time.monotonic()
        if now - self._last >= (0.2 if self.tty else 60):
            self._last = now
            self._draw(end="\r" if self.tty else "\n")

    def finish(self) -> None:
        self._draw(end="\n")

    def _draw(self, end: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        share = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * share) + "." * (30 - int(30 * share))
        print(
            f"prepare [{bar}] {100 * share:5.1f}%  {self.docs:,} docs  {self.tokens:,} tokens  "
            f"{self.done / elapsed / 1e6:.1f} MB/s  {elapsed:.0f}s",
            end=end, file=sys.stderr, flush=True,
        )


def check_output(output: str, files: list[str], overwrite: bool) -> None:
    """Refuses a non-empty output directory unless it is a previous output of the same inputs or
    --overwrite is given. Never replaces files that prepare did not write, even with --overwrite.
    On a bucket, a prefix of prepared files without a manifest (an upload cut short) holds no
    corpus and is replaced."""
    check_destination(output, "--output")  # a writable directory, or a bucket that answers
    remote = storage.is_remote(output)
    if not remote and not os.path.exists(output):
        return
    if not remote and not os.path.isdir(output):
        raise ConfigError(f"--output: {output!r} exists and is not a directory")
    names = storage.listdir(output)
    foreign = [n for n in names if not is_prepared_file(n)]
    if foreign:
        raise ConfigError(
            f"--output: {output!r} holds files that data.prepare did not write ({foreign[0]}"
            f"{', ...' if len(foreign) > 1 else ''}); choose a new or empty directory"
        )
    if not names or overwrite or (remote and MANIFEST not in names):
        return
    try:
        previous = [entry["path"] for entry in json.loads(storage.read_text(storage.join(output, MANIFEST)))["inputs"]]
    except (OSError, ValueError, KeyError, TypeError):
        previous = None
    if previous != files:
        raise ConfigError(
            f"--output: {output!r} holds a prepared corpus of other inputs (or a damaged one); "
            "pass --overwrite to replace it"
        )


@dataclasses.dataclass(frozen=True)
class Options:
    """How to prepare (the command-line flags other than --input and --output)."""

    fmt: str | None = None  # None: from the file extensions
    field: str = "text"
    tokenizer: str = "byte"
    workers: int = 1
    eval_fraction: float = 0.0
    shard_docs: int = 100_000
    overwrite: bool = False
    objective: str = "lm"  # the corpus format (data/corpus_format/); sft/dpo/rl: JSONL examples (data.chat)
    chat_template: str | None = None  # None: the tokenizer's own (data.chat.template_file)

    def validate(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"--eval-fraction: must be in [0, 1), got {self.eval_fraction}")
        if self.shard_docs < 1:
            raise ConfigError(f"--shard-docs: must be at least 1, got {self.shard_docs}")
        if self.workers < 1:
            raise ConfigError(f"--workers: must be at least 1, got {self.workers}")
        if self.fmt is not None and self.fmt not in FORMATS:
            raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {self.fmt!r}")
        names = _format_names()
        if self.objective not in names:
            raise ConfigError(f"--objective: expected one of {', '.join(names)}, got {self.objective!r}")
        if _format(self.objective).examples and self.fmt == "text":
            raise ConfigError(f"--objective {self.objective}: reads jsonl or parquet rows, not --format text")


def _chat_template(opts: Options) -> ChatTemplate | None:
    """The chat template a format of JSONL examples renders them with; None for documents."""
    if not _format(opts.objective).examples:
        return None
    return ChatTemplate(template_file(opts.tokenizer, opts.chat_template))


def prepare(inputs: list[str], output: str, progress: bool = True, **options: object) -> dict:
    """Prepares `output` from the files matching the `inputs` globs (keyword options: the fields of
    Options); returns the manifest written. Raises ConfigError (one line, naming the flag or file)."""
    opts = Options(**options)
    opts.validate()
    matched = expand_inputs(inputs)
    files = matched.files
    opts = dataclasses.replace(opts, fmt=detect_format(files, opts.fmt))
    opts.validate()
    tok = load_tokenizer(opts.tokenizer, "--tokenizer")
    template = _chat_template(opts)
    output = storage.absolute(output)
    check_output(output, files, opts.overwrite)
    if storage.is_remote(output):
        return _prepare_to_bucket(matched, output, tok, opts, progress, template)
    parent, base = os.path.split(output)
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent, base, progress)
    tmp = os.path.join(parent, f".{base}.prepare-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        manifest = _write(tmp, matched, tok, opts, progress, template)
        _swap_in(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _prepare_to_bucket(matched: Matched, url: str, tok: Tokenizer, opts: Options, progress: bool,
                       template: ChatTemplate | None) -> dict:
    """Prepares into a local temporary directory (the corpus's size on local disk, for the
    upload's time), then uploads it to `url` with its manifest last (data.publish)."""
    tmp = tempfile.mkdtemp(prefix="meshlm-prepare-")
    with on_interrupt(lambda: shutil.rmtree(tmp, ignore_errors=True)):
        try:
            manifest = _write(tmp, matched, tok, opts, progress, template)
            publish(tmp, url, manifest, progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write(tmp: str, inputs: Matched, tok: Tokenizer, opts: Options, progress: bool,
           template: ChatTemplate | None = None) -> dict:
    files, by_pattern = inputs
    writers = {split: SplitWriter(tmp, split, opts.shard_docs) for split in SPLITS}
    stats = {path: FileStats(path) for path in files}
    bar = Progress(sum(storage.size(f) for f in files)) if progress else None
    tasks = plan_tasks(files, opts.fmt, None if _format(opts.objective).examples else opts.field)
    for chunk in run_tasks(tasks, opts, opts.workers):
        offsets = np.concatenate([[0], np.cumsum(chunk.lengths)])
        for start, stop, held in zip(offsets[:-1], offsets[1:], chunk.held):
            writers["eval" if held else "train"].write(chunk.tokens[start:stop])
        for path, part in chunk.stats.items():
            stats[path].merge(part)
        if chunk.task.last and opts.fmt != "text":
            _check_file(stats[chunk.task.paths[0]], opts)
        if bar:
            bar.update(chunk.task.size, len(chunk.lengths), len(chunk.tokens))
    if bar:
        bar.finish()
    for pattern, matched in by_pattern.items():
        if not any(stats[f].documents for f in matched):
            raise ConfigError(f"--input: {pattern!r} matches {len(matched)} file(s) but yields no document")
    splits = {split: writers[split].close() for split in SPLITS}
    whole, per_split = corpus_digests(tmp, {s: splits[s]["shards"] for s in SPLITS})  # every byte read once
    for split in SPLITS:
        splits[split].update(per_split[split])
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.describe(),
        "format": opts.fmt,
        "field": None if opts.fmt == "text" or _format(opts.objective).examples else opts.field,
        "objective": opts.objective,
        "chat_template": None if template is None else {"path": template.path, "sha256": _sha(template.source)},
        "eval_fraction": opts.eval_fraction,
        "shard_docs": opts.shard_docs,
        "inputs": [stats[f].to_manifest() for f in files],
        "splits": splits,
        "content_hash": whole,
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def _check_file(stats: FileStats, opts: Options) -> None:
    """A jsonl/parquet file with lines or rows but no document is almost surely a wrong --field
    (or, for SFT/DPO rows, a wrong --objective)."""
    if stats.documents == 0 and stats.skipped:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(stats.reasons.items()))
        items = "lines" if opts.fmt == "jsonl" else "rows"
        examples = _format(opts.objective).examples
        check = f"--objective {opts.objective}" if examples else f"--field {opts.field!r} and --format"
        raise ConfigError(f"{stats.path}: no document in {stats.skipped} {items} ({reasons}); check {check}")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _remove_stale(parent: str, base: str, say: bool) -> None:
    """Deletes the staging directories that killed runs for this output left behind (their
    process is gone). A `.old` one is the previous output mid-swap: kept unless the output exists."""
    for name in os.listdir(parent):
        m = re.fullmatch(rf"\.{re.escape(base)}\.prepare-(\d+)(\.old)?", name)
        if not m or _alive(int(m.group(1))) or (m.group(2) and not os.path.isdir(os.path.join(parent, base))):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        if say:
            print(f"removed {os.path.join(parent, name)}, left by a killed run (process {m.group(1)})", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _swap_in(tmp: str, output: str) -> None:
    """Replaces `output` by the finished `tmp` with renames, never a half-written directory."""
    if not os.path.exists(output):
        os.rename(tmp, output)
        return
    old = tmp + ".old"
    os.rename(output, old)
    os.rename(tmp, output)
    shutil.rmtree(old)


def report(manifest: dict, output: str) -> None:
    """The bad-data summary and the splits, on stderr/stdout."""
    bad = [i for i in manifest["inputs"] if i["skipped"] or i["replaced"]]
    for entry in bad[:20]:
        parts = []
        if entry["skipped"]:
            reasons = ", ".join(f"{n} {r}" for r, n in entry["skip_reasons"].items())
            parts.append(f"skipped {entry['skipped']} ({reasons})")
        if entry["replaced"]:
            parts.append(f"replaced invalid UTF-8 in {entry['replaced']}")
        if entry["bad_lines"]:
            parts.append(f"first bad lines/rows {', '.join(map(str, entry['bad_lines']))}")
        print(f"warning: {entry['path']}: {'; '.join(parts)}", file=sys.stderr)
    if len(bad) > 20:
        print(f"warning: ... and {len(bad) - 20} more files with bad data (see {MANIFEST})", file=sys.stderr)
    for split in SPLITS:
        s = manifest["splits"][split]
        print(f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens, {len(s['shards'])} shard(s)")
    print(f"wrote {output} (content_hash {manifest['content_hash'][:16]}...)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", action="append", required=True, help="glob of input files (repeatable)")
    p.add_argument("--output", required=True, help="directory or gs:// s3:// prefix to write (see --overwrite)")
    p.add_argument("--format", choices=FORMATS, help="default: from the file extensions (.jsonl, .parquet, else text)")
    p.add_argument("--field", default="text", help="jsonl key / parquet column holding the text (default: text)")
    p.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json or a SentencePiece .model")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="tokenizing processes")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="share of documents held out, by content hash")
    p.add_argument("--shard-docs", type=int, default=100_000, help="documents per shard at most")
    p.add_argument("--overwrite", action="store_true", help="replace a previous prepared corpus of other inputs")
    p.add_argument("--objective", default="lm", metavar="FORMAT",
                   help="a corpus format of data/corpus_format: lm (default); sft: JSONL messages or prompt/"
                   "completion; dpo: JSONL prompt/chosen/rejected; rl: JSONL prompt/answer")
    p.add_argument("--chat-template", help="a tokenizer_config.json with the chat_template (default: the tokenizer's)")
    args = p.parse_args(argv)
    names = _format_names()  # after parsing: the formats import Grain and JAX, which --help needs not
    if args.objective not in names:  # argparse's own words, as a `choices` refusal
        p.error(f"argument --objective: invalid choice: {args.objective!r} "
                f"(choose from {', '.join(repr(n) for n in names)})")
    try:
        manifest = prepare(
            args.input, args.output, fmt=args.format, field=args.field, tokenizer=args.tokenizer,
            workers=args.workers, eval_fraction=args.eval_fraction, shard_docs=args.shard_docs,
            overwrite=args.overwrite, objective=args.objective, chat_template=args.chat_template,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(manifest, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, KEPT))
