"""Whether an output path can be written, asked before any work starts: every command checks the
directories and files it will write (run.dir, checkpoint.local_dir, run.compile_cache, exports,
prepared corpora, plan files) so that an unwritable one is one line naming its key or flag,
exit 2, with nothing created.

`os.access` is not enough: it says yes to root everywhere, /proc and read-only mounts included.
So the check makes (and at once removes) a probe directory in the nearest existing ancestor of
the path: what the command would do first. Object-store URLs (`gs://`, `s3://`) are left to the
storage layer's own check (`storage.check_bucket`: the bucket exists and answers), which
`check_output` adds for a command whose output may be either.
"""

from __future__ import annotations

import os
import tempfile

import storage
from configs.schema import ConfigError


def _nearest(path: str) -> str:
    """The nearest existing ancestor of `path` (itself if it exists)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable(path: str, what: str, *, file: bool = False) -> None:
    """`path` can be written: a directory to create or fill (`file`: a file to create or replace).
    Raises ConfigError `what=path: why`, naming the ancestor that refuses; leaves nothing behind."""
    if not path or "://" in path:
        return
    target = os.path.abspath(path)
    if os.path.isdir(target) and file:
        raise ConfigError(f"{what}={path}: is a directory, not a file")
    if os.path.exists(target) and not os.path.isdir(target) and not file:
        raise ConfigError(f"{what}={path}: exists and is not a directory")
    where = _nearest(os.path.dirname(target) if file else target)
    if not os.path.isdir(where):
        raise ConfigError(f"{what}={path}: {where} is not a writable directory")
    if file and os.path.exists(target) and not os.access(target, os.W_OK):
        raise ConfigError(f"{what}={path}: the file is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshlm-probe-", dir=where))
    except OSError as e:
        raise ConfigError(f"{what}={path}: {where} is not a writable directory (making a folder there: "
                          f"{e.strerror})") from None


def check_output(path: str, what: str, *, file: bool = False) -> None:
    """`check_writable` for a local path; for a bucket URL, that its bucket exists and answers
    (one listing request; nothing written). ConfigError `what=path: why` either way."""
    if not storage.is_remote(path):
        check_writable(path, what, file=file)
        return
    try:
        storage.check_bucket(path)
    except storage.StorageError as e:
        raise ConfigError(f"{what}={e}") from None
