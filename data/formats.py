"""Reading raw corpora for `data.prepare`: which files, which format, and their documents.

Three formats: `text` (one file is one document), `jsonl` (one line is one document, its `field`)
and `parquet` (one row is one document, column `field`). The main process cuts the inputs into
`Task`s in a fixed order (sorted files, in-file order), cheaply and without parsing; a worker
turns a task into `Documents` (texts, their split keys, per-file bad-data counts). So the output
depends only on the inputs, never on how many workers parsed them.

The files may be on a `gs://` or `s3://` bucket (their globs too): they are listed and streamed
through the path layer (storage), never copied whole.

Text and JSONL files may be compressed (`.gz`, `.bz2`, `.xz`: the format is that of the name
without the suffix); a compressed file that does not decompress is an error naming it.

Bad data never stops a run: blank documents, lines that are not JSON objects, a missing or
non-string field are skipped and counted, invalid UTF-8 is replaced and counted.
"""

from __future__ import annotations

import bz2
import contextlib
import dataclasses
import glob
import gzip
import json
import lzma
import os
from typing import Any, BinaryIO, Iterator, NamedTuple

import storage
from configs.schema import ConfigError

FORMATS = ("text", "jsonl", "parquet")
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
# Each wraps an open binary file (GzipFile's first argument is a name, hence the lambda).
COMPRESSED = {".gz": lambda f: gzip.GzipFile(fileobj=f), ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile}
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError)  # gzip.BadGzipFile is an OSError
BAD_LINES_KEPT = 10  # the first few bad line numbers per file, to find them without a full report
TEXT_TASK_BYTES = 1 << 20  # text files batched per task so small files do not cost one round trip each
JSONL_TASK_BYTES = 4 << 20
PARQUET_TASK_ROWS = 4096


@dataclasses.dataclass
class FileStats:
    """Per input file: what became documents and what was skipped or repaired, and why."""

    path: str
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    replaced: int = 0  # documents whose invalid UTF-8 (or lone surrogates) became U+FFFD / '?'
    bad_lines: list[int] = dataclasses.field(default_factory=list)  # 1-based line (jsonl) or row (parquet)
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)

    def skip(self, reason: str, line: int | None = None) -> None:
        self.skipped += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.note(line)

    def note(self, line: int | None) -> None:
        if line is not None and len(self.bad_lines) < BAD_LINES_KEPT:
            self.bad_lines.append(line)

    def merge(self, other: FileStats) -> None:
        """Adds the counts of a later chunk of the same file."""
        self.documents += other.documents
        self.tokens += other.tokens
        self.skipped += other.skipped
        self.replaced += other.replaced
        self.bad_lines = (self.bad_lines + other.bad_lines)[:BAD_LINES_KEPT]
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n

    def to_manifest(self) -> dict:
        return {
            "path": self.path,
            "documents": self.documents,
            "tokens": self.tokens,
            "skipped": self.skipped,
            "replaced": self.replaced,
            "bad_lines": self.bad_lines,
            "skip_reasons": dict(sorted(self.reasons.items())),
        }


@dataclasses.dataclass
class Task:
    """One unit of work for a worker: some text files, a block of jsonl lines or parquet rows."""

    fmt: str
    paths: list[str]  # text: the files; jsonl/parquet: the one file
    first: int = 1  # jsonl/parquet: the 1-based line/row number of the first item
    payload: bytes | list | None = None  # jsonl: raw lines; parquet: the column's values
    size: int = 0  # input bytes this task covers, for progress
    last: bool = True  # whether this is the file's last task (its counts are then final)


@dataclasses.dataclass
class Documents:
    """The documents of one task, in order; keys decide the eval split."""

    texts: list[str]
    keys: list[bytes]
    origins: list[tuple[str, int | None]]  # (file, line/row) of each document
    stats: dict[str, FileStats]

    def add(self, text: str, key: bytes, path: str, line: int | None) -> None:
        self.texts.append(text)
        self.keys.append(key)
        self.origins.append((path, line))
        self.stats[path].documents += 1


class Matched(NamedTuple):
    """The files the --input globs match, as one value."""

    files: list[str]  # every matching file, as sorted absolute paths (or URLs)
    by_pattern: dict[str, list[str]]  # the files of each pattern


