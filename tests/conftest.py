"""Test set-up: 8 fake CPU devices, forced before anything imports jax."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from types import ModuleType

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
# `make test` sets it: there the Makefile has installed every extra, so a missing one is a broken
# install, not a choice, and must fail rather than skip a whole file of oracle tests unseen.
REQUIRE_EXTRAS = "MESHLM_REQUIRE_EXTRAS"


def require(module: str, extra: str) -> ModuleType:
    """Imports an optional package the tests need. Missing, it skips the caller (a user running a
    subset by hand without `pip install 'meshlm[extra]'`) or, under REQUIRE_EXTRAS=1, fails it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = str(e)
    # Outside the except block, so the report is this one line, not the import's traceback too.
    if os.environ.get(REQUIRE_EXTRAS) == "1":
        pytest.fail(f"{module} is missing but {REQUIRE_EXTRAS}=1 (make test installs meshlm[{extra}]): {why}",
                    pytrace=False)
    pytest.skip(f"needs {module} ({why}): pip install 'meshlm[{extra}]'", allow_module_level=True)


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
