"""Typed configuration: the schema, YAML presets in this folder, and dotted CLI overrides.

The names below load their modules on first use (PEP 562): `handle_interrupts`, the first name
each entry point imports, must not wait on the schema's imports before its signal handlers are in."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(("all_keys", "dump_config", "load_config", "resolve_preset", "resume_keys"), "configs.load"),
    **dict.fromkeys(("Config", "ConfigError", "MeshConfig", "ModelConfig", "PipelineConfig"), "configs.schema"),
    **dict.fromkeys(("guarded", "handle_interrupts", "on_interrupt"), "configs.interrupt"),
    **dict.fromkeys(("check_output", "check_writable"), "configs.writable"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'configs' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
