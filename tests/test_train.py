"""End-to-end training on 8 fake CPU devices: every layout learns the same thing, gradient
accumulation equals one big batch, and resuming from a checkpoint is bitwise exact."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

import trainer
from configs import Config


STEPS = 4
# Every STEPS-step run here warms up over one step: the one-device run is then also the first
# run of test_extending_a_run_continues_its_schedule, which extends it (one run fewer).
WARMUP = "optim.warmup_steps=1"
# tests/test_quant.py's full-precision runs are these programs (served by the compilation cache).
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "fsdp=2,tensor=4": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"],
}


def losses(history: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in history])


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """(run dir, history) of a STEPS-step run on one device; test_extending_a_run_continues_its_schedule
    extends that run dir (the other tests read only the history)."""
    from configs import load_config
    from conftest import ROOT, stdlib_glob

    run_dir = str(tmp_path_factory.mktemp("ref") / "run")
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", "train.log_every=1", f"train.steps={STEPS}", "mesh.data=1",
         WARMUP],
    )
    history = trainer.run(cfg, devices=jax.devices()[:1])
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    return run_dir, history


@pytest.fixture(scope="module")
def one_device_losses(one_device_run: tuple[str, list[dict]]) -> np.ndarray:
    return losses(one_device_run[1])


def test_the_loss_moves(one_device_losses):
    assert one_device_losses[-1] < one_device_losses[0] - 0.1, "a comparison of flat curves proves nothing"


class LayoutRuns:
    """layout -> the history of its STEPS-step run, each run once in the module (its program
    compiles once: the accumulation and resume tests below run on these layouts and horizon
    too), and the config of that run (the finished-run tests read its run.dir)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict[str, tuple[Config, list[dict]]] = {}

    def _run(self, layout: str) -> tuple[Config, list[dict]]:
        from configs import load_config
        from conftest import ROOT, stdlib_glob

        if layout not in self.runs:
            cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
                f"run.dir={self.tmp_path_factory.mktemp('layout') / 'run'}", f"data.path={stdlib_glob('json')}",
                "train.log_every=1", f"train.steps={STEPS}", WARMUP, *LAYOUTS[layout]])
            self.runs[layout] = cfg, trainer.run(cfg)
        return self.runs[layout]

    def __call__(self, layout: str) -> list[dict]:
        return self._run(layout)[1]

    def config(self, layout: str) -> Config:
        return self._run(layout)[0]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    return LayoutRuns(tmp_path_factory)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_same_losses(layout_runs, one_device_losses, layout):
    np.testing.assert_allclose(losses(layout_runs(layout)), one_device_losses, rtol=2e-5)


def test_gradient_accumulation_equals_one_big_batch(tiny, layout_runs):
    """16 rows in 4 micro-batches of 4 (each split over the data and fsdp shards) give the same
    update as one batch of 16."""
    big = layout_runs("data=2,fsdp=2,tensor=2")
    accumulated = trainer.run(tiny(f"train.steps={STEPS}", WARMUP, *LAYOUTS["data=2,fsdp=2,tensor=2"],
                                   "train.grad_accum=4"))
    np.testing.assert_allclose(losses(accumulated), losses(big), rtol=2e-5)
    grad_norms = [r["grad_norm"] for r in big], [r["grad_norm"] for r in accumulated]
    np.testing.assert_allclose(*grad_norms, rtol=1e-4)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.head_dim=8", "model.head_dim=8 differs from 4 in the checkpoints of run.dir="),
        ("model.mla.kv_lora_rank=32", "model.mla.kv_lora_rank=32 differs from 64 in the checkpoints of run.dir="),
        ("model.lora.targets=[q,v]",
         "model.lora.targets=['q', 'v'] differs from ['q', 'k', 'v', 'o'] in the checkpoints of run.dir="),
        ("data.eval_fraction=0.1", "data.eval_fraction=0.1 differs from 0.02 in the checkpoints of run.dir="),
        ("run.seed=1", "run.seed=1 differs from 0 in the checkpoints of run.dir="),
        ("model.head_dim=4", None),  # what the saved head_dim=0 resolves to: the same shapes
        ("train.steps=9", None),  # not marked: a resume may change it
    ],
)
def test_resume_refuses_a_changed_key_fixed_on_resume(tiny, tmp_path, override, message):
    """A run.dir with checkpoints takes a config that changes a key marked `Resume` with one
    ConfigError line naming that key, before anything is read or written; other keys pass."""
    from configs import ConfigError, dump_config
    from trainer.checkpoint import check_resumable

    old = tiny("model.head_dim=0")
    os.makedirs(os.path.join(old.run.dir, "checkpoints", "2"))
    with open(os.path.join(old.run.dir, "config.yaml"), "w") as f:
        f.write(dump_config(old))
    new = tiny("model.head_dim=0", override)
    if message is None:
        check_resumable(new)
        return
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        check_resumable(new)


