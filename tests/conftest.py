"""Test set-up: 8 fake CPU devices, forced before anything imports jax."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
# One persistent compilation cache for the session, inherited by every train.py the tests start:
# most tests compile the same tiny programs, and a cache hit turns ~3 s of XLA work into ~0.3 s.
# A fresh directory each session, so no test can pass on an executable from older code.
_CACHE = tempfile.mkdtemp(prefix="meshlm-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
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
