"""Long-context benchmark on fake CPU devices: for each sequence length, `mesh.context` size and
strategy, the tiny model's train step is compiled on that many devices (one row per step) and
run; prints the compile's per-device memory (`memory_analysis()`), its collectives on the
`context` axis, and the tokens/s of a few steps.

    python -m bench.context
    python -m bench.context --seq 4096,8192 --context 1,2,4,8 --strategy allgather,ring --steps 3

A combination whose compile needs more than `--max-gib` per device is reported and not run
(the whole-sequence scores of `allgather` at long sequences). CPU figures: they compare the
strategies' memory and the scaling in `context`; they are no GPU or TPU speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__" and "jax" not in sys.modules:  # fake devices must be set before jax loads
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ops.xla_env import set_cpu_collective_env

    set_cpu_collective_env(8)  # the ring's collective-permutes: XLA:CPU's pool and loops (ops/xla_env.py)


def measure(seq: int, context: int, strategy: str, steps: int, max_gib: float) -> dict:
    import jax
    import numpy as np

    from bench.procs import TINY
    from configs import load_config
    from planner.hlo import collectives
    from trainer import abstract_program
    from planner.compiled import compiled_stats
    from trainer.state import init_state

    cfg = load_config(TINY, ["data.source=synthetic", "train.global_batch=1", "mesh.data=1", f"mesh.context={context}",
                             f"model.seq_len={seq}", f"context.strategy={strategy}"])
    program = abstract_program(cfg, jax.devices()[:context])
    compiled, seconds = program.compile()
    stats = compiled_stats(compiled)
    on_context = sorted({c.kind for c in collectives(compiled.as_text(), program.spec.layout.sizes, context)[0]
                         if "context" in c.axes})
    out = {"compile_s": seconds, "gib": stats["total_bytes"] / 2**30, "collectives": ",".join(on_context) or "-"}
    if out["gib"] > max_gib:
        return out | {"tokens_s": None}
    state = init_state(cfg.model, program.tx, 0, program.state_sh)
    tokens = np.random.default_rng(0).integers(0, 257, (1, seq + 1)).astype(np.int32)
    batch = {"tokens": jax.device_put(tokens, program.batch_sh)}
    state, metrics = compiled(state, batch)  # the first step, outside the timing
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    return out | {"tokens_s": seq * steps / (time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="4096,8192,16384,32768")
    ap.add_argument("--context", default="1,2,4,8")
    ap.add_argument("--strategy", default="allgather,ring")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=2.0, help="per device; above it the step is compiled, not run")
    args = ap.parse_args()
    print("| seq_len | context | strategy | GiB/device | collectives on context | tokens/s | compile s |")
    print("| ---: | ---: | --- | ---: | --- | ---: | ---: |")
    for seq in map(int, args.seq.split(",")):
        for context in map(int, args.context.split(",")):
            for strategy in args.strategy.split(","):
                r = measure(seq, context, strategy, args.steps, args.max_gib)
                speed = "not run" if r["tokens_s"] is None else f"{r['tokens_s']:.0f}"
                print(f"| {seq} | {context} | {strategy} | {r['gib']:.3f} | {r['collectives']} | {speed} | "
                      f"{r['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
