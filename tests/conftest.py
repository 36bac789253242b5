"""Test set-up: 8 fake CPU devices, forced before anything imports jax."""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from types import ModuleType

# LLVM's optimization of the CPU code off: the tests check numbers and behaviour, not CPU speed,
# and it takes a large share of their CPU time while changing no result (no fast-math: the
# golden values hold either way). XLA:CPU's newer fusion emitters off too: they take most of the
# compile time left, and the golden values hold without them. The real-target compiles drop
# both (`real_target_env`): their programs are the ones users get.
# One LLVM module per program, not XLA:CPU's split into pieces to compile on parallel threads: the
# pieces cost more CPU time in all, and the suite's workers keep both cores busy anyway.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ["JAX_PLATFORMS"] = "cpu"
# Each op's location in the lowered program names its innermost frame only, not the whole stack
# (up to 100 frames, most of them pytest's under a test): lowering and the cache key's
# strip-debuginfo walk less. Compiled code is the same; train.py keeps JAX's default of full
# tracebacks for profiles.
os.environ["JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS"] = "false"
# One persistent compilation cache for the session, shared by pytest-xdist's workers (they inherit
# the variable from the pytest process, which loads this file before starting them) and every
# train.py the tests start: most tests compile the same tiny programs, and a cache hit costs a
# fraction of the compile. A fresh directory each session, so no test can pass on an
# executable from older code; removed by the process that made it.
_SHARED = "MESHLM_TEST_JAX_CACHE"
if _SHARED not in os.environ:
    os.environ[_SHARED] = tempfile.mkdtemp(prefix="meshlm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[_SHARED], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_SHARED]
# A size bound turns on the cache's file lock: without it an entry is written in place, and a
# process reading it half-written (two workers compiling the same program) gets a warning and
# compiles again.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 << 30)
# The bound also makes every write scan the whole directory (JAX's LRU eviction reads each
# entry's access time), so only programs that take 0.2 s to compile are kept: the train steps,
# inits and schedules a hit pays for, not the many one-op eager programs that compile faster
# than a write would then cost.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gc  # noqa: E402

import pytest  # noqa: E402

from configs import Config, load_config  # noqa: E402
from ops.xla_env import KEEP_COLLECTIVES_IN_LOOPS, set_cpu_collective_env, set_default_flags  # noqa: E402

# Room in XLA:CPU's thread pool for the 8 devices' collectives, and collectives kept in their loops
# (see ops/xla_env.py: without either, pipelined steps can abort or hang); before any test
# starts the backend, and inherited by every process a test starts.
set_cpu_collective_env(8)
# The flags every entry point sets (train.py, plan.py): the tests stand in for them.
set_default_flags()

# Tracing a program allocates hundreds of thousands of short-lived objects, and Python's default
# collector (a young-generation pass every 700 allocations, full passes over every object
# imported) takes a noticeable share of the CPU time of tracing, lowering and compiling a train
# step. Everything imported so far is kept out of the collector's passes for good, and the young
# generation is collected less often.
gc.freeze()

# A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and so would
# every process a test starts: the tests that press Ctrl-C on a train.py or plan.py would see it
# ignored, as the commands rightly keep a signal their parent ignored. A caught signal is reset to
# the default in a child that execs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
gc.set_threshold(50_000, 20, 100)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `make test` sets it: there the Makefile has installed every extra, so a missing one is a broken
# install, not a choice, and must fail rather than skip a whole file of oracle tests unseen.
REQUIRE_EXTRAS = "MESHLM_REQUIRE_EXTRAS"


class _Deferred(ModuleType):
    """A module imported at its first public attribute read (the real one, whatever it puts in
    sys.modules). Until then a private name is missing: pytest probes every global of a test file
    for fixture markers (`_pytestfixturefunction`), which must not load torch."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("_") and self.__name__ not in sys.modules:
            raise AttributeError(name)
        return getattr(importlib.import_module(self.__name__), name)


def require(module: str, extra: str, lazy: bool = False) -> ModuleType:
    """Imports an optional package the tests need. Missing, it skips the caller (a user running a
    subset by hand without `pip install 'meshlm[extra]'`) or, under REQUIRE_EXTRAS=1, fails it.
    `lazy`: found but loaded at its first use (for a module-level call: every xdist worker
    collects every file, and importing torch with transformers' Mixtral would cost each one
    seconds of collection)."""
    try:
        if not lazy:
            return importlib.import_module(module)
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"No module named {module!r}")
        return _Deferred(module)
    except ImportError as e:
        why = str(e)
    # Outside the except block, so the report is this one line, not the import's traceback too.
    if os.environ.get(REQUIRE_EXTRAS) == "1":
        pytest.fail(f"{module} is missing but {REQUIRE_EXTRAS}=1 (make test installs meshlm[{extra}]): {why}",
                    pytrace=False)
    pytest.skip(f"needs {module} ({why}): pip install 'meshlm[{extra}]'", allow_module_level=True)


@pytest.fixture(scope="module")
def one_torch_thread() -> None:
    """One torch thread for the oracle models: on these tiny ones a second only spins beside the
    other test worker."""
    require("torch", "hf").set_num_threads(1)


def stopped_at(run_dir: str | os.PathLike, dest: str | os.PathLike, step: int) -> pathlib.Path:
    """A copy of `run_dir` at `dest` without its checkpoints after `step`: the run as a run stopped
    at `step` left it, for a resume test, without training that shorter run again."""
    shutil.copytree(run_dir, dest, dirs_exist_ok=True)
    checkpoints = pathlib.Path(dest) / "checkpoints"
    later = [d for d in checkpoints.iterdir() if d.name.isdigit() and int(d.name) > step]
    assert later, f"{run_dir} saved no checkpoint after step {step}"
    for d in later:
        shutil.rmtree(d)
    return pathlib.Path(dest)


def real_target_env() -> dict[str, str]:
    """The environment for a process that compiles for a real GPU or TPU: XLA's own defaults."""
    flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE, "").replace(KEEP_COLLECTIVES_IN_LOOPS, "")
    return dict(os.environ, XLA_FLAGS=flags)


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


