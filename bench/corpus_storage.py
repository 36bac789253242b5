"""A prepared corpus on local disk and on the two object-store servers: preparing it, and a run's
first and later opens of it through a host's cache.

    python -m bench.corpus_storage [--mb 50] [--only local,s3,gs]

Four JSONL files of random characters (about `--mb` MB, so that the shards' compression leaves
them near that size) are written locally and, for a bucket target, uploaded to moto's S3 server
or fake-gcs-server, each started here on 127.0.0.1 (bench/object_servers.py). Per target, printed:
`python -m data.prepare`'s time from those files into that target (byte tokenizer, one worker; on
a bucket the inputs are streamed and the output uploaded with its manifest last), the corpus's
size, and the time `data.prepared.open_manifest` takes to open it as a run does: the first time
(on a bucket: the download into a fresh `data.cache_dir` and its check against every shard's
sha256), again (a cache hit: the manifest and the sizes), and again with `data.verify` (every
shard's sha256 read back).

The servers run on this host over loopback: the figures bound what the code and the clients
sustain, not a cloud store's throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Iterator

import numpy as np

import storage
from bench.object_servers import TARGETS, bench_bucket, parse_targets
from configs.schema import DataConfig
from data.prepare import prepare
from data.prepared import open_manifest
from data.tokenizer import ByteTokenizer

FILES, DOC_CHARS = 4, 2000
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?"))


@dataclasses.dataclass
class Row:
    target: str
    mb: float
    prepare_s: float
    first_s: float
    hit_s: float
    verify_s: float


def write_inputs(folder: str, mb: float) -> list[str]:
    """FILES JSONL files of random documents, about `mb` MB in all; their paths."""
    rng = np.random.default_rng(0)
    docs = max(1, int(mb * 1e6 / FILES / (DOC_CHARS + 12)))
    paths = []
    for i in range(FILES):
        paths.append(os.path.join(folder, f"{i}.jsonl"))
        with open(paths[-1], "w") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": "".join(rng.choice(LETTERS, DOC_CHARS))}) + "\n")
    return paths


@contextlib.contextmanager
def _target(target: str, local: str) -> Iterator[str]:
    """Starts `target`'s server (none for local), yields the folder or bucket prefix to work in."""
    if target == "local":
        yield local
        return
    with bench_bucket(target) as root:
        yield root


def measure(target: str, root: str, inputs: list[str], cache: str) -> Row:
    """Prepares the inputs (copied under `root` first) into `root`/corpus and opens it three times."""
    pattern = storage.join(root, "in", "*.jsonl")
    if storage.is_remote(root):
        for path in inputs:
            storage.copy_file(path, storage.join(root, "in", os.path.basename(path)))
    corpus = storage.join(root, "corpus")
    start = time.perf_counter()
    prepare([pattern], corpus, progress=False)
    prepared = time.perf_counter() - start
    opens = []
    for verify in (False, False, True):
        start = time.perf_counter()
        directory, manifest = open_manifest(corpus, ByteTokenizer(), "lm", DataConfig(cache_dir=cache, verify=verify))
        opens.append(time.perf_counter() - start)
    mb = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)) / 1e6
    return Row(target, mb, prepared, *opens)


def table(rows: list[Row]) -> str:
    lines = ["| target | corpus MB | prepare s | first open s | first open MB/s | cache hit s | hit + verify s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rate = f"{r.mb / r.first_s:.0f}" if r.target != "local" else "-"  # nothing is copied from local disk
        lines.append(f"| {r.target} | {r.mb:.1f} | {r.prepare_s:.1f} | {r.first_s:.2f} | {rate} | {r.hit_s:.3f} | "
                     f"{r.verify_s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus_storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="the raw JSONL's size, in MB")
    parser.add_argument("--only", default=",".join(TARGETS), help="targets, comma-separated: local, s3, gs")
    args = parser.parse_args(argv)
    targets = parse_targets(parser, args.only)
    tmp = tempfile.mkdtemp(prefix="meshlm-bench-corpus-")
    try:
        os.makedirs(os.path.join(tmp, "local", "in"))
        inputs = write_inputs(os.path.join(tmp, "local", "in"), args.mb)
        rows = []
        for target in targets:
            with _target(target, os.path.join(tmp, "local")) as root:
                rows.append(measure(target, root, inputs, os.path.join(tmp, f"cache-{target}")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out(table(rows))
    return rows


if __name__ == "__main__":
    main()
