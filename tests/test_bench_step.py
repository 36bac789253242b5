"""The step benchmark runs on CPU (what CI can check of it) and the stack's XLA flags are set
without overriding the user's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from bench.procs import cpu_env
from conftest import ROOT, require, stdlib_glob
from trainer.host_memory import USER_SETTINGS, reuse_host_memory
from trainer.xla_env import GPU_DEFAULTS, set_default_flags


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
    # (1.5 CPU s of importing JAX and the trainer for one line).
    from bench.step import main

    assert main([*cmd[3:5], "model.loss_chunk=5"]) == 2
    assert "model.loss_chunk" in capsys.readouterr().err


def test_the_attention_block_benchmark_prints_a_row_per_block(capsys):
    from bench.attention_blocks import main

    assert main(["--config", "tiny", "--seq", "32", "--batch", "2", "--blocks", "32,8", "--calls", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 32 ", "| 8 "))]
    assert [r.split(" |")[0] for r in rows] == ["| 32 (one block)", "| 8"]
    diffs = [float(r.rstrip(" |").rsplit("| ", 1)[1]) for r in rows]
    assert diffs[0] == 0 and 0 < diffs[1] < 1e-5  # blocks of 8 really run other matmuls, to float32 rounding


def test_the_thread_profile_accounts_for_the_traced_wall_time(capsys):
    """bench.cpu_threads splits the traced steps' wall time by how many XLA:CPU pool threads
    work (the shares add up to the whole window) and names the operations by their HLO op."""
    from bench.cpu_threads import main

    assert main(["--config", "tiny", "--steps", "2", "--top", "3", "mesh.data=1"]) == 0
    out = capsys.readouterr().out
    shares = [float(m) for m in re.findall(r"^\| \d+ \| \d+ \| ([0-9.]+)% \|$", out, re.M)]
    assert len(shares) >= 2 and abs(sum(shares) - 100) < 0.5, out  # at least idle and one thread busy
    ops = re.findall(r"^\| (\S[^|]*) \| [0-9.]+ \| [0-9.]+ \| \d+% \|$", out, re.M)
    # A matmul among them: XLA's (dot_general) or the CPU matmul kernel's (ffi_call).
    assert len(ops) == 3 and any(re.search(r"dot_general|ffi_call", op) for op in ops), out
    assert main(["--config", "tiny", "model.attention_block=-1"]) == 2
    assert "model.attention_block" in capsys.readouterr().err


# A fresh process (the settings must precede its threads' first allocations, as train.py makes
# them before JAX starts): threads one after the other each allocate a block the size of a
# small step's temporaries, write it whole and free it, as XLA:CPU's pool threads do a step's.
MALLOC_PROBE = """
import ctypes, resource, sys, threading
from trainer.host_memory import reuse_host_memory
print(reuse_host_memory(sys.argv[1], {}))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
SIZE, faults = 200 << 20, []
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
for _ in range(4):
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
print(faults)
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_freed_step_block_is_reused_not_faulted_in_again(mode: str):
    """run.reuse_host_memory (trainer/host_memory.py): with it, only the first of four 200 MB
    blocks allocated and freed in turn by four threads is faulted in (51,200 pages), the others
    reuse its pages; without it glibc maps and unmaps each one, and every one faults whole. (The
    whole default step: bench.step's page faults per step, BENCHMARKS.md "The CPU step".)"""
    env = {k: v for k, v in cpu_env(1).items() if k not in USER_SETTINGS}
    done = subprocess.run([sys.executable, "-c", MALLOC_PROBE, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    note, faults = done.stdout.rstrip("\n").split("\n")
    faults = json.loads(faults)
    pages = (200 << 20) // 4096
    assert faults[0] >= pages * 0.9, faults  # the first block is new memory either way
    if mode == "on":
        assert note.endswith("kept for the next step (run.reuse_host_memory)") and max(faults[1:]) < 100, faults
    else:
        assert note == "" and min(faults[1:]) >= pages * 0.9, faults


def test_host_memory_is_left_to_the_users_settings_and_to_accelerators():
    assert reuse_host_memory("auto", {"MALLOC_ARENA_MAX": "4"}) == "host memory: left to the user's MALLOC_ARENA_MAX"
    assert reuse_host_memory("auto", {"JAX_PLATFORMS": "cuda"}) == ""  # may run on a GPU: auto leaves it
    assert reuse_host_memory("off", {}) == ""
    # This process's JAX has started (its pool threads have their arenas): nothing to change.
    jax.devices()
    assert reuse_host_memory("on", {"JAX_PLATFORMS": "cuda"}).endswith("JAX had already started in this process")


def test_default_flags_never_override_the_users():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert set_default_flags(env) == [] and env["XLA_FLAGS"].endswith("=false")
    empty: dict[str, str] = {}
    assert len(set_default_flags(empty)) == len(GPU_DEFAULTS) and "latency_hiding" in empty["XLA_FLAGS"]


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
    # flags it first shows in the 6 printed decimals at step 5 (step 3: 5.140326 both).
    cmd = [sys.executable, "-m", "bench.precision", "--config", "tiny", "--steps", "5", *flags, "mesh.data=1",
           "train.global_batch=8", f"data.path={stdlib_glob('json')}"]
    done = subprocess.run(cmd, cwd=ROOT, env=cpu_env(1), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith(header) for line in done.stdout.splitlines()), done.stdout[-600:]
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
