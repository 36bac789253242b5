"""Typed configuration: the schema, YAML presets in this folder, and dotted CLI overrides."""

from configs.load import all_keys, dump_config, load_config, resolve_preset, resume_keys
from configs.schema import Config, ConfigError, MeshConfig, ModelConfig, PipelineConfig
from configs.interrupt import guarded, on_interrupt
from configs.writable import check_output, check_writable

__all__ = ["Config", "ConfigError", "MeshConfig", "ModelConfig", "PipelineConfig", "all_keys", "check_output",
           "check_writable", "dump_config", "guarded", "load_config", "on_interrupt", "resolve_preset", "resume_keys"]
