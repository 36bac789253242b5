"""Builds a Config from a YAML preset plus dotted `key=value` overrides, with typed checks.

Every error is a ConfigError whose message is one line naming the key or file; a misspelt key
gets the closest valid one suggested.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import yaml

from configs.schema import Config, ConfigError, closest, validate_static

PRESET_DIR = os.path.dirname(os.path.abspath(__file__))


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every settable dotted key of the schema (dict-valued fields count as one key)."""
    keys = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _unknown(key: str) -> ConfigError:
    guess = closest(key, all_keys())
    hint = f" (did you mean {guess}?)" if guess else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Checks `value` against the annotated type `tp`; CLI values arrive as strings."""
    tname = getattr(tp, "__name__", str(tp))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
            return str(value).lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_cli:
            return str(value)
    elif typing.get_origin(tp) is dict:
        if from_cli and isinstance(value, str):
            value = yaml.safe_load(value)
        if isinstance(value, dict):
            return dict(value)
        tname = "mapping"
    elif typing.get_origin(tp) is list:
        if from_cli and isinstance(value, str):  # `[3,5]` (YAML flow) or `3,5`; empty: []
            value = yaml.safe_load(value) if value.strip() else []
            value = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, list):
            try:
                return [_coerce(key, item_tp, v, from_cli) for v in value]
            except ConfigError:
                pass
        tname = f"a list of {item_tp.__name__}"
    raise ConfigError(f"{key}: expected {tname}, got {value!r}")


def _set(cfg: Config, key: str, value: Any, from_cli: bool) -> None:
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        if isinstance(node, dict):  # a rules table: sharding.params.embed=fsdp
            rest = ".".join(parts[i:])
            node[rest] = yaml.safe_load(value) if from_cli and isinstance(value, str) else value
            return
        types = _field_types(type(node))
        if part not in types:
            raise _unknown(key)
        tp = types[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
                for sub, v in value.items():
                    _set(cfg, f"{key}.{sub}", v, from_cli)
                return
            setattr(node, part, _coerce(key, tp, value, from_cli))
            return
        node = getattr(node, part)
    raise _unknown(key)


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """YAML nesting -> dotted keys; a rules table (a dict field) stays one value."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in ("sharding.params", "sharding.activations"):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def resolve_preset(path: str) -> str:
    """A path as given, or the name of a preset in configs/ (`tiny` or `tiny.yaml`)."""
    if os.path.isfile(path):
        return path
    for candidate in (os.path.join(PRESET_DIR, path), os.path.join(PRESET_DIR, path + ".yaml")):
        if os.path.isfile(candidate):
            return candidate
    raise ConfigError(f"config file not found: {path}")


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, then the static checks."""
    cfg = Config()
    if config_file:
        path = resolve_preset(config_file)
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        for key, value in _flatten(tree):
            _set(cfg, key, value, from_cli=False)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), value.strip(), from_cli=True)
    validate_static(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
