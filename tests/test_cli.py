"""The command line: each bad input exits 2 with one line naming the key or file, before any
compile and without creating run.dir; a good command trains and writes the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import train
from conftest import ROOT, stdlib_glob
from bench.procs import FORCE_COUNT
from ops.xla_env import KEEP_COLLECTIVES_IN_LOOPS

TINY = os.path.join(ROOT, "configs", "tiny.yaml")

BAD = {
    "mesh product": (["mesh.data=3"], "mesh: pipeline=1 x data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 = 3 devices, but 8 are available; "
                     "this process sees 8 cpu device(s): make the mesh sizes multiply to 8, or leave one at -1"),
    # The conftest's XLA_FLAGS name 8 devices (and JAX has started): the user's flag wins, and the line says what to do.
    "mesh beyond the devices": (["mesh.data=16"], "= 16 devices, but 8 are available; for 16 CPU devices start the "
                                "process with XLA_FLAGS=--xla_force_host_platform_device_count=16 (train.py sets it "
                                "itself on a CPU-only machine, but here XLA_FLAGS already sets"),
    "heads": (["mesh.data=1", "mesh.tensor=8", "model.num_heads=12", "model.num_kv_heads=4", "sharding.params.kv_heads=null"],
              "model.num_heads=12 is not divisible by 8"),
    "kv heads": (["mesh.data=1", "mesh.tensor=8", "model.num_kv_heads=4"], "model.num_kv_heads=4 is not divisible by 8"),
    "d_ff": (["mesh.data=1", "mesh.tensor=8", "model.d_ff=100"], "model.d_ff=100 is not divisible by 8"),
    "vocab": (["mesh.data=1", "mesh.tensor=8", "model.vocab_size=260"], "model.vocab_size=260 is not divisible by 8"),
    "global batch": (["mesh.data=8", "train.global_batch=12"], "train.global_batch=12 is not divisible by 8"),
    "grad accum": (["mesh.data=8", "train.grad_accum=4"], "train.global_batch=16 is not divisible by 32"),
    "unknown key": (["train.stpes=5"], "unknown config key 'train.stpes' (did you mean train.steps?)"),
    "unknown logical name": (["mesh.fsdp=8", "sharding.params.embd=fsdp"],
                             "sharding.params.embd: unknown logical name; did you mean 'embed'?"),
    "wrong type": (["train.global_batch=big"], "train.global_batch: expected int, got 'big'"),
    "negative steps": (["train.steps=-3"], "train.steps: must be >= 0, got -3"),
    "negative decay steps": (["optim.decay_steps=-1"],
                             "optim.decay_steps: must be >= 0 (0: train.steps at the run's start), got -1"),
    "no data file": (["data.path=/nonexistent/**/*.txt"], "data.path: no file matches '/nonexistent/**/*.txt'"),
    "pipeline stages": (["mesh.pipeline=8", "mesh.data=1"], "model.num_layers=4 is not divisible by mesh.pipeline=8 x pipeline.repeats=1"),
    "pipeline repeats": (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=4"],
                         "model.num_layers=4 is not divisible by mesh.pipeline=2 x pipeline.repeats=4"),
    "too few microbatches": (["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=2"],
                             "pipeline.microbatches=2 is fewer than mesh.pipeline=4 stages"),
    "microbatches vs batch": (["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=6"],
                              "pipeline.microbatches=6 does not divide the per-replica batch 8"),
    "repeats without stages": (["pipeline.repeats=2"], "pipeline.repeats=2 needs mesh.pipeline > 1"),
    "nodes vs crossing axis": (["mesh.data=2", "mesh.fsdp=4", "mesh.nodes=4"],
                               "mesh.nodes=4 does not divide mesh.data=2, the axis that crosses nodes (mesh.across=data)"),
    "crossing axis name": (["mesh.nodes=2", "mesh.across=dta"], "mesh.across"),
    "nodes this host lacks": (["mesh.data=2", "mesh.fsdp=4", "mesh.nodes=2"],
                              "mesh.nodes=2, but the 8 devices sit in 1 processes (one per node)"),
    "experts vs the expert axis": (["mesh.data=1", "mesh.expert=8", "model.moe.num_experts=6"],
                                   "mesh.expert: 8 does not divide model.moe.num_experts=6"),
    "experts vs a filled expert axis": (["mesh.data=2", "mesh.expert=-1", "model.moe.num_experts=6"],
                                        "mesh.expert=4 does not divide model.moe.num_experts=6"),
    "top-k above the experts": (["model.moe.num_experts=4", "model.moe.experts_per_token=5"],
                                "model.moe.experts_per_token: must be in [1, model.moe.num_experts=4], got 5"),
    "top-k below 1": (["model.moe.num_experts=4", "model.moe.experts_per_token=0"],
                      "model.moe.experts_per_token: must be in [1, model.moe.num_experts=4], got 0"),
    "negative capacity factor": (["model.moe.num_experts=4", "model.moe.capacity_factor=-0.5"],
                                 "model.moe.capacity_factor: must be >= 0 (0: dropless), got -0.5"),
    "MoE every 0 layers": (["model.moe.num_experts=4", "model.moe.every=0"],
                           "model.moe.every: must be >= 1 (1: every layer is an MoE), got 0"),
    "MoE every 3 of 4 layers": (["model.moe.num_experts=4", "model.moe.every=3"],
                                "model.moe.every: 3 does not divide model.num_layers=4"),
    "MoE groups on a pipeline": (["mesh.pipeline=2", "mesh.data=4", "model.moe.num_experts=4", "model.moe.every=2"],
                                 "model.moe.every: 2 with mesh.pipeline=2: layer groups are not split into stages yet"),
    "unknown grouped matmul": (["model.moe.num_experts=4", "model.moe.grouped_matmul=gmm"],
                               "model.moe.grouped_matmul: 'gmm' is not one of auto, ragged_dot, megablox"),
    "megablox tile": (["model.moe.num_experts=4", "model.moe.grouped_matmul=megablox"],
                      "model.d_model=64 is not a multiple of 128, the tile of model.moe.grouped_matmul=megablox"),
    "expert axis on a dense model": (["mesh.data=1", "mesh.expert=8"], "mesh.expert: 8 needs model.moe.num_experts > 0"),
    "MoE under 1f1b": (["mesh.pipeline=2", "mesh.data=4", "model.moe.num_experts=4", "pipeline.schedule=1f1b"],
                       "pipeline.schedule: 1f1b does not carry the MoE router losses"),
    "MoE under interleaved 1f1b": (["mesh.pipeline=2", "mesh.data=4", "model.moe.num_experts=4", "pipeline.repeats=2",
                                    "pipeline.schedule=interleaved_1f1b"],
                                   "pipeline.schedule: interleaved_1f1b does not carry the MoE router losses"),
    "context vs load balancing": (["mesh.data=1", "mesh.context=8", "model.seq_len=40"],
                                  "model.seq_len=40 is not divisible by 2 x mesh.context=8 (context.load_balance=true)"),
    "context without load balancing": (["mesh.data=1", "mesh.context=8", "model.seq_len=36", "context.load_balance=false"],
                                       "model.seq_len=36 is not divisible by mesh.context=8"),
    "context with a kernel that cannot split": (["mesh.data=4", "mesh.context=2", "model.attention=dot_product"],
                                                "model.attention=dot_product: the kernel cannot take a sequence split"),
    "context with splash outside the ring": (["mesh.data=4", "mesh.context=2", "model.attention=splash", "model.seq_len=128"],
                                             "model.attention=splash takes a sequence split (mesh.context=2) only as "
                                             "ring attention's blocks"),
    "splash tile": (["model.attention=splash"], "model.seq_len=32 is not a multiple of 128, the tile of model.attention=splash"),
    "context strategy name": (["context.strategy=rnig"], "context.strategy: 'rnig' is not one of allgather, ring"),
    "vocab below tokenizer": (["model.vocab_size=128"], "model.vocab_size=128 does not match the 'byte' tokenizer's 257 tokens"),
    "vocab far above tokenizer": (["model.vocab_size=512"], "model.vocab_size=512 does not match the 'byte' tokenizer's 257 tokens"),
    "optimizer name": (["optim.name=adam"], "optim.name"),
    "1f1b with a sequence split": (["mesh.pipeline=2", "mesh.context=2", "mesh.data=2", "pipeline.schedule=1f1b"],
                                   "pipeline.schedule=1f1b does not yet run the sequence split"),
    "interleaved 1f1b with one repeat": (["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=interleaved_1f1b"],
                                         "pipeline.schedule=interleaved_1f1b needs pipeline.repeats > 1"),
    "interleaved 1f1b with a partial group": (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2",
                                               "pipeline.microbatches=3", "train.global_batch=24",
                                               "pipeline.schedule=interleaved_1f1b"],
                                              "pipeline.microbatches=3 is not a multiple of it"),
    "zero bubble with repeats": (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.schedule=zero_bubble"],
                                 "pipeline.schedule=zero_bubble runs each stage's layers once: pipeline.repeats=2"),
    "zero bubble without a pipeline": (["mesh.data=8", "pipeline.schedule=zero_bubble"],
                                       "pipeline.schedule=zero_bubble needs mesh.pipeline > 1"),
    "zero bubble with a sequence split": (["mesh.pipeline=2", "mesh.context=2", "mesh.data=2",
                                           "pipeline.schedule=zero_bubble"],
                                          "pipeline.schedule=zero_bubble does not yet run the sequence split"),
    "MoE under zero bubble": (["mesh.pipeline=2", "mesh.data=4", "model.moe.num_experts=4",
                               "pipeline.schedule=zero_bubble"],
                              "pipeline.schedule: zero_bubble does not carry the MoE router losses"),
    "zero bubble with fewer microbatches than stages": (["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=2",
                                                         "pipeline.schedule=zero_bubble"],
                                                        "pipeline.microbatches=2 is fewer than mesh.pipeline=4 stages"),
    "tracker name": (["run.trackers=[tensorboard,wandbb]"], "run.trackers"),
    "tracker twice": (["run.trackers=[mlflow,mlflow]"], "run.trackers: names a tracker twice"),
    "fp8 gathers with nothing gathered": (["mesh.data=8", "model.gather_dtype=fp8"],
                                          "model.gather_dtype=fp8: this layout gathers no parameter"),
    "gather dtype name": (["model.gather_dtype=fp4"], "model.gather_dtype: 'fp4' is not one of compute, fp8"),
    "logits dtype name": (["model.logits_dtype=bf16"], "model.logits_dtype: 'bf16' is not one of compute, float32"),
    "rl group of one": (["rl.group_size=1"], "rl.group_size: must be >= 2, got 1"),
    "rl reward path": (["rl.reward=exact_match,my-pkg:fn"], "rl.reward: 'my-pkg:fn' is neither a reward's name"),
    "rl answer format": (["rl.answer_format=[0-9"], "rl.answer_format: '[0-9' is not a regular expression"),
    "rl top_k past the vocabulary": (["rl.top_k=264"], "rl.top_k: 264 must be below model.vocab_size=264"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_naming_the_key(case, tmp_path, capsys):
    overrides, message = BAD[case]
    run_dir = tmp_path / "run"
    code = train.main(["--config", TINY, f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert not run_dir.exists(), "nothing may be created for a bad command"


def test_missing_config_file(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert f"config file not found: {tmp_path / 'nope.yaml'}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from configs import load_config
    import trainer

    run_dir = tmp_path_factory.mktemp("done") / "run"
    # The learning-rate horizon of tests/test_faults.py's runs: their compiled step (the shared
    # compilation cache), not one of its own.
    trainer.run(load_config(TINY, [f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", "train.steps=2",
                                   "optim.decay_steps=12"]))
    return run_dir


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.data=3"], "= 3 devices, but 8 are available"),
        (["model.d_model=128"], "model.d_model=128 differs from 64 in the checkpoints of run.dir="),
        (["train.global_batch=32"], "train.global_batch=32 differs from 16 in the checkpoints"),
        (["optim.clip=0"], "optim.clip=0.0 turns clipping off"),
    ],
)
def test_bad_input_leaves_an_existing_run_untouched(finished_run, overrides, message, capsys):
    def snapshot():
        return {
            os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
            for d, _, files in os.walk(finished_run) for f in files
        }

    before = snapshot()
    args = ["--config", TINY, f"run.dir={finished_run}", f"data.path={stdlib_glob('json')}", "train.steps=4"]
    assert train.main(args + overrides) == 2
    assert message in capsys.readouterr().err
    assert snapshot() == before


def _cli(*args: str, timeout: int = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if env is None else env
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", TINY, "mesh.data=3"],
         "mesh: pipeline=1 x data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 = 3 devices, but 8 are available; "
         "this process sees 8 cpu device(s): make the mesh sizes multiply to 8, or leave one at -1"),
        # FSDP is the rule `embed -> fsdp`: a misspelt name would leave every parameter whole.
        (["--config", TINY, "sharding.params.embd=fsdp"],
         "sharding.params.embd: unknown logical name; did you mean 'embed'?"),
        (["model.d_model=abc"], "model.d_model: expected int, got 'abc'"),
        (["--config", "tiny-moee"], "config file not found: tiny-moee (did you mean tiny-moe?); presets: "
                                    "addition-sft-tiny, deepseek-v3, dpo-tiny, grpo-tiny, llama3-1b, llama3-3b, "
                                    "llama3-70b, llama3-8b, llama3-8b-128k, llama3-8b-dpo, llama3-8b-sft, lora-tiny, "
                                    "mixtral-8x7b, moonlight-16b, sft-tiny, tiny, tiny-deepseek, tiny-moe"),
    ],
)
def test_real_process_bad_input_is_one_line(tmp_path, args, message):
    """A bad command prints exactly its error line on stderr, nothing on stdout: no traceback,
    no set-up notice, no library warning."""
    out = _cli(*args, f"run.dir={tmp_path / 'r'}")
    assert out.returncode == 2
    assert out.stderr == f"error: {message}\n" and out.stdout == ""
    assert not (tmp_path / "r").exists()


def test_a_bad_layout_is_one_line_where_train_py_sets_the_device_count(tmp_path):
    """On a machine where train.py sets the CPU device count itself, its notice waits for the
    checks: a refused layout prints the error line alone."""
    out = _cli("--config", TINY, "mesh.data=3", f"run.dir={tmp_path / 'r'}", env=_env_without_device_count())
    assert out.returncode == 2
    assert out.stderr == ("error: train.global_batch=16 is not divisible by 3 = batch shards (data=3 x fsdp=1 x "
                          "expert=1) x train.grad_accum=1\n") and out.stdout == ""


def _env_without_device_count() -> dict[str, str]:
    """The environment of a user who has never heard of XLA_FLAGS, on a CPU-only machine."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_real_process_trains_a_sharded_run(tmp_path):
    """The README's multi-device command as written: no device count in XLA_FLAGS, yet the mesh
    gets its 8 devices. The suite's other XLA flags stay (tests/conftest.py): they do not touch
    the device count, and with them the step compiles as the other tests' do."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FORCE_COUNT)]
    env = dict(_env_without_device_count(), XLA_FLAGS=" ".join(flags))
    assert FORCE_COUNT not in env["XLA_FLAGS"]
    out = _cli("--config", TINY, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=3",
               f"run.dir={tmp_path / 'a'}", f"data.path={stdlib_glob('json')}", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # no library warning (Orbax's handler override, say)
    assert out.stdout.splitlines()[0] == (
        "the mesh names 8 devices: running 8 CPU devices on this CPU-only machine "
        "(XLA_FLAGS --xla_force_host_platform_device_count=8, set by train.py)")
    assert "mesh pipeline=1 x data=2 x fsdp=2 x expert=1 x context=1 x tensor=2 on 8 cpu devices" in out.stdout
    assert "compiled the train step" in out.stdout and "step 3/3" in out.stdout
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "tb"]


def test_a_user_device_count_that_is_too_small_says_what_to_do(tmp_path):
    env = dict(_env_without_device_count(), XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = _cli("--config", TINY, f"run.dir={tmp_path / 'r'}", "mesh.data=2", "mesh.fsdp=2", env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: mesh: pipeline=1 x data=2 x fsdp=2 x expert=1 x context=1 x tensor=1 = 4 devices, but 2 are available; for 4 CPU devices "
        "start the process with XLA_FLAGS=--xla_force_host_platform_device_count=4 (train.py sets it itself on a "
        "CPU-only machine, but here XLA_FLAGS already sets --xla_force_host_platform_device_count, and the user's "
        "flag wins)"]
    assert not (tmp_path / "r").exists()


def test_device_count_is_set_only_where_it_can_apply():
    """Where the count cannot be set (an accelerator, or JAX already running), nothing is changed
    and the reason comes back for the error's hint."""
    from configs import load_config
    from ops.xla_env import device_count_hint, set_cpu_device_count

    import jax

    jax.devices()  # this test process runs JAX (started here, so the test holds when run alone)
    cfg = load_config(TINY, ["mesh.data=2", "mesh.tensor=2"])
    cases = {
        "JAX_PLATFORMS=cuda is not CPU-only": {"JAX_PLATFORMS": "cuda"},
        "JAX had already started in this process": {"JAX_PLATFORMS": "cpu"},
    }
    for why, env in cases.items():
        before = dict(env)
        assert set_cpu_device_count(cfg, env) == why and env == before
    assert set_cpu_device_count(load_config(TINY, ["mesh.fsdp=1"]), {}) == "", "a mesh of -1 asks for no count"
    assert device_count_hint(cfg, "gpu", 1, "") == (
        "this process sees 1 gpu device(s): make the mesh sizes multiply to 1, or leave one at -1")


