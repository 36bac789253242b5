"""The xla attention's forward and backward alone, one query block size after another, on CPU.

    python -m bench.attention_blocks                              # the default model's layer shape
    python -m bench.attention_blocks --batch 4 --seq 1024 --blocks 1024,256,128,64,32

One layer's shape of the config (heads, kv heads, head_dim, batch, length; `--batch` and `--seq`
override the last two), random q, k and v, causal positions; each block size runs
`model.attention.query_blocked_attention` (the size of the sequence: the plain kernel) under
jit with its gradients. Prints the process CPU ms per call (core time, which the machine's other
load disturbs less than wall time) and the largest difference from the plain kernel's loss and
gradients, relative to the largest value of each. CPU figures only (BENCHMARKS.md, "The CPU step").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

from configs import ConfigError, load_config
from model.attention import query_blocked_attention


def time_block(args: tuple, block: int, calls: int) -> tuple[float, list]:
    """CPU ms per call of the attention's value and gradients at `block`, and the gradients."""
    q, k, v, positions = args

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = query_blocked_attention(q, k, v, positions, None, block=block)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1])))  # every output weighs differently

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    for _ in range(2):
        result = jax.block_until_ready(step(q, k, v))
    cpu0 = time.process_time()
    for _ in range(calls):
        jax.block_until_ready(step(q, k, v))
    return 1e3 * (time.process_time() - cpu0) / calls, jax.tree.leaves(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a YAML preset (path or name in configs/)")
    parser.add_argument("--batch", type=int, default=0, help="rows (0: train.global_batch)")
    parser.add_argument("--seq", type=int, default=0, help="length (0: model.seq_len)")
    parser.add_argument("--blocks", default="", help="comma-separated query block sizes (default: seq, 128, 64, 32, 16)")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per block size")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = cfg.model
    b, t = args.batch or cfg.train.global_batch, args.seq or m.seq_len
    blocks = [int(x) for x in args.blocks.split(",")] if args.blocks else [t, 128, 64, 32, 16]
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (b, t, m.num_heads, m.resolved_head_dim))
    k = jax.random.normal(kk, (b, t, m.num_kv_heads, m.resolved_head_dim))
    v = jax.random.normal(kv, (b, t, m.num_kv_heads, m.resolved_head_dim))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, plain = time_block((q, k, v, positions), t, 1)
    print(f"CPU only: {os.cpu_count()} cores; q [{b}, {t}, {m.num_heads}, {m.resolved_head_dim}], "
          f"{m.num_kv_heads} kv heads; float32; load average {os.getloadavg()[0]:.1f} at the start")
    print("| queries per block | CPU ms per call (forward + backward) | largest difference from one block (of the largest value) |")
    print("| --- | --- | --- |")
    for block in blocks:
        ms, got = time_block((q, k, v, positions), block, args.calls)
        diff = max(float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))) for a, r in zip(got, plain))
        print(f"| {block}{' (one block)' if block >= t else ''} | {ms:.0f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
