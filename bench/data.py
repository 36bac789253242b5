"""How fast the input pipeline makes batches, so a GPU step never waits for data.

Prepares a corpus from the running Python's standard library (byte tokenizer) once, then for
each variant times the packing plan and then pulls batches through the real Grain iterator
(`data.make_iterator`) and prints batches/s and tokens/s next to what a GPU step would need.

    python -m bench.data                       # global batch 8 x 4096 tokens, the 1B bench shape
    python -m bench.data --batch 16 --seq 1024 --batches 200

No device work: this is host-side throughput only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from configs import load_config
from data import make_iterator, open_source
from data.packing import pack_plan
from data.prepare import main as prepare
from data.sources import stdlib_files

VARIANTS = [
    ("concat", "data.packing=concat data.read_threads=1"),
    ("concat", "data.packing=concat data.read_threads=4"),
    ("document", "data.packing=document data.read_threads=1"),
    ("document", "data.packing=document data.read_threads=4"),
    ("document", "data.packing=document data.read_threads=2 data.workers=2"),
]


def measure(corpus: str, batch: int, seq: int, batches: int, overrides: str) -> tuple[float, float, float]:
    """(seconds to open the source and plan the packing, batches/s, fill) for one variant."""
    cfg = load_config(None, [
        "data.source=prepared", f"data.path={corpus}", f"model.seq_len={seq}", f"train.global_batch={batch}",
        *overrides.split(),
    ])
    t0 = time.perf_counter()
    sources = open_source(cfg, "lm")  # a plain-text corpus
    plan_s = time.perf_counter() - t0
    rows = sources.train[0][0]
    fill = rows.fill() if hasattr(rows, "fill") else 1.0
    it = make_iterator(cfg, sources)
    next(it)  # start the threads and workers
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return plan_s, batches / (time.perf_counter() - t0), fill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--corpus", help="a prepared directory (default: prepare the standard library)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus
        if corpus is None:
            corpus = os.path.join(tmp, "stdlib")
            # One --input per file: the standard library without site-packages (or empty files).
            inputs = [arg for path in stdlib_files() if os.path.getsize(path) for arg in ("--input", path)]
            t0 = time.perf_counter()
            if prepare([*inputs, "--output", corpus, "--workers", "2"]) != 0:
                raise SystemExit("preparing the corpus failed")
            print(f"prepared the standard library in {time.perf_counter() - t0:.1f} s")
        print(f"global batch {args.batch} x {args.seq + 1} tokens, {args.batches} batches, {os.cpu_count()} cores")
        print(f"{'packing':<9} {'variant':<52} {'open+plan s':>11} {'fill':>6} {'batches/s':>10} {'Mtok/s':>8}")
        for packing, overrides in VARIANTS:
            plan_s, rate, fill = measure(corpus, args.batch, args.seq, args.batches, overrides)
            mtok = rate * args.batch * args.seq / 1e6
            print(f"{packing:<9} {overrides:<52} {plan_s:>11.2f} {fill:>6.3f} {rate:>10.1f} {mtok:>8.2f}")
    # The packing plan at a larger scale than the standard library: random document lengths.
    lengths = np.random.default_rng(0).integers(1, 3000, 100_000)
    t0 = time.perf_counter()
    pieces, row_starts = pack_plan(lengths, args.seq // 2 + 1, seed=0)
    fill = pieces[:, 2].sum() / ((len(row_starts) - 1) * (args.seq // 2 + 1))
    print(f"pack_plan: 100,000 documents of 1-2,999 tokens into rows of {args.seq // 2 + 1}: "
          f"{time.perf_counter() - t0:.2f} s, {100 * fill:.1f}% filled")


if __name__ == "__main__":
    main()
