"""Builds a Config from a YAML preset plus dotted `key=value` overrides, typed by pydantic.

The schema stays plain dataclasses (configs/schema.py); pydantic's `TypeAdapter` validates the
nested mapping the file and the overrides make into one (types, coercion of the command line's
strings, nested sections, each field's `Literal` choices and `Range`), and its first error becomes
our one-line message, worded from the field's own declaration. What is ours: the dotted keys (a
YAML section and `a.b=c` address the same field), the closest valid key for a typo, and the
cross-key checks of `validate_static`.

Why pydantic (compared with draccus and tyro, which also type dataclasses): both of those own
the command line (`--model.d_model 3`), so the `key=value` contract, presets by name and our
error lines would be rebuilt around them; pydantic only validates, over the schema we have.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from typing import Any, Iterable

import pydantic
import yaml

import storage

from configs.fields import choices_of, keys, keys_fixed_on_resume, plain, range_of
from configs.schema import Config, ConfigError, closest
from configs.validate import validate_static

PRESET_DIR = os.path.dirname(os.path.abspath(__file__))
RULE_TABLES = ("sharding.params", "sharding.activations")  # dict fields: one key each, entries below


@functools.cache
def _annotations() -> dict[str, Any]:
    """Dotted key -> its type without markers, for every settable key (a dict field is one key).
    Shared between callers: read it, never change it."""
    return {name: plain(key.annotation) for name, key in keys(Config).items()}


def all_keys() -> list[str]:
    """Every settable dotted key of the schema (dict-valued fields count as one key)."""
    return list(_annotations())


def resume_keys() -> dict[str, str]:
    """The keys a resumed run must share with the run that wrote its checkpoints (each field
    marked `Resume`), in schema order: dotted key -> the dotted attribute compared, the key itself
    or the resolved property its marker names (model.head_dim -> model.resolved_head_dim)."""
    return keys_fixed_on_resume(Config)


@functools.cache
def _adapter() -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(Config)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0]).__name__
    return "mapping" if origin is dict else getattr(tp, "__name__", str(tp))


def _message(error: dict[str, Any], key: str, given: Any) -> str:
    """Pydantic's first error as our line's text after the key, worded from the field's
    declaration (its choices, its Range and the Range's hint). `given`: the whole value as set."""
    known = keys(Config).get(key)
    annotation = known.annotation if known else str
    kind, value = error["type"], error["input"]
    if kind == "literal_error":
        return f"{value!r} is not one of {', '.join(map(str, choices_of(annotation)))}"
    bounds = range_of(annotation)
    if bounds and kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        # The value as the field holds it (a command line's "-1" for a float reads -1.0).
        return bounds.message(pydantic.TypeAdapter(plain(annotation)).validate_python(value))
    if kind == "string_too_short":
        return "must not be empty"
    return f"expected {_type_name(plain(annotation))}, got {given!r}"


def _cli_value(tp: Any, text: str) -> Any:
    """A command-line value: a list (`[3,5]`, `3,5`, empty: []) or mapping as YAML; else the
    string, which validation coerces (a string field keeps `007` as it is)."""
    if typing.get_origin(tp) is list:
        value = yaml.safe_load(text) if text.strip() else []
        return [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if typing.get_origin(tp) is dict:
        return yaml.safe_load(text)
    return text


# What other stacks (Hugging Face, MaxText, torchtitan, Megatron) call a key, by its last part.
SYNONYMS = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "max_lr": "optim.lr",
    "batch_size": "train.global_batch", "global_batch_size": "train.global_batch",
    "train_batch_size": "train.global_batch", "per_device_batch_size": "train.global_batch",
    "max_steps": "train.steps", "num_steps": "train.steps", "total_steps": "train.steps",
    "train_steps": "train.steps", "steps": "train.steps",
    "warmup": "optim.warmup_steps", "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.clip", "grad_clip": "optim.clip", "clip_grad": "optim.clip",
    "gradient_clipping_threshold": "optim.clip",
    "gradient_accumulation_steps": "train.grad_accum",
    "seq_length": "model.seq_len", "max_seq_len": "model.seq_len", "sequence_length": "model.seq_len",
    "max_target_length": "model.seq_len", "max_position_embeddings": "model.seq_len",
    "hidden_size": "model.d_model", "emb_dim": "model.d_model", "dim": "model.d_model",
    "intermediate_size": "model.d_ff", "mlp_dim": "model.d_ff", "ffn_hidden_size": "model.d_ff",
    "num_hidden_layers": "model.num_layers", "n_layers": "model.num_layers", "num_decoder_layers": "model.num_layers",
    "num_attention_heads": "model.num_heads", "n_heads": "model.num_heads", "base_num_query_heads": "model.num_heads",
    "num_key_value_heads": "model.num_kv_heads", "n_kv_heads": "model.num_kv_heads", "num_query_groups": "model.num_kv_heads",
    "output_dir": "run.dir", "base_output_directory": "run.dir", "run_dir": "run.dir", "dump_folder": "run.dir",
    "seed": "run.seed", "save_steps": "checkpoint.every", "checkpoint_period": "checkpoint.every",
    "save_interval": "checkpoint.every", "logging_steps": "train.log_every", "log_period": "train.log_every",
    "eval_steps": "eval.every", "eval_interval": "eval.every",
}


def suggest_key(key: str, keys: Iterable[str]) -> str | None:
    """The valid key a bad one most likely meant: another stack's name for it (SYNONYMS), else the
    closest by the last part (the field, where typos and other names live; in the key's own
    section first), else the closest whole key; None if nothing is close."""
    keys = list(keys)
    section, _, last = key.rpartition(".")
    if SYNONYMS.get(last) in keys:
        return SYNONYMS[last]
    by_last: dict[str, list[str]] = {}
    for k in keys:
        by_last.setdefault(k.rpartition(".")[2], []).append(k)
    for name in difflib.get_close_matches(last, list(by_last), n=5, cutoff=0.75):
        mine = [k for k in by_last[name] if k.rpartition(".")[0] == section]
        if mine or not section:
            return (mine or by_last[name])[0]
    return closest(key, keys)


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    """Sets dotted `key` in the nested mapping; `table.entry` sets one entry of a rules table
    (starting from the file's table, or the default one)."""
    types = _annotations()
    table = next((t for t in RULE_TABLES if key.startswith(t + ".")), None)
    if table:
        section, field = table.split(".")
        node = tree.setdefault(section, {})
        if field not in node:
            node[field] = dict(getattr(getattr(Config(), section), field))
        node[field][key[len(table) + 1:]] = value
        return
    if key not in types:
        guess = suggest_key(key, types)
        raise ConfigError(f"unknown config key {key!r}" + (f" (did you mean {guess}?)" if guess else ""))
    if isinstance(value, bool) and types[key] in (int, float):  # pydantic would take yes as 1
        raise ConfigError(f"{key}: expected {_type_name(types[key])}, got {value!r}")
    *sections, field = key.split(".")
    node = tree
    for section in sections:
        node = node.setdefault(section, {})
    node[field] = value


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """YAML nesting -> dotted keys; a rules table (a dict field) stays one value."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in RULE_TABLES:
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def resolve_preset(path: str) -> str:
    """A path as given, or the name of a preset in configs/ (`tiny` or `tiny.yaml`)."""
    if storage.is_remote(path) or os.path.isfile(path):  # a URL is read as given (a run.dir's config.yaml)
        return path
    for candidate in (os.path.join(PRESET_DIR, path), os.path.join(PRESET_DIR, path + ".yaml")):
        if os.path.isfile(candidate):
            return candidate
    names = presets()
    # A bare name was meant as a preset: the nearest one is the likely typo's target.
    guess = None if os.path.dirname(path) else closest(path.removesuffix(".yaml"), names)
    hint = f" (did you mean {guess}?)" if guess else ""
    raise ConfigError(f"config file not found: {path}{hint}; presets: {', '.join(names)}")


def presets() -> list[str]:
    """The names `--config` takes for the presets in configs/, sorted."""
    return sorted(name.removesuffix(".yaml") for name in os.listdir(PRESET_DIR) if name.endswith(".yaml"))


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, then the static checks."""
    tree: dict[str, Any] = {}
    if config_file:
        path = resolve_preset(config_file)
        try:
            loaded = yaml.safe_load(storage.read_text(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        for key, value in _flatten(loaded):
            _put(tree, key, value)
    types = _annotations()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = (part.strip() for part in item.split("=", 1))
        if any(key.startswith(t + ".") for t in RULE_TABLES):
            _put(tree, key, yaml.safe_load(text))
        else:
            _put(tree, key, _cli_value(types.get(key), text) if key in types else text)
    try:
        cfg = _adapter().validate_python(tree)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        parts = [str(part) for part in error["loc"] if not isinstance(part, int)]
        value = tree
        for part in parts:  # the whole value as given (a list's, not only its bad item)
            value = value[part]
        key = ".".join(parts)
        raise ConfigError(f"{key}: {_message(error, key, value)}") from None
    validate_static(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    """The config as YAML, every key (what run.dir/config.yaml holds; load_config reads it back)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
