"""One path layer for a run's files: local paths and `gs://` / `s3://` URLs behind the same few
functions (join, exists, list, read, write, copy, remove, rename), and a local copy of a file for
the libraries that open local files only (`local_copy`).

A local path goes through `os` and `open` exactly as the callers did before this layer existed,
so a local run writes the same files the same way. A URL goes through fsspec (gcsfs, s3fs: the
`storage` extra), whose clients take their credentials and endpoints from the standard
environment: application default credentials or `GOOGLE_APPLICATION_CREDENTIALS` and
`STORAGE_EMULATOR_HOST` for GCS; `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` and
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for S3 and S3-compatible stores.

Object stores have no directories: `makedirs` does nothing there, a "directory" exists when an
object lies under its prefix, and `rename` is a copy then a delete (not atomic: callers use it
only to move things aside, never to commit).
"""

from __future__ import annotations

import atexit
import functools
import glob
import logging
import os
import shutil
import tempfile
import urllib.parse
from typing import Any, BinaryIO

REMOTE_SCHEMES = ("gs", "s3")


class StorageError(OSError):
    """A bucket that is missing, denied or unreachable: one line that names the path."""


def scheme(path: str | os.PathLike) -> str:
    """"gs", "s3", or "" for a local path."""
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    return head if sep and head in REMOTE_SCHEMES else ""


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is a `gs://` or `s3://` URL."""
    return scheme(path) != ""


def bucket_and_key(url: str) -> tuple[str, str]:
    """("bucket", "key/inside") of a `gs://` or `s3://` URL, without a trailing slash."""
    parsed = urllib.parse.urlparse(url)
    return parsed.netloc, parsed.path.strip("/")


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base`/`parts`: os.path.join for a local path; "/"-joined keys for a URL."""
    base = os.fspath(base)
    if not is_remote(base):
        return os.path.join(base, *parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])


def absolute(path: str | os.PathLike) -> str:
    """An absolute local path (os.path.abspath), or the URL itself less any trailing slash."""
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def parent(path: str | os.PathLike) -> str:
    """The directory holding `path` (os.path.dirname; a URL's prefix one level up)."""
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.dirname(path)
    return path.rstrip("/").rsplit("/", 1)[0]


