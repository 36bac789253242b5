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


def _as_s3(spec: Any) -> Any:
    """`spec` (a kvstore spec built for the `gs://` twin of an `s3://` path) with each GCS driver,
    dict or URL, turned into the S3 one for the same bucket and key (its retries included)."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc") and "bucket" in spec:
            s3 = storage.kvstore_spec(f"s3://{spec['bucket']}")
            rest = {k: v for k, v in spec.items() if k not in ("driver", "bucket")}
            return {**rest, **{k: v for k, v in s3.items() if k != "path"}}
        return {k: _as_s3(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_as_s3(v) for v in spec]
    if isinstance(spec, str) and spec.startswith("gs://"):
        bucket, key = storage.bucket_and_key(spec)
        return {**storage.kvstore_spec(f"s3://{bucket}"), "path": key + ("/" if spec.endswith("/") else "")}
    return spec


def _with_gcs_retries(spec: Any) -> Any:
    """`spec` with each GCS driver dict given the bounded retries of storage.store_retries."""
    if isinstance(spec, dict):
        if spec.get("driver") == "gcs" and "bucket" in spec:
            return {"gcs_request_retries": storage.store_retries("gcs"), **spec}
        return {k: _with_gcs_retries(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_with_gcs_retries(v) for v in spec]
    return spec


def _on_object_stores(build: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build)
    def build_kvstore_tspec(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if text.startswith("s3://"):
            return _as_s3(build("gs://" + text[len("s3://"):], *args, **kwargs))
        if text.startswith("gs://"):
            return _with_gcs_retries(build(directory, *args, **kwargs))
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
