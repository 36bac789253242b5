"""The safetensors file format, read and written with numpy alone (no torch): an 8-byte header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
little-endian bytes. Reading memory-maps the files, so a slice costs only its own bytes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from configs.schema import ConfigError

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class SafetensorsDir:
    """The tensors of a Hugging Face directory (one `model.safetensors` or a sharded index), as
    read-only memory maps: nothing is read from disk until a slice of it is used."""

    def __init__(self, hf_dir: str, key: str):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ConfigError(f"{key}: {hf_dir} has neither model.safetensors nor model.safetensors.index.json")
        self.key, self.tensors = key, {}
        for name in files:
            self._scan(os.path.join(hf_dir, name))

    def _scan(self, path: str) -> None:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            start = f.tell()
        header.pop("__metadata__", None)
        for name, meta in header.items():
            if meta["dtype"] not in SAFETENSORS_DTYPES:
                raise ConfigError(f"{self.key}: tensor {name} in {path} has dtype {meta['dtype']}; expected floats")
            begin, end = meta["data_offsets"]
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            self.tensors[name] = (path, start + begin, end - begin, dtype, tuple(meta["shape"]))

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ConfigError(f"{self.key}: the checkpoint has no tensor {name}")
        path, offset, size, dtype, stored = self.tensors[name]
        if stored != shape:
            raise ConfigError(f"{self.key}: tensor {name} has shape {list(stored)}, expected {list(shape)}")
        if size == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def write_safetensors(tensors: dict[str, np.ndarray], path: str, dtype: str = "float32") -> None:
    """Tensors -> one .safetensors file of `dtype` (rounded to nearest): 8-byte header length,
    JSON header, raw little-endian bytes."""
    code = EXPORT_DTYPES[dtype]
    tensors = {name: np.ascontiguousarray(a, dtype=SAFETENSORS_DTYPES[code]) for name, a in tensors.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, a in tensors.items():
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path + ".tmp", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for a in tensors.values():
            f.write(a.tobytes())  # x86 and ARM hosts are little-endian, as the format is
    os.replace(path + ".tmp", path)