def test_resume_is_bitwise_exact(tiny, tmp_path, capsys, layout_runs):
    """2 steps planned over the fsdp=8 run's horizon (optim.decay_steps=STEPS: the same rates),
    then resumed to STEPS: that run's losses, bit for bit."""
    common = [f"optim.decay_steps={STEPS}", "checkpoint.every=2", WARMUP, *LAYOUTS["fsdp=8"]]
    straight = layout_runs("fsdp=8")
    capsys.readouterr()
    resumed_dir = tmp_path / "resumed"
    first = trainer.run(tiny("train.steps=2", *common, f"run.dir={resumed_dir}"))
    assert "resumed from" not in capsys.readouterr().out
    second = trainer.run(tiny(f"train.steps={STEPS}", *common, f"run.dir={resumed_dir}"))
    assert "resumed from step 2" in capsys.readouterr().out
    assert [r["step"] for r in second] == [3, 4]
    np.testing.assert_array_equal(losses(first + second), losses(straight))
    # metrics.jsonl is appended across invocations, never truncated.
    assert [r["step"] for r in read_metrics(resumed_dir)] == list(range(1, STEPS + 1))
    # The config that wrote the first checkpoints is kept beside the new one.
    from configs import load_config

    assert load_config(str(resumed_dir / "config.step2.yaml")).train.steps == 2
    assert load_config(str(resumed_dir / "config.yaml")).train.steps == STEPS


def _snapshot(run_dir) -> dict[str, tuple]:
    """Every path under run_dir: a file's bytes and modification time, a directory's presence."""
    out = {}
    for d, dirs, files in os.walk(run_dir):
        for name in dirs:
            out[os.path.join(d, name)] = ("dir",)
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[path] = (f.read(), os.stat(path).st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def finished_run(layout_runs: LayoutRuns) -> Config:
    """The config of a run finished to its end: the STEPS-step data=8 run of the layout test
    (two tests below read its run.dir; neither changes it, as the first checks)."""
    return layout_runs.config("data=8")


def test_a_finished_run_does_nothing_more_and_changes_nothing(tiny, capsys, finished_run):
    """Rerunning a finished run, with the same train.steps or a smaller one, trains nothing and
    writes nothing: no new config.yaml or config.step<N>.yaml, no summary.json invocation."""
    cfg = finished_run
    before = _snapshot(cfg.run.dir)
    assert {"config.yaml", "summary.json", "metrics.jsonl"} <= set(os.listdir(cfg.run.dir))
    capsys.readouterr()
    for steps in (STEPS, STEPS - 1):
        assert trainer.run(tiny(f"train.steps={steps}", WARMUP, f"run.dir={cfg.run.dir}")) == []
        assert f"nothing to do: the checkpoint at step {STEPS} has reached train.steps={steps}; " \
               f"{cfg.run.dir} is left as it was" in capsys.readouterr().out
        assert _snapshot(cfg.run.dir) == before


def test_run_dir_holds_config_metrics_and_checkpoints(finished_run):
    from configs import load_config

    cfg = finished_run
    # The resolved config: optim.decay_steps (0: train.steps at the start) is written as the horizon used.
    assert cfg.optim.decay_steps == 0
    resolved = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=STEPS))
    assert load_config(os.path.join(cfg.run.dir, "config.yaml")) == resolved
    records = read_metrics(cfg.run.dir)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_s"):
        assert key in records[-1]
    assert "mfu" not in records[-1], "CPU has no known peak"
    assert sorted(os.listdir(os.path.join(cfg.run.dir, "checkpoints"))) == [str(STEPS)]


