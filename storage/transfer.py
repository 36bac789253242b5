"""Copying a set of files between a local directory and a bucket with one progress line: a
prepared corpus uploaded by `data.prepare --output gs://...`, downloaded into a host's cache by a
run that trains from it.

The line goes to stderr: redrawn in place on a terminal, otherwise (a log file, a cluster's
captured output) printed every 30 s and once at the end, so a long transfer shows it is moving
without filling the log.
"""

from __future__ import annotations

import sys
import time

from storage.paths import copy_file, size

LOG_EVERY_S = 30.0


def copy_files(pairs: list[tuple[str, str]], what: str, progress: bool = True) -> int:
    """Copies each (source, destination) in order, local or URL either side (storage.copy_file:
    streamed, an upload is one object seen whole or not at all); the bytes copied. `what` starts
    the progress line ("download s3://b/corpus")."""
    sizes = [size(src) for src, _ in pairs]
    total = sum(sizes)
    done, start, last = 0, time.monotonic(), time.monotonic()
    tty = sys.stderr.isatty()
    for i, ((src, dst), nbytes) in enumerate(zip(pairs, sizes), 1):
        copy_file(src, dst)
        done += nbytes
        now = time.monotonic()
        if progress and (i == len(pairs) or now - last >= (0.2 if tty else LOG_EVERY_S)):
            last = now
            rate = done / max(now - start, 1e-9) / 1e6
            end = "\n" if i == len(pairs) or not tty else "\r"
            print(f"{what}: {i}/{len(pairs)} files, {done / 1e6:,.1f} of {total / 1e6:,.1f} MB, {rate:.1f} MB/s, "
                  f"{now - start:.0f}s", end=end, file=sys.stderr, flush=True)
    return done