def test_the_cpu_devices_get_four_pool_threads_each_unless_the_user_sized_the_pool():
    """XLA:CPU gives its devices one pool of max(cores, devices) threads, and a collective waits on
    its thread: with one thread per device, a pipelined fsdp step aborted now and then under load
    (ops/xla_env.py). Where train.py sets the device count, it sizes the pool at 4 threads per
    device (counted in a real process that ran a collective over the 8 devices); NPROC, the
    user's own size, wins."""
    code = ("import os, jax, jax.numpy as jnp; from configs import load_config; "
            "from ops.xla_env import set_cpu_device_count; "
            f"set_cpu_device_count(load_config({TINY!r}, ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'])); "
            "m = jax.sharding.Mesh(jax.devices(), ('x',)); "
            "x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec('x'))); "
            "jax.jit(lambda a: a.sum(0))(x).block_until_ready(); "
            "print(sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'tf_XLAEigen' "
            "for t in os.listdir('/proc/self/task')))")
    for user, threads in (({}, max(os.cpu_count() or 1, 32)), ({"NPROC": "12"}, 12)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env={**_env_without_device_count(), **user})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == str(threads), (user, out.stdout)


def test_bench_children_get_the_pool_their_device_count_needs(monkeypatch):
    """bench.procs names the device count in a child's XLA_FLAGS, which train.py then leaves
    alone, pool included: cpu_env sizes the pool itself (the caller's NPROC wins)."""
    from bench.procs import cpu_env

    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")  # a caller without the suite's flags
    assert cpu_env(8)["NPROC"] == str(max(os.cpu_count() or 1, 32)) and "NPROC" not in cpu_env(1)
    assert KEEP_COLLECTIVES_IN_LOOPS in cpu_env(8)["XLA_FLAGS"] and KEEP_COLLECTIVES_IN_LOOPS not in cpu_env(1)["XLA_FLAGS"]
    monkeypatch.setenv("NPROC", "12")
    assert cpu_env(8)["NPROC"] == "12"


