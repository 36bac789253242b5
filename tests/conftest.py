"""Test set-up: 8 fake CPU devices, forced before anything imports jax."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from configs import Config, load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdlib_glob(package: str) -> str:
    """A glob over one standard-library package: real text, small enough for quick tests."""
    import sysconfig

    return os.path.join(sysconfig.get_paths()["stdlib"], package, "**", "*.py")


@pytest.fixture
def tiny(tmp_path):
    """tiny(*overrides) -> Config: the tiny preset in a fresh run dir, on a small real corpus."""

    def make(*overrides: str) -> Config:
        base = [f"run.dir={tmp_path / 'run'}", f"data.path={stdlib_glob('json')}", "train.log_every=1"]
        return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), base + list(overrides))

    return make
