"""A file that grows line by line (metrics.jsonl): appended in place on a local disk, and on an
object store, which has no append, rewritten whole from memory at most every `flush_s` seconds
and at `flush`. A crash loses at most the lines of the last `flush_s` seconds there; a local file
loses nothing, as before this layer.
"""

from __future__ import annotations

import time

from storage import paths

# How often a growing file on an object store is rewritten by default (metrics.jsonl, TensorBoard's
# events): a crash loses at most these last seconds, and a rewrite is one request however many
# lines came since.
REMOTE_FLUSH_S = 10.0


class AppendLog:
    """Lines appended to `path`: locally with open(path, "a") per line, remotely as one object
    holding what the object held when this log opened plus every line since."""

    def __init__(self, path: str, flush_s: float) -> None:
        self.path, self.flush_s = path, flush_s
        self.remote = paths.is_remote(path)
        self._text = ""  # remote: the object's whole text, flushed or not
        self._dirty = False
        self._flushed_at = time.monotonic()
        if self.remote and paths.exists(path):
            self._text = paths.read_text(path)  # a resumed run keeps the lines of the ones before it
            if self._text and not self._text.endswith("\n"):  # a line cut short: the next one starts anew
                self._text += "\n"

    def append(self, line: str) -> None:
        """Adds one line (`line` without its newline)."""
        if not self.remote:
            with open(self.path, "a") as f:
                f.write(line + "\n")
            return
        self._text += line + "\n"
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Writes what is not yet on the object store (nothing to do locally)."""
        if self.remote and self._dirty:
            paths.write_text(self.path, self._text)
            self._dirty = False
        self._flushed_at = time.monotonic()