def test_several_cpu_devices_keep_their_collectives_in_loops():
    """XLA:CPU does not order a collective hoisted out of a loop against the loop's own, and a
    pipelined step deadlocked on it (trainer/xla_env.KEEP_COLLECTIVES_IN_LOOPS): wherever the stack
    starts several CPU devices it turns that hoisting off; one device has no peer to wait for, and
    a user's own choice of passes to disable wins."""
    from ops.xla_env import set_cpu_collective_env

    env: dict[str, str] = {}
    set_cpu_collective_env(8, env)  # train.py's own call: test_launched_processes_share_the_mesh_devices
    assert env["XLA_FLAGS"] == KEEP_COLLECTIVES_IN_LOOPS and int(env["NPROC"]) >= 32
    one: dict[str, str] = {}
    set_cpu_collective_env(1, one)
    assert one == {}
    user = {"XLA_FLAGS": "--xla_disable_hlo_passes=algsimp", "NPROC": "3"}
    set_cpu_collective_env(8, user)
    assert user == {"XLA_FLAGS": "--xla_disable_hlo_passes=algsimp", "NPROC": "3"}


def test_launched_processes_share_the_mesh_devices():
    """Under `srun --ntasks=2` or `mpirun -n 2` (no dist.* keys) each CPU-only process asks for
    its half of the mesh's devices, and only the first says so; a batch script's own process
    (`sbatch --ntasks=2` without `srun`: no SLURM_STEP_NODELIST, as seen on a real SLURM) is one
    process with all of them. The real `srun` run that trains 2 x 4 like 1 x 8 is
    `make test-slurm` (scripts/slurm_check.sh)."""
    # One process for every case (importing the trainer is most of its cost): each case is the
    # environment a launched process would have, given as `env`, which stands for os.environ; the
    # process has not started JAX, as a launched one has not.
    code = ("import json, sys; from configs import load_config; from ops.xla_env import set_cpu_device_count\n"
            f"cfg = load_config({TINY!r}, ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'])\n"
            "for env in json.load(sys.stdin):\n"
            "    set_cpu_device_count(cfg, env); print(env['XLA_FLAGS']); print('--', flush=True)")
    srun = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    cases = {  # name: (environment, devices per process, whether this process says so)
        "srun task 0": ({**srun, "SLURM_PROCID": "0"}, 4, True),
        "srun task 1": ({**srun, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, 4, False),
        "mpirun rank 0": ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, 4, True),
        "mpirun rank 1": ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 4, False),
        "sbatch --ntasks=2, no srun": ({k: v for k, v in srun.items() if k != "SLURM_STEP_NODELIST"}
                                       | {"SLURM_PROCID": "0"}, 8, True),
    }
    envs = [{**_env_without_device_count(), **launcher} for launcher, _, _ in cases.values()]
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(envs), capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=_env_without_device_count())
    assert out.returncode == 0, out.stderr
    outputs = out.stdout.split("--\n")
    assert outputs[-1] == "" and len(outputs) == len(cases) + 1, out.stdout
    for (name, (launcher, local, says)), output in zip(cases.items(), outputs):
        each = " per process" if local == 4 else ""
        said = [f"the mesh names 8 devices: running {local} CPU devices{each} on this CPU-only machine "
                f"(XLA_FLAGS --xla_force_host_platform_device_count={local}, set by train.py)"] if says else []
        *lines, flags = output.splitlines()
        assert lines == said and f"--xla_force_host_platform_device_count={local}" in flags.split(), (name, output)
        assert KEEP_COLLECTIVES_IN_LOOPS in flags.split(), (name, output)