def expand_inputs(patterns: list[str]) -> Matched:
    """(all matching files as sorted absolute paths or URLs, the files of each pattern; a
    pattern may be on a `gs://` or `s3://` bucket). Raises ConfigError naming a pattern that matches no file."""
    by_pattern = {}
    for pattern in patterns:
        if storage.is_remote(pattern):  # the bucket's listing; each match a full URL
            files = storage.glob_files(pattern)
        else:
            matches = glob.glob(os.path.expanduser(pattern), recursive=True)
            files = sorted({os.path.abspath(f) for f in matches if os.path.isfile(f)})
        if not files:
            raise ConfigError(f"--input: no file matches {pattern!r}")
        by_pattern[pattern] = files
    return Matched(sorted({f for files in by_pattern.values() for f in files}), by_pattern)


def detect_format(files: list[str], fmt: str | None) -> str:
    """The --format, or the one format the file extensions name (anything else is text)."""
    if fmt is not None:
        return fmt
    found: dict[str, str] = {}
    for path in files:
        found.setdefault(EXTENSIONS.get(extension(path), "text"), path)
    if len(found) > 1:
        examples = ", ".join(f"{os.path.basename(p)} ({f})" for f, p in sorted(found.items()))
        raise ConfigError(f"--format: the inputs mix formats ({examples}); give --format or separate runs")
    return next(iter(found))


def extension(path: str) -> str:
    """The extension that names the format: `.jsonl` for both `a.jsonl` and `a.jsonl.gz`."""
    stem, ext = os.path.splitext(path.lower())
    return os.path.splitext(stem)[1] if ext in COMPRESSED else ext


def open_input(path: str) -> tuple[BinaryIO, BinaryIO]:
    """(the decompressed stream, the raw file under it, whose position counts compressed bytes).
    A file on a bucket is streamed through the path layer, block by block."""
    raw = storage.open_file(path)
    wrap = COMPRESSED.get(os.path.splitext(path.lower())[1])
    return (wrap(raw) if wrap else raw), raw


@contextlib.contextmanager
def decompress_errors(path: str, f: BinaryIO, raw: BinaryIO) -> Iterator[None]:
    """A compressed file that fails to decompress becomes a ConfigError naming it; a plain
    file's own I/O errors pass through as they are."""
    try:
        yield
    except DECOMPRESS_ERRORS as e:
        if f is raw:
            raise
        raise ConfigError(f"{path}: does not decompress ({e})") from None


def read_all(path: str) -> bytes:
    f, raw = open_input(path)
    with raw, f, decompress_errors(path, f, raw):
        return f.read()


def plan_tasks(files: list[str], fmt: str, field: str | None) -> Iterator[Task]:
    """The tasks covering all files, in output order. Reads raw bytes (jsonl) or decodes columns
    (parquet) lazily, so only the tasks in flight are in memory. `field` None: parquet rows whole,
    as dicts (the examples of SFT, DPO and RL, as a jsonl line's object)."""
    if fmt == "text":
        batch: list[str] = []
        size = 0
        for path in files:
            batch.append(path)
            size += storage.size(path)
            if size >= TEXT_TASK_BYTES or len(batch) >= 256:
                yield Task("text", batch, size=size)
                batch, size = [], 0
        if batch:
            yield Task("text", batch, size=size)
    elif fmt == "jsonl":
        for path in files:
            yield from _jsonl_tasks(path)
    else:
        for path in files:
            yield from _parquet_tasks(path, field)


def _jsonl_tasks(path: str) -> Iterator[Task]:
    line = 1
    pending: Task | None = None
    f, raw = open_input(path)
    with raw, f:
        done = 0  # bytes of the file on disk read so far: the progress bar counts those
        while True:
            with decompress_errors(path, f, raw):
                block = f.read(JSONL_TASK_BYTES)
                block += f.readline()  # end on a line boundary
            if not block:
                break
            if pending is not None:
                yield pending
            size, done = raw.tell() - done, raw.tell()
            pending = Task("jsonl", [path], first=line, payload=block, size=size, last=False)
            line += block.count(b"\n")
    if pending is None:  # an empty file still reports itself (0 documents)
        pending = Task("jsonl", [path], payload=b"")
    pending.last = True
    yield pending


