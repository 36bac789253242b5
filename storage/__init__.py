"""Storage: where a run's files live, a local directory or a `gs://` / `s3://` bucket prefix
(docs/storage.md). The bottom of the import graph: it imports no other package of the project."""

from storage.paths import (StorageError, absolute, basename, bucket_and_key, check_bucket, client_env, copy_file, exists, filesystem, glob_files,
                           is_remote, isdir, join, kvstore_spec, listdir, local_copy, makedirs, open_file, parent, read_bytes, read_text,
                           remove, rename, s3_endpoint, scheme, size, store_retries, use_client_env, write_bytes, write_text)
from storage.appendlog import REMOTE_FLUSH_S, AppendLog
from storage.outage import LeftRunning, left_running, unreachable
from storage.transfer import copy_files

__all__ = ["REMOTE_FLUSH_S", "AppendLog", "LeftRunning", "StorageError", "absolute", "basename",
           "bucket_and_key", "check_bucket", "client_env", "copy_file", "copy_files", "exists", "filesystem",
           "glob_files", "is_remote", "isdir", "join", "kvstore_spec", "left_running", "listdir",
           "local_copy", "makedirs", "open_file", "parent", "read_bytes", "read_text", "remove", "rename",
           "s3_endpoint", "scheme", "size", "store_retries", "unreachable", "use_client_env", "write_bytes",
           "write_text"]