# Worker seconds per file (the wall time of its tests in a fake-CPU run), heaviest first.
# `--dist loadfile --no-loadscope-reorder` hands each xdist worker whole files in collection
# order (xdist's default order instead is by number of tests, which put the few long
# multi-process tests last while the other workers sat idle); handed out longest first, the last
# files are short ones and the workers end together. A file not listed goes after these, in its
# own order; a stale weight only costs time.
FILE_SECONDS = {
    "test_storage": 133, "test_pipeline": 98, "test_distributed": 69, "test_faults": 59,
    "test_lora": 48, "test_deepseek_routing": 46, "test_moe": 46, "test_storage_multiprocess": 62,
    "test_lora_post": 46, "test_context": 39, "test_lora_dropout": 38, "test_bench_step": 37,
    "test_mtp": 34, "test_tiers": 34, "test_plan": 32, "test_train": 32, "test_cli": 31,
    "test_data_run": 29, "test_post_training": 28, "test_pipeline_train": 26,
    "test_storage_corpora": 25, "test_generate": 24, "test_eval_run": 24, "test_quant": 23,
    "test_distill": 22, "test_grpo_run": 22, "test_post_combos": 21, "test_mla": 20,
    "test_storage_tools": 18, "test_grpo_layouts": 18, "test_hf_deepseek": 17, "test_hf_moe": 15,
    "test_optimizers": 15, "test_interrupt": 14, "test_observe": 14, "test_lock": 14, "test_hf": 13,
    "test_accumulation": 12, "test_grpo_learns": 12, "test_fused_ring": 10, "test_trackers": 11, "test_harness": 11,
    "test_lora_mla": 9, "test_prepare": 9, "test_stragglers": 8, "test_attention_chunk": 7,
    "test_sharding": 7, "test_loss": 7, "test_moe_ragged": 7, "test_sweep": 7, "test_model": 6,
    "test_grpo_step": 6, "test_lookup": 6,
}


# The same for the real-target compiles, which run apart (tests marked real_target): there each
# test is its own unit of work (`--dist loadgroup`), so the heaviest file's tests start first and
# the short ones fill in at the end.
REAL_TARGET_FILE_SECONDS = {
    "test_targets": 470, "test_targets_maxtext": 187, "test_search_experts": 75, "test_attention_chunk": 43,
    "test_planner_peers": 20, "test_loss": 14, "test_torus": 13, "test_mla": 10,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Orders the files by FILE_SECONDS (REAL_TARGET_FILE_SECONDS for the real-target tests),
    heaviest first; the tests within a file keep their order."""
    def weight(item: pytest.Item) -> int:
        name = os.path.splitext(os.path.basename(str(item.path)))[0]
        seconds = REAL_TARGET_FILE_SECONDS if item.get_closest_marker("real_target") else FILE_SECONDS
        return -seconds.get(name, 0)

    items.sort(key=weight)  # stable: each file's tests stay together and in order


# The object-store servers' fixtures, defined here once so every test file shares one server of
# each kind per session: a module that imported them would get its own session fixture, a second
# server, while clients made earlier in the process (etils.epath's s3fs, under Orbax) still speak
# to the first. Imported last: storage_servers imports `require` from this module.
from storage_servers import gcs_bucket, s3_bucket  # noqa: E402, F401
