"""Time the real train step on the local devices: tokens/s, step time, MFU, TFLOP/s, peak
memory and compile time, on synthetic tokens.

    python -m bench.step --config configs/llama3-1b.yaml                       # one GPU
    python -m bench.step --config configs/llama3-1b.yaml train.global_batch=8 model.loss_chunk=512
    python -m bench.step --config tiny --steps 5 mesh.data=1                    # CPU, what CI runs

The step is compiled ahead of time (the same program `train.py` runs, state donated), warmed
up, then timed step by step, each blocked on its result; the table gives the median. The
throughput of the same steps run back to back without blocking is printed too: that is what the
training loop sees, as it reads metrics one step late.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from configs import Config, ConfigError, load_config
from data import batch_fields
from model import flops_per_token
from ops.metrics import peak_flops
from planner.compiled import compiled_stats
from trainer.program import Program, abstract_program
from trainer.state import init_state, param_count
from ops.xla_env import set_default_flags


def peak_memory(compiled: jax.stages.Compiled) -> tuple[float, str]:
    """Peak bytes on device 0: the allocator's own figure where it keeps one (GPU, TPU), else
    the compile's own figure (planner.compiled.compiled_stats: the planner's too)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return float(stats["peak_bytes_in_use"]), "allocator"
    return float(compiled_stats(compiled)["total_bytes"]), "compiler"


def compiled_step(cfg: Config, devices: list | None = None) -> tuple[Program, jax.stages.Compiled, float, Any, dict]:
    """The config's train step compiled (state donated), with the seconds it took, a fresh state
    and a batch of random tokens on the step's shardings: what the step benchmarks time."""
    program = abstract_program(cfg, devices)
    state = init_state(cfg.model, program.tx, cfg.run.seed, program.state_sh)
    step, compile_s = program.compile(state)
    rng = np.random.default_rng(0)
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    batch = {f: jax.device_put(rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32), program.batch_sh)
             for f in batch_fields(cfg, program.spec.objective.data_format)}
    return program, step, compile_s, state, batch


def bench(config: str | None, overrides: list[str], steps: int, warmup: int) -> dict:
    """Compiles and times the step (`cpu_ms`: the process CPU ms per timed step)."""
    cfg = load_config(config, [*overrides, "data.source=synthetic", "data.packing=concat"])
    program, step, compile_s, state, batch = compiled_step(cfg)
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    back_to_back = (time.perf_counter() - t0) / steps
    step_s = statistics.median(times)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    devices = jax.devices()
    flops = flops_per_token(cfg.model) * tokens / step_s / len(devices)  # per device
    peak = peak_flops(devices[0])
    memory, source = peak_memory(step)
    return {
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "config": config or "default",
        "overrides": " ".join(overrides),
        "params_m": param_count(program.spec.model.shapes) / 1e6,
        "batch": cfg.train.global_batch,
        "seq": cfg.model.seq_len,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_back_to_back": tokens / back_to_back,
        "step_ms": 1e3 * step_s,
        "tflops_per_device": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_memory_gib": memory / 2**30,
        "memory_from": source,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "cpu_ms": cpu_ms,
        "page_faults_per_step": faults,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a YAML preset (path or name in configs/)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compile")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    set_default_flags()
    try:
        r = bench(args.config, args.overrides, args.steps, args.warmup)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    print("| device | config | batch x seq | tokens/s | back-to-back | step ms | TFLOP/s/dev | MFU | peak GiB | compile s "
          "| page faults/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {r['device']} | {r['config']} {r['overrides']} | {r['batch']} x {r['seq']} | {r['tokens_per_s']:,.0f} | "
          f"{r['tokens_per_s_back_to_back']:,.0f} | {r['step_ms']:.1f} | {r['tflops_per_device']:.2f} | {mfu} | "
          f"{r['peak_memory_gib']:.2f} ({r['memory_from']}) | {r['compile_s']:.1f} | {r['page_faults_per_step']:,.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