def test_compile_cache_serves_a_second_run(tmp_path):
    """run.compile_cache: the first run fills the directory; an identical second run (a fresh
    run.dir, as after a lost disk) finds every program there and adds nothing."""
    cache = tmp_path / "cache"

    def train(name: str) -> set[str]:
        out = _cli("--config", TINY, "mesh.fsdp=8", "train.steps=2", f"run.dir={tmp_path / name}",
                   f"data.path={stdlib_glob('json')}", f"run.compile_cache={cache}")
        assert out.returncode == 0, out.stderr
        return set(os.listdir(cache))

    first = train("a")
    assert any(name.startswith("jit_train_step") for name in first), first
    assert train("b") == first


def test_plot_writes_beside_the_runs_by_default(tmp_path, monkeypatch, capsys):
    """`python -m ops.plot RUN` run from a checkout leaves the checkout alone: the PNG goes
    into the run directory (for several runs, their common parent)."""
    from ops import plot as plot_module

    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        (runs / name / "metrics.jsonl").write_text(
            '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": null, "finite": 0}\n{"step": 3, "loss": 4.0}\n')
    checkout = tmp_path / "checkout"
    checkout.mkdir()

    def plot(*run_dirs: str) -> str:
        out = subprocess.run([sys.executable, "-m", "ops.plot", *run_dirs], capture_output=True, text=True,
                             cwd=checkout, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert plot(str(runs / "a")) == f"wrote {runs / 'a' / 'loss_curves.png'}"
    assert (runs / "a" / "loss_curves.png").stat().st_size > 0
    # Its main in this process, from the checkout too: a second process would add only its
    # start-up (importing the trainer package, 1.5-2 CPU s) to what the first one showed.
    monkeypatch.chdir(checkout)
    capsys.readouterr()
    assert plot_module.main(["../runs/a", "../runs/b"]) == 0
    assert capsys.readouterr().out.strip() == "wrote ../runs/loss_curves.png"
    assert (runs / "loss_curves.png").stat().st_size > 0
    assert os.listdir(checkout) == [], "nothing is written into the working directory"


def test_planner_tables_name_layouts_one_way_and_show_tiny_step_times(capsys):
    """`plan.py --search`: a layout refused before compiling is named like a ranked one
    (`data=8 fsdp=1`, not `mesh.pipeline=1 mesh.data=8 ...`), and a tiny model's microsecond
    step time keeps its digits instead of printing 0.000."""
    from planner.report import print_search

    timed = {"step_s": 2.34e-5, "mfu": 0.01, "compute_s": 2.0e-5, "exposed_comm_s": 3.4e-6, "overlapped_comm_s": 0.0,
             "bubble": 0.0}
    plan = {
        "compiler": "XLA CPU", "config": "tiny", "devices": 8,
        "hardware": {"name": "h100", "memory_budget": 76e9},
        "plans": [
            {"status": "fits", "layout": {"pipeline": 1, "data": 8, "fsdp": 1, "tensor": 1}, "remat": "none",
             "memory": {"total": 1e6}, "traffic": {"ratio": 1.0}, "time": timed},
            {"status": "invalid", "reason": "model.num_heads=16 is not divisible by 32",
             "overrides": ["mesh.pipeline=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8", "model.remat=none"]},
        ],
    }
    print_search(plan)
    ranked, refused = capsys.readouterr().out.splitlines()[4:6]
    assert ranked.startswith("| 1 | data=8 fsdp=1 | none | fits | 0.00 | 2.34e-05 | 1.0% | 1.00 | 2e-05 | 3.4e-06 | 0 | 0.000 |"), ranked
    assert refused.startswith("| - | data=1 fsdp=1 tensor=8 | "), refused
