"""cuDNN's ring blocks against the float32 reference blocks, on a GPU (model/ring_blocks.py).

The ring's algebra is checked on CPU with the reference blocks (tests/test_fused_ring.py); what
only a GPU can say is that cuDNN meets the same contract: its forward's log-sum-exp is the
natural-log one of the scaled scores, and its backward, handed a whole softmax's output and
log-sum-exp, returns that block's share of the gradients. For each case (causal own block, an
unmasked half block, grouped kv heads, a narrower v) this prints the largest difference of every
output from the reference's on the same bf16 inputs, relative to the reference's largest value,
and exits 1 if one is over TOLERANCE (bf16 rounding of outputs and gradients). Then the step time
of the fused ring on one GPU (one shard: the own block) against XLA attention's.

    python -m bench.ring_blocks          # on a GPU; bench/gpu_session.sh ring
    python -m bench.ring_blocks --dry    # the script itself on CPU: the reference against itself, small
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from model.attention import xla_attention
from model.ring_blocks import CUDNN, REFERENCE, BlockGrads, BlockKernel
from sharding.fused_ring import FusedRing, fused_ring_attention

TOLERANCE = 0.02
# (name, t, s, heads, kv heads, head dim, v head dim, causal)
CASES = [("own block, causal", 1024, 1024, 16, 4, 128, 128, True),
         ("half block, unmasked", 512, 512, 16, 4, 128, 128, False),
         ("multi-query, unmasked", 512, 1024, 8, 1, 64, 64, False),
         ("narrower v (latent attention)", 512, 512, 8, 8, 128, 64, True)]


def _inputs(t: int, s: int, h: int, kv: int, d: int, dv: int) -> list[jax.Array]:
    ks = jax.random.split(jax.random.key(0), 4)
    shapes = [(2, t, h, d), (2, s, kv, d), (2, s, kv, dv), (2, t, h, dv)]
    return [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k, shape in zip(ks, shapes)]


def _outputs(kernel: BlockKernel, x: list[jax.Array], causal: bool) -> dict[str, jax.Array]:
    q, k, v, dout = x
    out, lse = jax.jit(kernel.forward, static_argnums=3)(q, k, v, causal)
    # Both backwards get the reference's statistics: only the kernel's arithmetic differs.
    ref_out, ref_lse = jax.jit(REFERENCE.forward, static_argnums=3)(q, k, v, causal)
    grads = jax.jit(kernel.backward, static_argnums=1)(BlockGrads(q, k, v, ref_out, ref_lse, dout), causal)
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


def check(kernel: BlockKernel) -> bool:
    ok = True
    print(f"{'case':32} " + " ".join(f"{n:>8}" for n in ("out", "lse", "dq", "dk", "dv")))
    for name, t, s, h, kv, d, dv, causal in CASES:
        x = _inputs(t, s, h, kv, d, dv)
        ours, ref = _outputs(kernel, x, causal), _outputs(REFERENCE, x, causal)
        errors = {key: float(jnp.abs(ours[key].astype(jnp.float32) - ref[key].astype(jnp.float32)).max()
                             / jnp.abs(ref[key].astype(jnp.float32)).max()) for key in ref}
        ok &= all(e <= TOLERANCE for e in errors.values())
        print(f"{name:32} " + " ".join(f"{e:8.4f}" for e in errors.values()))
    return ok


def _seconds(fn, *args: jax.Array) -> float:  # noqa: ANN001
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(10):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / 10


def timing(kernel: BlockKernel, t: int) -> None:
    """Forward and backward of one causal block of `t` positions, 32 heads (8 kv) of 128: `kernel`
    as the ring's own block against XLA attention."""
    q, k, v, dout = _inputs(t, t, 32, 8, 128, 128)
    q, k, v, dout = (a[:1] for a in (q, k, v, dout))
    ring = FusedRing("", 1, kernel, False)
    fused = jax.grad(lambda q, k, v: (fused_ring_attention(q, k, v, ring) * dout).sum(), argnums=(0, 1, 2))
    plain = jax.grad(lambda q, k, v: (xla_attention(q, k, v, None) * dout).sum(), argnums=(0, 1, 2))
    print(f"forward+backward, 1 x {t}, 32 heads: {kernel.name} ring block {_seconds(fused, q, k, v) * 1e3:.2f} ms, "
          f"XLA attention {_seconds(plain, q, k, v) * 1e3:.2f} ms")


def main() -> int:
    dry = "--dry" in sys.argv[1:]
    if jax.default_backend() != "gpu" and not dry:
        print("bench.ring_blocks needs a GPU (cuDNN); the ring's algebra is tests/test_fused_ring.py on CPU")
        return 2
    kernel = REFERENCE if dry else CUDNN
    ok = check(kernel)
    timing(kernel, 512 if dry else 8192)
    print(f"{kernel.name} meets the ring-block contract" if ok else
          f"{kernel.name} differs from the reference by over {TOLERANCE}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
