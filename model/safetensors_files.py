"""Safetensors files through the `safetensors` library: its memory-mapped reader
(`safe_open(...).get_slice`), so a slice costs only its own bytes, and its numpy writer. numpy is
its framework here (no torch); ml_dtypes gives numpy the bfloat16 type the files may hold.

A directory on a bucket (`gs://`, `s3://`) is read from local copies of its files (the reader maps
a local file; `storage.local_copy`, once per process); a file written to a bucket is written
locally first and uploaded as one object.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import ml_dtypes  # noqa: F401 (registers "bfloat16" with numpy, which safetensors' numpy reader asks for)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import storage
from configs.schema import ConfigError

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class SafetensorsDir:
    """The tensors of a Hugging Face directory (one `model.safetensors` or a sharded index), as
    lazy slices: nothing is read from disk until a block of one is indexed."""

    def __init__(self, hf_dir: str, key: str):
        index = storage.join(hf_dir, "model.safetensors.index.json")
        if storage.exists(index):
            files = sorted(set(json.loads(storage.read_text(index))["weight_map"].values()))
        elif storage.exists(storage.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ConfigError(f"{key}: {hf_dir} has neither model.safetensors nor model.safetensors.index.json")
        self.key, self.slices = key, {}
        for name in files:
            path = storage.join(hf_dir, name)
            try:
                handle = safe_open(storage.local_copy(path), framework="numpy")
            except Exception as e:  # the library's own error for a damaged header names no file
                raise ConfigError(f"{key}: cannot read {path}: {e}") from None
            for tensor in handle.keys():
                self.slices[tensor] = (path, handle.get_slice(tensor))

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        """Tensor `name`, checked to have `shape`, as a lazy slice: index it (`[...]` for all)."""
        if name not in self.slices:
            raise ConfigError(f"{self.key}: the checkpoint has no tensor {name}")
        path, lazy = self.slices[name]
        if lazy.get_dtype() not in FLOAT_DTYPES:
            raise ConfigError(f"{self.key}: tensor {name} in {path} has dtype {lazy.get_dtype()}; expected floats")
        if tuple(lazy.get_shape()) != shape:
            raise ConfigError(f"{self.key}: tensor {name} has shape {lazy.get_shape()}, expected {list(shape)}")
        return lazy


def write_safetensors(tensors: dict[str, np.ndarray], path: str, dtype: str = "float32") -> None:
    """Tensors -> one .safetensors file of `dtype` (rounded to nearest), written whole or not at
    all (a temporary file renamed into place), with the permissions open() would give it. On a
    bucket: written in a local temporary directory, then uploaded as one object."""
    cast = {name: np.ascontiguousarray(a, dtype=EXPORT_DTYPES[dtype]) for name, a in tensors.items()}
    if storage.is_remote(path):
        with tempfile.TemporaryDirectory(prefix="meshlm-safetensors-") as tmp:
            local = os.path.join(tmp, storage.basename(path))
            save_file(cast, local, metadata={"format": "pt"})
            storage.copy_file(local, path)
        return
    save_file(cast, path + ".tmp", metadata={"format": "pt"})  # "pt": what transformers expects to find
    # The library's writer creates its file private (0600) whatever the umask; the files written
    # beside it (config.json, the tokenizer's) get 0666 less the umask, and so does this one.
    os.chmod(path + ".tmp", 0o666 & ~_umask())
    os.replace(path + ".tmp", path)


def _umask() -> int:
    """The process's umask. Reading it means setting it: it is put straight back."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