def test_learning_rate_schedule():
    from configs import load_config
    from trainer.optimizer import lr_schedule

    cfg = load_config("tiny", ["optim.lr=1.0", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"]).optim
    lrs = [float(lr_schedule(cfg, 20)(s)) for s in range(20)]
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])), "cosine decay is monotone"
    np.testing.assert_allclose(lrs[-1], 0.1, rtol=1e-5)


def test_a_skipped_step_holds_the_schedule_back(tiny):
    """`debug.nan_steps=2` skips the update of step 2, so step 3 applies the optimizer's second
    update, at the rate of update 1, and logs that rate, not schedule(state.step)."""
    from trainer.optimizer import lr_schedule

    # The data=8 layout run's program (its schedule: WARMUP, over STEPS): a compile served by the cache.
    cfg = tiny("train.steps=3", "debug.nan_steps=2", *LAYOUTS["data=8"], WARMUP, f"optim.decay_steps={STEPS}")
    history = trainer.run(cfg)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    assert [r["skipped_steps"] for r in history] == [0, 1, 1]
    assert float(schedule(1)) != float(schedule(2)), "a flat schedule cannot tell the two apart"
    np.testing.assert_allclose([r["lr"] for r in history], [schedule(0), schedule(1), schedule(1)], rtol=1e-6)


def test_the_logged_lr_is_the_one_the_update_applied(tiny):
    """After a skipped step, a step's update equals, bit for bit, the same update without the
    skip (the one whose count the optimizer has reached), and the two log the same rate."""
    from sharding import activation_rules
    from trainer.optimizer import lr_schedule
    from trainer.program import abstract_program
    from trainer.state import init_state

    cfg = tiny(*LAYOUTS["data=8"], WARMUP, f"optim.decay_steps={STEPS}")  # the data=8 layout run's program
    program = abstract_program(cfg)
    step, _ = program.compile()
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (16, cfg.model.seq_len + 1), 0, 257))
    good = {"tokens": jax.device_put(tokens, program.batch_sh)}
    poisoned = {"tokens": jax.device_put(np.full_like(tokens, cfg.model.vocab_size), program.batch_sh)}
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        skipping, _ = step(init_state(cfg.model, program.tx, 0, program.state_sh), good)
        clean, _ = step(init_state(cfg.model, program.tx, 0, program.state_sh), good)
        skipping, bad = step(skipping, poisoned)
        skipping, after_skip = step(skipping, good)  # state.step 2 -> 3, the optimizer's second update
        clean, second = step(clean, good)  # state.step 1 -> 2, the optimizer's second update
    assert not bool(bad["finite"]) and int(skipping.step) == 3 and int(clean.step) == 2
    jax.tree.map(np.testing.assert_array_equal, skipping.params, clean.params)
    assert float(after_skip["lr"]) == float(second["lr"])
    assert float(after_skip["lr"]) != float(lr_schedule(cfg.optim, cfg.train.steps)(2))


