"""A prepared corpus on a bucket (`data.path=gs://...` or `s3://...`, a `data.mixture` component),
read through this host's local copy.

Grain's ArrayRecord reader opens local files only, so each host downloads the corpus once into
`data.cache_dir` (default `$XDG_CACHE_HOME/meshlm/corpora`, else `~/.cache/meshlm/corpora`), in a
folder named by the manifest's content hash: a corpus prepared again (other bytes) gets a new
folder, the same corpus named by another URL shares one. The download goes into a `.partial-PID`
sibling, is checked against the manifest (every shard's size and sha256, and the content hash
over all the files) and renamed into place with the manifest written last, so a folder with a
manifest is a whole, verified copy; `downloaded_from.txt` beside it names the URL, so that a shard
found damaged mid-run says to delete the copy rather than to prepare the corpus again. A later run reuses it after the cheap checks of any prepared
corpus (every file there, every shard's size, the lengths files; with `data.verify` every shard's
sha256 too) and downloads it again if they fail. The processes of one host take turns through a
lock file beside the folder: one downloads, the others wait and read its copy. The cache should be
on a host's own disk; nothing is ever deleted from it (remove old folders by hand).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import sys
from typing import Iterator

import storage
from configs.schema import ConfigError
from configs.writable import check_output, check_writable
from data.manifest import MANIFEST, SPLITS, corpus_digests, differing_shard, read_manifest, verify_shards
from data.publish import corpus_files
from data.shards import SOURCE


def default_cache_dir() -> str:
    """Where corpora on buckets are copied when data.cache_dir is empty."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshlm", "corpora")


def local_corpus(url: str, raw: bytes, cache_dir: str, verify: bool) -> str:
    """The local directory holding a verified copy of the prepared corpus at the bucket prefix
    `url`, whose manifest's bytes (`remote_manifest`) are `raw`: this host's cached copy,
    downloaded first when there is none or it is damaged. Raises ConfigError (one line) for an
    unwritable cache or a download that differs from its manifest."""
    manifest = json.loads(raw)
    root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    check_writable(root, "data.cache_dir")
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, manifest["content_hash"])
    with _host_lock(target, url):
        damage = _damage(target, raw, verify)
        if damage is None:
            print(f"data: {url} read from this host's copy {target}", file=sys.stderr)
            return target
        if damage != "absent":
            print(f"data: this host's copy {target} of {url} is damaged ({damage}); downloading it again", file=sys.stderr)
        _download(url, target, raw, manifest)
    print(f"data: {url} downloaded to {target}", file=sys.stderr)
    return target


def remote_manifest(url: str, key: str) -> tuple[bytes, dict]:
    """(the manifest's bytes, its value) of the prepared corpus at the bucket prefix `url`, read
    before any download so that a corpus made for another tokenizer or objective costs none.
    Raises ConfigError naming `key` for a missing, denied or unreachable bucket (one listing
    request, no retries: storage.check_bucket) or a prefix that holds no corpus."""
    check_output(url, key)
    try:
        raw = storage.read_bytes(storage.join(url, MANIFEST))
    except FileNotFoundError:
        raise ConfigError(f"{key}: {url!r} is not a prepared corpus (no {MANIFEST}); run python -m data.prepare "
                          f"--output {url}") from None
    try:
        manifest = json.loads(raw)
        splits = {split: manifest["splits"][split]["shards"] for split in SPLITS}
        assert isinstance(manifest["content_hash"], str) and all(isinstance(s, list) for s in splits.values())
        assert isinstance(manifest["tokenizer"]["fingerprint"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"{storage.join(url, MANIFEST)}: unreadable manifest, or one without its tokenizer, "
                          "splits' shards and content_hash; prepare it again") from None
    return raw, manifest


@contextlib.contextmanager
def _host_lock(target: str, url: str) -> Iterator[None]:
    """This host's processes one at a time for `target` (an advisory lock on `target.lock`)."""
    with open(target + ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"data: waiting for another process of this host to copy {url} to {target}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _damage(target: str, raw: bytes, verify: bool) -> str | None:
    """None when `target` is a whole copy of the corpus whose manifest is `raw`; else why not
    ("absent" for no copy at all)."""
    manifest_path = os.path.join(target, MANIFEST)
    if not os.path.isfile(manifest_path):
        return "absent" if not os.path.exists(target) else f"no {MANIFEST}"
    with open(manifest_path, "rb") as f:
        if f.read() != raw:
            return f"its {MANIFEST} differs from the bucket's"
    try:
        manifest = read_manifest(target)
        if verify:
            verify_shards(target, manifest)
    except ConfigError as e:
        return str(e).split(";")[0]
    return None


def _download(url: str, target: str, raw: bytes, manifest: dict) -> None:
    """The corpus at `url` copied into `target`, checked against `manifest`, the manifest last."""
    for stale in glob.glob(glob.escape(target) + ".partial-*"):  # left by a killed download (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    partial = f"{target}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        names = corpus_files(manifest)
        storage.copy_files([(storage.join(url, n), os.path.join(partial, n)) for n in names], f"download {url}")
        _check_download(url, partial, manifest)
        with open(os.path.join(partial, SOURCE), "w") as f:  # what a damaged shard's error names (data.shards)
            f.write(url + "\n")
        with open(os.path.join(partial, MANIFEST), "wb") as f:
            f.write(raw)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _check_download(url: str, partial: str, manifest: dict) -> None:
    """Every shard's size and sha256 (where the manifest has them) and the content hash over all
    files, as downloaded. Raises ConfigError naming the shard or the corpus."""
    splits = manifest["splits"]
    whole, per_split = corpus_digests(partial, {s: splits[s]["shards"] for s in SPLITS})
    if bad := differing_shard(manifest, per_split, ("shard_bytes", "shard_sha256")):
        name, field = bad
        raise ConfigError(f"{storage.join(url, name)}: its {'size' if field == 'shard_bytes' else 'sha256'} as "
                          "downloaded differs from the manifest's: the shard is damaged, or the corpus is being "
                          "replaced; prepare it again (python -m data.prepare)")
    if whole != manifest["content_hash"]:
        raise ConfigError(f"{url}: its files as downloaded differ from the manifest's content hash: the corpus is "
                          "damaged, or being replaced; prepare it again (python -m data.prepare)")
