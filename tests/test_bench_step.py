"""The step benchmark runs on CPU (what CI can check of it) and the stack's XLA flags are set
without overriding the user's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench.procs import cpu_env
from conftest import ROOT, require, stdlib_glob
from ops.xla_env import GPU_DEFAULTS, set_default_flags
from sharding.hardware import HARDWARE


def test_the_step_benchmark_prints_a_row_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    env = cpu_env(2)
    cmd = [sys.executable, "-m", "bench.step", "--config", "tiny", "--steps", "2", "--warmup", "1",
           "--json", str(out), "mesh.data=2", "model.loss_chunk=8"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    row = done.stdout.strip().splitlines()[-1]
    assert row.startswith("| 2 x cpu | tiny mesh.data=2 model.loss_chunk=8 | 16 x 32 |")
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["compile_s"] > 0 and r["peak_memory_gib"] > 0
    assert r["mfu"] is None  # no known peak for a CPU: no made-up MFU
    # Bad input is refused by its main before JAX does anything: run here, not in a second process
    # (seconds of importing JAX and the trainer for one line).
    from bench.step import main

    assert main([*cmd[3:5], "model.loss_chunk=5"]) == 2
    assert "model.loss_chunk" in capsys.readouterr().err


def test_default_flags_never_override_the_users():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
    assert set_default_flags(env) == [] and env["XLA_FLAGS"].endswith("=false")
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".5"
    empty: dict[str, str] = {}
    assert len(set_default_flags(empty)) == len(GPU_DEFAULTS) and "latency_hiding" in empty["XLA_FLAGS"]
    # JAX's GPU pool is what the planner budgets (HARDWARE's memory less its reserve), not JAX's own 75%.
    assert float(empty["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(
        HARDWARE["h200"].memory_budget / HARDWARE["h200"].memory_bytes)


def test_the_precision_check_passes_wandering_and_fails_a_sustained_offset():
    """bench.precision's verdict: single steps that wander apart and back are within 2%; the same
    curve 3% high throughout (what a bf16 softmax or loss would do) is not."""
    from bench.precision import compare

    f32 = np.linspace(5.0, 2.5, 50)
    wander = f32 * (1 + 0.03 * np.sin(np.arange(50) * np.pi / 2))  # +-3% single steps, zero mean
    assert np.abs(wander - f32).max() / f32.min() > 0.02  # the steps really differ by more than 2%
    lines, ok = compare(f32, wander, 0.02)
    assert ok and lines[-1].endswith("within")
    lines, ok = compare(f32, f32 * 1.03, 0.02)
    assert not ok and lines[-1].endswith("EXCEEDED")


def test_the_precision_check_over_seeds_judges_the_mean_curve():
    """`--seeds`: the verdict is the mean curve's. Two seeds whose runs sit 3% off in opposite
    directions (trajectory noise) pass, each seed's own gap is still printed; a 3% offset on both
    (a precision bug) fails, as it does on one seed."""
    from bench.precision import compare, judge

    ref = np.stack([np.linspace(5.0, 2.5, 40), np.linspace(5.2, 2.4, 40)])
    noisy = ref * np.array([[1.03], [0.97]])
    assert not compare(ref[0], noisy[0], 0.02)[1] and not compare(ref[1], noisy[1], 0.02)[1]  # each alone fails
    lines, ok = judge(ref, noisy, 0.02)
    assert ok and "mean of 2 seeds" in lines[0] and "within" in lines[-3]
    assert lines[-2].startswith("run.seed=0 alone: largest 10-step gap +3.00%")
    assert lines[-1].startswith("run.seed=1 alone: largest 10-step gap -3.00%")
    lines, ok = judge(ref, ref * 1.03, 0.02)
    assert not ok and "EXCEEDED" in lines[-3]


@pytest.mark.parametrize("flags, header", [
    ([], "| step | float32 loss | bfloat16 loss |"),
    (["--grad-reduce"], "| step | float32 loss | float32, bf16 gradient reductions loss |"),
], ids=["dtypes", "grad-reduce"])
def test_the_precision_benchmark_runs_both_variants(tmp_path, flags, header):
    # The suite's XLA flags for both: their float32 runs are one program (the shared compilation
    # cache serves the second). 5 steps: the bf16 gradient reductions' rounding moves the loss by
    # a few 1e-6 only (Adam's update is near sign(g) in its first steps), and with the suite's
    # flags it first shows in the 6 printed decimals at step 5.
    cmd = [sys.executable, "-m", "bench.precision", "--config", "tiny", "--steps", "5", *flags, "mesh.data=1",
           "train.global_batch=8", f"data.path={stdlib_glob('json')}"]
    env = dict(cpu_env(1), TMPDIR=str(tmp_path))  # where the runs' directories go
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith(header) for line in done.stdout.splitlines()), done.stdout[-600:]
    assert not list(tmp_path.glob("bench-precision-*")), "the runs' directories are removed"
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 5 |")]
    assert len(rows) == 1
    ref, other = (float(x) for x in rows[0].split("|")[2:4])
    assert ref != other and abs(ref - other) < 0.02 * ref  # two real runs, close to each other


def test_the_cpu_peer_benchmark_times_both_sides():
    """bench.cpu_peer runs our compiled step and Hugging Face Llama under torch on the same shape
    (as many parameters) and prints a row for each (a 2-layer tiny shape, one timed step: this
    checks the script, not the speed)."""
    require("transformers", "hf")
    env = cpu_env(1)
    cmd = [sys.executable, "-m", "bench.cpu_peer", "--config", "tiny", "--steps", "1", "--warmup", "1",
           "model.num_layers=2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip().split(" ")[0]: line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"meshlm", "PyTorch"} <= set(rows), done.stdout
    params, speed = ({side: float(rows[side].split("|")[col].replace(",", "")) for side in ("meshlm", "PyTorch")}
                     for col in (2, 3))
    assert params["meshlm"] == params["PyTorch"] > 0  # the peer is the config's shape, parameter for parameter
    assert speed["meshlm"] > 0 and speed["PyTorch"] > 0
