"""Memory of the sequence split on XLA attention: for each layout of the tiny preset at 512 tokens
with packed documents, the peak resident memory of a real `train.py` run of 3 steps on 8 fake CPU
devices (the one process that holds them), and the per-device temporaries of the same step
compiled for 8 H100s by XLA's GPU compiler (`plan.py`).

    python -m bench.context_memory
    python -m bench.context_memory --layouts "context=8" --no-h100
    python -m bench.context_memory --extra model.attention_chunk=64    # XLA attention 64 queries at a time

The host figure is a CPU figure: it shows what grows with the split, not a GPU's memory; the H100
column is the real compiler's. A layout whose run is killed (out of memory) reports its exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

from bench.procs import ROOT, cpu_env

LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "context=2 x fsdp=2 x tensor=2": ["mesh.data=1", "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "context=4 x data=2": ["mesh.data=2", "mesh.context=4"],
    "context=8": ["mesh.data=1", "mesh.context=8"],
}
SHAPE = ["model.seq_len=512", "data.packing=document"]
GB = 1e9


def host_peak(layout: list[str], run_dir: str) -> tuple[float | None, int]:
    """(peak resident bytes of `train.py` on 8 fake CPU devices for 3 steps, its exit status), in a
    child of a child so that the peak is that run's alone (RUSAGE_CHILDREN keeps the largest child)."""
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config", "tiny", *SHAPE, *layout, "train.steps=3",
            f"run.dir={run_dir}"]
    probe = ("import json, resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL).returncode; print(json.dumps([resource.getrusage("
             "resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code]))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], env=cpu_env(8), cwd=ROOT, capture_output=True,
                          text=True)
    peak, code = json.loads(done.stdout.strip().splitlines()[-1])
    return (float(peak) if code == 0 else None), code


def h100_temps(layout: list[str]) -> float | None:
    """Per-device temporaries of the step compiled for 8 H100s, as `plan.py --out` reports them;
    None where the compile failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        subprocess.run([sys.executable, "plan.py", "--config", "tiny", "--devices", "8", "--hardware", "h100", *SHAPE,
                        *layout, "--out", out], cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(out):
            return None
        with open(out) as f:
            plan = json.load(f)["plans"][0]
    return plan["memory"]["temps"] if plan.get("status") != "failed" else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.context_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    parser.add_argument("--no-h100", action="store_true", help="skip the H100 compiles")
    parser.add_argument("--extra", nargs="*", default=[], metavar="key=value", help="overrides added to every layout")
    args = parser.parse_args(argv)
    fmt = lambda v: "-" if v is None else f"{v / GB:.2f}"  # noqa: E731
    print("| layout | host peak GB (train.py, 3 steps, 8 CPU devices) | H100 temps GB/device |")
    print("| --- | --- | --- |")
    for name in args.layouts.split(","):
        layout = LAYOUTS[name] + args.extra
        with tempfile.TemporaryDirectory() as tmp:
            peak, code = host_peak(layout, os.path.join(tmp, "run"))
        host = fmt(peak) if peak is not None else f"exit {code}"
        h100 = None if args.no_h100 else h100_temps(layout)
        print(f"| {name} | {host} | {fmt(h100)} |", flush=True)
    print(f"(max RSS of this process's children: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6:.2f} GB)")


if __name__ == "__main__":
    main()
