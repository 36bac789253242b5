"""Frozen models read from a directory: a meshlm run directory (its config.yaml and newest
checkpoint) or a Hugging Face checkpoint directory (its config.json), told apart by which file it
holds. An objective's frozen weights (a distillation teacher; a reference or reward model) come
from here, whatever layout wrote them.
"""

from __future__ import annotations

import os

from configs import ConfigError, load_config
from configs.schema import ModelConfig
from model import hf
from model.hf_arch import model_keys
from trainer.checkpoint import find_checkpoint, restore_params


def is_hf_dir(path: str) -> bool:
    """A Hugging Face checkpoint directory holds config.json; a meshlm run directory config.yaml."""
    return os.path.exists(os.path.join(path, "config.json"))


def model_of_dir(path: str, key: str) -> ModelConfig:
    """The network of the model in `path`. Raises ConfigError naming `key` when the directory is
    missing, holds neither kind or has no checkpoint."""
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path} is not a directory")
    if is_hf_dir(path):
        return load_config(None, [f"model.{k}={v}" for k, v in model_keys(hf.read_hf_config(path, key), key).items()]).model
    if not os.path.exists(os.path.join(path, "config.yaml")):
        raise ConfigError(f"{key}: {path} holds neither a Hugging Face config.json nor a meshlm run's config.yaml")
    try:
        return find_checkpoint(path)[0].model
    except ConfigError as e:  # its text names --run-dir, the flag of the commands that share it
        raise ConfigError(f"{key}: {str(e).removeprefix('--run-dir: ')}") from None


def load_dir(path: str, model: ModelConfig, shardings: dict, key: str) -> dict:
    """The weights in `path` placed by `shardings`: a run's newest checkpoint (whatever mesh wrote
    it), or a Hugging Face checkpoint."""
    if is_hf_dir(path):
        return hf.load_params(path, model, shardings, key)
    return restore_params(path, shardings=shardings)[2]
