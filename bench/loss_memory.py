"""Compiler-estimated temporary memory of the output head + cross-entropy gradient, whole
against chunked (`model.loss_chunk`), for the Llama-3 vocabulary. No device memory is used:
the functions are compiled for abstract inputs.

    python -m bench.loss_memory                         # batch 4 x 4096, d_model 2048, vocab 128256
    python -m bench.loss_memory --chunks 256 512 1024
"""

from __future__ import annotations

import argparse
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs import load_config
from model import Transformer
from model.loss import chunked_cross_entropy_sum, cross_entropy_sum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    args = parser.parse_args()
    cfg = load_config("llama3-1b", ["model.num_layers=1"]).model  # only the head matters here
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((args.batch, cfg.seq_len, cfg.d_model), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((args.batch, cfg.seq_len), jnp.int32)

    def loss(chunk: int) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
        def f(params: nnx.State, x: jax.Array, t: jax.Array) -> jax.Array:
            model = nnx.merge(graphdef, params)
            w = jnp.ones(t.shape, jnp.float32)
            if chunk:
                return chunked_cross_entropy_sum(model, x, t, w, chunk)
            return cross_entropy_sum(model.logits(x), t, w)

        return f

    print(f"batch {args.batch} x {cfg.seq_len}, d_model {cfg.d_model}, vocab {cfg.vocab_size}")
    print("| loss_chunk | temporaries GiB |\n| --- | --- |")
    for chunk in [0, *args.chunks]:
        compiled = jax.jit(jax.grad(loss(chunk), argnums=(0, 1))).lower(state, x, t).compile()
        print(f"| {chunk} | {compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} |")


if __name__ == "__main__":
    main()