def basename(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def s3_endpoint() -> str | None:
    """The S3 endpoint the standard environment names (an S3-compatible store, an emulator), or
    None for AWS itself. AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL, as in the AWS SDKs."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


# Attempts of each S3 request by the small-file clients (botocore's standard mode: exponential
# backoff with jitter, at most 20 s between attempts), unless AWS_RETRY_MODE/AWS_MAX_ATTEMPTS say.
S3_ATTEMPTS = 8


@functools.lru_cache(maxsize=None)
def _filesystem(kind: str, endpoint: str | None) -> Any:
    # Imported here: a local run never needs gcsfs or s3fs (the optional `storage` extra).
    import fsspec

    # No listings cache: another process (a run, Orbax's saver) writes the same prefixes, and a
    # cached listing would answer for objects since created or deleted. A new instance per
    # endpoint (this function's cache), not fsspec's, which is keyed by arguments alone: gcsfs
    # reads STORAGE_EMULATOR_HOST when an instance is made.
    if kind == "s3":
        # Passed explicitly, not left to botocore: older botocore releases ignore AWS_ENDPOINT_URL.
        where = {"endpoint_url": endpoint} if endpoint else {}
        if not {"AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"} & set(os.environ):
            # botocore's default (legacy mode, 5 attempts) gives up on a refused connection within
            # a few seconds; a store restarting (or a brief network loss) is waited out for about a
            # minute, as gcsfs's and TensorStore's own retries do. The standard variables win.
            where["config_kwargs"] = {"retries": {"mode": "standard", "max_attempts": S3_ATTEMPTS}}
        return fsspec.filesystem("s3", use_listings_cache=False, skip_instance_cache=True, **where)
    # gcsfs logs the error its retries ended on, traceback and all, then raises it: the caller
    # reports it (a run's outage is one line, ops.faults.StoreDown), so the record only repeats it.
    logging.getLogger("gcsfs").addFilter(lambda record: "out of retries" not in record.getMessage())
    return fsspec.filesystem("gcs", use_listings_cache=False, skip_instance_cache=True)


def filesystem(url: str) -> Any:
    """The fsspec filesystem serving `url` (one per scheme and endpoint, kept for the process).
    Raises StorageError naming the package when the `storage` extra is not installed."""
    kind = scheme(url)
    try:
        return _filesystem(kind, s3_endpoint() if kind == "s3" else os.environ.get("STORAGE_EMULATOR_HOST"))
    except ImportError as e:
        raise StorageError(f"{url}: {kind}:// paths need the storage extra ({e}): pip install 'meshlm[storage]'") from None


def exists(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return filesystem(path).exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str | os.PathLike) -> bool:
    """A local directory, or a URL prefix with at least one object under it."""
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.isdir(path)
    return filesystem(path).isdir(path)


def listdir(path: str | os.PathLike) -> list[str]:
    """The names directly under `path` (os.listdir; a URL's next key segments), [] if none."""
    path = os.fspath(path)
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs = filesystem(path)
    try:
        return sorted({basename(p) for p in fs.ls(path, detail=False) if p.rstrip("/") != path.split("://", 1)[1].rstrip("/")})
    except FileNotFoundError:
        return []


def glob_files(pattern: str) -> list[str]:
    """The files matching `pattern` (`**` spans directories), sorted: Python's glob for a local
    pattern (`~` expanded), the store's listing for a URL, each match a full URL."""
    if not is_remote(pattern):
        return sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    fs = filesystem(pattern)
    prefix = scheme(pattern) + "://"
    found = fs.glob(pattern, detail=True)
    return sorted(prefix + key for key, info in found.items() if info.get("type") == "file")


def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole file; FileNotFoundError when there is none."""
    path = os.fspath(path)
    if is_remote(path):
        return filesystem(path).cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if is_remote(path):
        return read_bytes(path).decode()
    with open(path) as f:
        return f.read()


def open_file(path: str | os.PathLike) -> BinaryIO:
    """A binary file open for reading: open() for a local path; for a URL fsspec's file, which
    fetches blocks as they are read (a corpus streams, it is not read whole)."""
    path = os.fspath(path)
    return filesystem(path).open(path, "rb") if is_remote(path) else open(path, "rb")


def size(path: str | os.PathLike) -> int:
    """The file's size in bytes; FileNotFoundError when there is none."""
    path = os.fspath(path)
    return int(filesystem(path).size(path)) if is_remote(path) else os.path.getsize(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes the whole file. An object is replaced in one request, so a reader sees the old
    object or the new one, never half of it."""
    path = os.fspath(path)
    if is_remote(path):
        filesystem(path).pipe_file(path, data)
        return
    with open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, atomic: bool = False) -> None:
    """Writes the whole file. `atomic` on a local path: through a temporary file renamed over it,
    so a reader never sees half a file (an object store's single write already is)."""
    path = os.fspath(path)
    if is_remote(path):
        write_bytes(path, text.encode())
        return
    target = path + ".tmp" if atomic else path
    with open(target, "w") as f:
        f.write(text)
    if atomic:
        os.replace(target, path)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies one file between any two places, local or URL, streamed (a model's weights need not
    fit in memory). An upload is one object, seen whole or not at all."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not is_remote(src) and not is_remote(dst):
        shutil.copyfile(src, dst)
    elif not is_remote(src):
        filesystem(dst).put_file(src, dst)
    elif not is_remote(dst):
        filesystem(src).get_file(src, dst)
    else:  # between buckets or stores: through this host, one chunk at a time
        with filesystem(src).open(src, "rb") as fin, filesystem(dst).open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 24)


# The standard variables the object-store clients read: credentials, regions, endpoints.
CLIENT_ENV = ("AWS_", "GOOGLE_", "STORAGE_EMULATOR_HOST", "TENSORSTORE_")


def client_env() -> dict[str, str]:
    """This process's object-store client variables, for a worker process that may not have
    inherited them: a forkserver started before they were set forks workers with its own."""
    return {k: v for k, v in os.environ.items() if k.startswith(CLIENT_ENV)}


def use_client_env(env: dict[str, str]) -> None:
    """Makes this process's object-store client variables exactly `env` (client_env's), and
    forgets the clients made with the old ones."""
    for key in [k for k in os.environ if k.startswith(CLIENT_ENV) and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    _filesystem.cache_clear()


@functools.lru_cache(maxsize=None)
def _copies() -> str:
    """This process's folder of local copies, removed when it exits."""
    folder = tempfile.mkdtemp(prefix="meshlm-copies-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


@functools.lru_cache(maxsize=None)
def local_copy(url: str) -> str:
    """A local path holding the file at `url`, downloaded once per process, for a library that
    reads local files only (safetensors maps one; tokenizers, sentencepiece open one). Files of
    one prefix land in one local folder, so a library looking beside a file (a
    tokenizer_config.json) finds what was copied there too. A local path is returned as is."""
    if not is_remote(url):
        return url
    bucket, key = bucket_and_key(url)
    local = os.path.join(_copies(), scheme(url), bucket, *key.split("/"))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    copy_file(url, local)
    return local


def makedirs(path: str | os.PathLike) -> None:
    """os.makedirs(exist_ok=True) for a local path; nothing for a URL (no directories there)."""
    path = os.fspath(path)
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str | os.PathLike) -> None:
    """Deletes one file or object; FileNotFoundError when there is none."""
    path = os.fspath(path)
    if is_remote(path):
        filesystem(path).rm_file(path)
    else:
        os.unlink(path)


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Moves a file or a whole directory. On an object store a copy of every object then their
    deletion: not atomic, so used only to move things aside."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not is_remote(src):
        os.replace(src, dst)
        return
    fs = filesystem(src)
    # Object by object: fsspec's recursive `mv` of a prefix differs between gcsfs and s3fs.
    keys = [src] if fs.isfile(src) else fs.find(src)
    if not keys:
        raise FileNotFoundError(src)
    head = src.split("://", 1)[1].rstrip("/")
    for key in keys:
        fs.copy(key, dst.rstrip("/") + key[len(head):])
    fs.rm(keys)


def store_retries(kind: str) -> dict[str, Any]:
    """TensorStore's retries of one request to a `kind` ("gcs" or "s3") store, bounded as the
    small-file clients' are (under a minute; for S3 AWS_MAX_ATTEMPTS, when set, counts the
    attempts). TensorStore's own default, 32 retries up to 32 s apart, kept a run whose store
    went down inside a restore waiting many minutes before it could say so."""
    attempts = S3_ATTEMPTS
    if kind == "s3" and os.environ.get("AWS_MAX_ATTEMPTS", "").isdigit():
        attempts = max(int(os.environ["AWS_MAX_ATTEMPTS"]), 1)
    return {"max_retries": attempts - 1, "initial_delay": "1s", "max_delay": "8s"}


def kvstore_spec(url: str) -> dict[str, Any]:
    """The TensorStore kvstore spec of a `gs://` or `s3://` URL, endpoint and retries included.
    TensorStore's GCS driver reads its endpoint override from the environment itself
    (TENSORSTORE_GCS_HTTP_URL); its S3 driver does not read AWS_ENDPOINT_URL (its bare `s3://`
    URL form goes to AWS whatever the environment says), so the endpoint and region are put into
    the spec here."""
    bucket, key = bucket_and_key(url)
    driver = "gcs" if scheme(url) == "gs" else "s3"
    spec: dict[str, Any] = {"driver": driver, "bucket": bucket, "path": key,
                            f"{driver}_request_retries": store_retries(driver)}
    if spec["driver"] == "s3":
        if (endpoint := s3_endpoint()) is not None:
            spec["endpoint"] = endpoint
        if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            # Keys in the environment: taken from there alone. The default chain would first parse
            # ~/.aws/config, and the AWS C library logs each missing file on stderr.
            spec["aws_credentials"] = {"type": "environment"}
    return spec


def check_bucket(url: str) -> None:
    """Raises StorageError, one line naming `url`, when its bucket is missing, denied or its
    endpoint unreachable: before a run compiles anything. Nothing is written. One listing request
    of at most one key under the prefix (what a run needs the right to do anyway), without the
    clients' retries: a refused connection is reported at once, not after a minute of backoff."""
    bucket, key = bucket_and_key(url)
    kind = scheme(url)
    endpoint = s3_endpoint() if kind == "s3" else os.environ.get("STORAGE_EMULATOR_HOST")
    at = f" at {endpoint}" if endpoint else ""
    try:
        status = _list_one_s3(bucket, key, endpoint) if kind == "s3" else _list_one_gcs(bucket, key, endpoint)
    except ImportError as e:
        raise StorageError(f"{url}: {kind}:// paths need the storage extra ({e}): pip install 'meshlm[storage]'") from None
    except Exception as e:  # connection refused, DNS, timeouts, no credentials: the clients raise many kinds
        # google.auth's DefaultCredentialsError, botocore's NoCredentialsError: nothing to sign with.
        what = "no credentials for" if "Credentials" in type(e).__name__ else "cannot reach"
        raise StorageError(f"{url}: {what} bucket {bucket}{at} ({type(e).__name__}: {_first_line(e)})") from None
    if status == 404:
        raise StorageError(f"{url}: bucket {bucket} does not exist{at}")
    if status in (401, 403):
        raise StorageError(f"{url}: access to bucket {bucket}{at} is denied (HTTP {status})")
    if status >= 400:
        raise StorageError(f"{url}: bucket {bucket}{at} answered HTTP {status}")


def _list_one_s3(bucket: str, key: str, endpoint: str | None) -> int:
    """The HTTP status of listing one key of `bucket` under `key`, through botocore (s3fs's own
    client library), one attempt."""
    import botocore.config
    import botocore.exceptions
    import botocore.session

    config = botocore.config.Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 1})
    client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, config=config)
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except botocore.exceptions.ClientError as e:
        return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 400))
    return 200


def _list_one_gcs(bucket: str, key: str, endpoint: str | None) -> int:
    """The HTTP status of listing one object of `bucket` under `key` with GCS's JSON API: at an
    emulator (STORAGE_EMULATOR_HOST) without credentials, else with the application default
    credentials, as gcsfs and TensorStore use them."""
    import requests

    params = {"maxResults": "1", "prefix": key}
    if endpoint:
        return requests.get(f"{endpoint.rstrip('/')}/storage/v1/b/{bucket}/o", params=params, timeout=(5, 20)).status_code
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
    session = google.auth.transport.requests.AuthorizedSession(credentials)
    return session.get(f"https://storage.googleapis.com/storage/v1/b/{bucket}/o", params=params, timeout=(5, 20)).status_code


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0]
    return text[:200] or type(error).__name__