def _parquet_tasks(path: str, field: str | None) -> Iterator[Task]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("--format parquet: needs the `pyarrow` package (pip install 'meshlm[data]')") from None
    try:
        pf = pq.ParquetFile(storage.open_file(path) if storage.is_remote(path) else path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{path}: not a readable parquet file ({e})") from None
    if field is not None:
        _check_text_column(path, pf.schema_arrow, field)
    rows_total = max(pf.metadata.num_rows, 1)
    bytes_per_row = storage.size(path) / rows_total
    row = 1
    pending = Task("parquet", [path], payload=[])
    for batch in pf.iter_batches(batch_size=PARQUET_TASK_ROWS, columns=None if field is None else [field]):
        values = batch.to_pylist() if field is None else batch.column(0).to_pylist()
        if pending.payload:
            yield pending
        pending = Task("parquet", [path], first=row, payload=values, size=int(len(values) * bytes_per_row), last=False)
        row += len(values)
    pending.last = True
    yield pending


def _check_text_column(path: str, schema: Any, field: str) -> None:
    """Raises ConfigError unless the parquet `schema` has a string column `field`."""
    import pyarrow as pa

    if field not in schema.names:
        raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}); give --field")
    kind = schema.field(field).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise ConfigError(f"{path}: column {field!r} holds {kind}, not strings; give --field")


@dataclasses.dataclass
class _Skip:
    """Why a line or row is not a document."""

    reason: str


def _decode(raw: bytes, stats: FileStats, line: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.replaced += 1
        stats.note(line)
        return raw.decode("utf-8", errors="replace")


def _clean(text: str, stats: FileStats, line: int | None) -> tuple[str, bytes]:
    """(text, its UTF-8 bytes); JSON may carry lone surrogates that no tokenizer accepts."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        stats.replaced += 1
        stats.note(line)
        data = text.encode("utf-8", errors="replace")
        return data.decode("utf-8"), data


def read_task(task: Task, field: str) -> Documents:
    """The documents of a task, with each file's skip/replace counts."""
    docs = Documents([], [], [], {})
    if task.fmt == "text":
        for path in task.paths:
            stats = docs.stats[path] = FileStats(path)
            raw = read_all(path)
            text = _decode(raw, stats, None)
            if not text.strip():
                stats.skip("empty" if not raw else "blank")
                continue
            docs.add(text, raw, path, None)  # the raw bytes decide the split, as for the `text` source
        return docs
    path = task.paths[0]
    stats = docs.stats[path] = FileStats(path)
    if task.fmt == "jsonl":
        lines = task.payload.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the newline that ends the last line
        items = ((_jsonl_value(raw, stats, task.first + i, field), task.first + i) for i, raw in enumerate(lines))
    else:
        items = (((v if v is not None else _Skip("null")), task.first + i) for i, v in enumerate(task.payload))
    for value, line in items:
        if isinstance(value, _Skip):
            stats.skip(value.reason, line)
            continue
        text, data = _clean(value, stats, line)
        if not text.strip():
            stats.skip("blank", line)
            continue
        docs.add(text, data, path, line)
    return docs


def example_rows(task: Task, stats: FileStats) -> Iterator[tuple[int, bytes, Any]]:
    """(line or row, its bytes, the example) of each line of a jsonl task (its parsed JSON value)
    or row of a parquet task read whole (a dict; its bytes the row as `json.dumps` writes it, so
    the held-out split puts a row where it puts the jsonl line of the same row, columns in the same
    order); blank lines and lines that are not JSON are skipped and counted in `stats`."""
    if task.fmt == "parquet":
        for i, row in enumerate(task.payload):
            yield task.first + i, json.dumps(row, default=str).encode(), row
        return
    lines = task.payload.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines):
        line = task.first + i
        if not raw.strip():
            stats.skip("blank", line)
            continue
        try:
            yield line, raw, json.loads(_decode(raw, stats, line))
        except ValueError:
            stats.skip("not_json", line)


def _jsonl_value(raw: bytes, stats: FileStats, line: int, field: str) -> str | _Skip:
    if not raw.strip():
        return _Skip("blank")
    try:
        obj = json.loads(_decode(raw, stats, line))
    except ValueError:
        return _Skip("not_json")
    if not isinstance(obj, dict) or field not in obj:
        return _Skip("no_field")
    value = obj[field]
    return value if isinstance(value, str) else _Skip("not_string")
