"""Orbax checkpoints on object stores: what Orbax needs from us to save to `gs://` and `s3://`.

- `gs://`: Orbax supports it itself (TensorStore's `gcs` driver, which takes an emulator's
  address from TENSORSTORE_GCS_HTTP_URL) and commits a step with a `commit_success.txt` object
  written last instead of a rename (an object store has none).
- `s3://`: Orbax's directory handling goes through etils.epath (s3fs), but its TensorStore specs
  do not know the scheme: `build_kvstore_tspec` refuses an `s3://` path as "not absolute". And
  TensorStore's bare `s3://` URL form ignores AWS_ENDPOINT_URL and goes to AWS. `enable_object_stores`
  wraps that one function: the spec is built as for `gs://` (the same bucket and key) and each GCS
  driver in it is replaced by the S3 driver with the endpoint and region the standard
  environment names (storage.kvstore_spec). And `manager_options` gives an object-store
  directory Orbax's commit-file protocol, which Orbax picks by itself only for `gs://`.
- Both: TensorStore's retries of a request bounded as the other clients' are (under a minute,
  storage.store_retries), not its default of many minutes: an outage met inside a restore is
  then told as soon as one met by the small files.

A step whose commit object is missing (a save cut short) is not a finalized step: Orbax neither
lists nor restores it, and `cleanup_tmp_directories` removes it at the next start.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils

import storage


def _each_gcs_driver(spec: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`spec` (a kvstore spec Orbax built) with `change` applied to each GCS driver in it, dict or
    `gs://` URL (a URL as the driver dict of its bucket and key)."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc") and "bucket" in spec:
            return change(spec)
        return {k: _each_gcs_driver(v, change) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_each_gcs_driver(v, change) for v in spec]
    if isinstance(spec, str) and spec.startswith("gs://"):
        bucket, key = storage.bucket_and_key(spec)
        return change({"driver": "gcs", "bucket": bucket, "path": key + ("/" if spec.endswith("/") else "")})
    return spec


def _as_s3(gcs: dict[str, Any]) -> dict[str, Any]:
    """A GCS driver of the `gs://` twin of an `s3://` path as the S3 driver of the same bucket and
    key (endpoint, region and retries: storage.kvstore_spec)."""
    s3 = storage.kvstore_spec(f"s3://{gcs['bucket']}")
    rest = {k: v for k, v in gcs.items() if k not in ("driver", "bucket")}
    return {**rest, **{k: v for k, v in s3.items() if k != "path"}}


def _with_retries(gcs: dict[str, Any]) -> dict[str, Any]:
    """A GCS driver given the bounded retries of storage.store_retries."""
    return {"gcs_request_retries": storage.store_retries("gcs"), **gcs} if gcs["driver"] == "gcs" else gcs


def _on_object_stores(build: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build)
    def build_kvstore_tspec(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if text.startswith("s3://"):
            return _each_gcs_driver(build("gs://" + text[len("s3://"):], *args, **kwargs), _as_s3)
        if text.startswith("gs://"):
            return _each_gcs_driver(build(directory, *args, **kwargs), _with_retries)
        return build(directory, *args, **kwargs)

    build_kvstore_tspec.meshlm_stores = True  # type: ignore[attr-defined]  # wrapped once per process
    return build_kvstore_tspec


def enable_object_stores() -> None:
    """Lets Orbax save to and restore from `s3://`, and bounds TensorStore's retries on both
    stores (process-wide, idempotent). Every Orbax caller reaches the spec through the module
    attribute, so replacing it reaches them all."""
    if not getattr(tensorstore_utils.build_kvstore_tspec, "meshlm_stores", False):
        tensorstore_utils.build_kvstore_tspec = _on_object_stores(tensorstore_utils.build_kvstore_tspec)


def manager_options(directory: str) -> dict[str, Any]:
    """The CheckpointManagerOptions keywords a checkpoint directory needs: on an object store,
    Orbax's commit-file protocol (a step is finalized by an object written last, not by renaming
    a temporary directory, which on S3 would be a copy of every object)."""
    if not storage.is_remote(directory):
        return {}
    enable_object_stores()
    return {"atomicity_options": ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)}