def test_no_first_write_cost_is_timed_as_a_step(tmp_path):
    """In a fresh process (nothing imported yet), the second step, whose interval holds the first
    metrics write, is no slower than the steady steps: imports and writer set-up happen before the
    loop. (An import such as tensorboardX's inside that interval costs many steps' time.)"""
    from bench.procs import TINY, run
    from conftest import stdlib_glob

    code, out = run("--config", TINY, f"run.dir={tmp_path}", f"data.path={stdlib_glob('json')}", "train.steps=10",
                    "train.log_every=1", "checkpoint.every=1000", devices=1)
    assert code == 0, out
    step_s = {r["step"]: r["step_s"] for r in read_metrics(tmp_path)}
    steady = float(np.median([step_s[s] for s in range(3, 11)]))
    assert step_s[2] < 5 * steady, f"step 2 took {step_s[2]:.3f} s, the steady steps {steady:.3f} s: {step_s}"


def test_extending_a_run_continues_its_schedule(tiny, tmp_path, capsys, one_device_run):
    """A 4-step run (the one-device run above) extended to 6 keeps the horizon it started with
    (optim.decay_steps=4): its rates and losses equal, bit for bit, a 6-step run planned with
    that horizon, not those of a 6-step run (whose cosine decays over 6). A resume that changes
    the schedule says so."""
    assert STEPS == 4
    common = ["mesh.data=1", WARMUP]
    one = jax.devices()[:1]
    extended, first = one_device_run
    capsys.readouterr()
    second = trainer.run(tiny("train.steps=6", *common, f"run.dir={extended}"), devices=one)
    out = capsys.readouterr().out
    planned = trainer.run(tiny("train.steps=6", "optim.decay_steps=4", *common, f"run.dir={tmp_path / 'planned'}"),
                          devices=one)

    def lrs(history: list[dict]) -> list[float]:
        return [r["lr"] for r in history]

    from trainer.optimizer import lr_schedule

    def rates(decay_steps: int) -> list[float]:
        """The rates a 6-step run logs under the horizon decay_steps (0: train.steps, 6)."""
        optim = dataclasses.replace(tiny("train.steps=6", *common).optim, decay_steps=decay_steps)
        return [float(lr_schedule(optim, 6)(s)) for s in range(6)]

    # The planned run logs its schedule's rates, and a 6-step run's own horizon gives others from
    # step 3 (read off the schedule: running that run would cost one more compile and check no more).
    assert lrs(planned) == rates(4) and rates(0)[2:] != lrs(planned)[2:], "the two horizons must give different rates"
    assert lrs(first + second) == lrs(planned)
    np.testing.assert_array_equal(losses(first + second), losses(planned))
    assert "resumed from step 4\nthe learning-rate schedule keeps its horizon optim.decay_steps=4 (train.steps=6)" in out
    from configs import load_config

    assert load_config(os.path.join(extended, "config.yaml")).optim.decay_steps == 4, "the resolved horizon is recorded"
    trainer.run(tiny("train.steps=7", "optim.decay_steps=10", *common, f"run.dir={extended}"), devices=one)
    assert "the learning-rate schedule changes on this resume: optim.decay_steps 4 -> 10" in capsys.readouterr().out


def test_a_one_process_save_slices_no_replica_on_device(tmp_path, monkeypatch):
    """A one-process run on 8 devices saves each replicated array from one replica: no
    jit-compiled device slice per replica and array (orbax's replica-parallel default, which
    dominates a small run's first save), and the save resumes exactly as any other
    (test_resume_is_bitwise_exact and the fault tests)."""
    from bench.procs import TINY, run
    from conftest import stdlib_glob

    monkeypatch.setenv("JAX_LOG_COMPILES", "1")  # a fresh process logs every program it compiles
    code, out = run("--config", TINY, f"run.dir={tmp_path}", f"data.path={stdlib_glob('json')}", "train.steps=2",
                    "checkpoint.every=2", "optim.decay_steps=12")
    assert code == 0 and "Compiling jit(train_step)" in out, out[-2000:]
    assert "Compiling jit(slice)" not in out, [line for line in out.splitlines() if "jit(slice)" in line][:3]
    assert os.path.isdir(tmp_path / "checkpoints" / "2")
