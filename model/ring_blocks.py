"""Fused attention on one block of a ring: the contract a flash kernel meets inside ring attention
(sharding/fused_ring.py), and its two implementations.

A ring step attends a device's queries to one other device's keys, so its result is one part of a
softmax whose other parts arrive later. A flash kernel returns the part's output and its
log-sum-exp (`forward`); the ring merges parts by their log-sum-exps. Backward, a flash kernel
given the *whole* softmax's output and log-sum-exp (not the block's) returns exactly the block's
share of dq, dk and dv (`backward`): p = exp(s - lse) is then the final probability, and
ds = p (dp - rowsum(dO * O)) needs no other block (FlashAttention-2, section 3.1.1).

- `CUDNN`: cuDNN's fused flash attention (GPU), through JAX's private cuDNN primitives (the public
  API drops the log-sum-exp's gradient and takes no given statistics for the backward).
- `splash_blocks(interpret)`: the TPU Pallas splash kernel that ships in JAX, through its private
  backward (the public kernel's VJP takes no given statistics); off TPU in Pallas interpret mode,
  slowly, which is how its contract is checked on CPU. Lengths a multiple of 128 (its tiles).
- `REFERENCE`: the same contract in float32 einsums, every [t, s] score formed: the oracle the
  ring is checked against on CPU, and cuDNN against it on a GPU.

Shapes: q [b, t, h, d], k [b, s, kv, d], v [b, s, kv, dv] (h a multiple of kv; query head i
reads kv head i // (h / kv)); out [b, t, h, dv]; lse [b, h, t] float32. `causal`: query i sees
key j <= i in array order (the ring calls it on a device's own block only, t == s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from model.splash import heads_first, scaled, splash_kernel

Array = jax.Array
# (q, k, v, causal) -> (out, lse)
ForwardFn = Callable[[Array, Array, Array, bool], tuple[Array, Array]]


class BlockGrads(NamedTuple):
    """What a block's backward reads: its queries, keys and values, and the whole softmax's
    output, log-sum-exp and output gradient for those queries."""

    q: Array
    k: Array
    v: Array
    out: Array
    lse: Array
    dout: Array


# (BlockGrads, causal) -> (dq, dk, dv)
BackwardFn = Callable[[BlockGrads, bool], tuple[Array, Array, Array]]


# The name of the fused ring's output and log-sum-exp as residuals (sharding/fused_ring.py), which
# the remat policy save_ring_attention keeps (configs/schema.py REMAT_SAVES).
RESIDUALS = "ring_attention"


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """A fused kernel's two halves on one ring block."""

    name: str
    forward: ForwardFn
    backward: BackwardFn


def _scores(q: Array, k: Array, causal: bool) -> Array:
    """[b, kv, g, t, s] float32 scaled scores, masked (-inf) above the diagonal when causal."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, h // kv, d), k,
                   preferred_element_type=jnp.float32) * d**-0.5
    if not causal:
        return s
    return jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)


def _grouped(a: Array, kv: int) -> Array:
    """[b, t, h, x] -> [b, t, kv, h / kv, x] float32."""
    b, t, h = a.shape[:3]
    return a.reshape(b, t, kv, h // kv, -1).astype(jnp.float32)


def _reference_forward(q: Array, k: Array, v: Array, causal: bool) -> tuple[Array, Array]:
    b, t, h, _ = q.shape
    s = _scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, kv, g, t]
    out = jnp.einsum("bkgts,bskd->btkgd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return out.reshape(b, t, h, -1).astype(q.dtype), lse.reshape(b, h, t)


def _reference_backward(x: BlockGrads, causal: bool) -> tuple[Array, Array, Array]:
    b, t, h, d = x.q.shape
    kv = x.k.shape[2]
    s = _scores(x.q, x.k, causal)
    p = jnp.exp(s - x.lse.reshape(b, kv, h // kv, t)[..., None])  # the whole softmax's probabilities
    dout = _grouped(x.dout, kv)
    delta = (dout * _grouped(x.out, kv)).sum(-1)  # [b, t, kv, g]
    dp = jnp.einsum("btkgd,bskd->bkgts", dout, x.v.astype(jnp.float32))
    ds = p * (dp - delta.transpose(0, 2, 3, 1)[..., None]) * d**-0.5
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, x.k.astype(jnp.float32)).reshape(b, t, h, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, _grouped(x.q, kv))
    dv = jnp.einsum("bkgts,btkgd->bskd", p, dout)
    return dq.astype(x.q.dtype), dk.astype(x.k.dtype), dv.astype(x.v.dtype)


REFERENCE = BlockKernel("reference", _reference_forward, _reference_backward)


def _cudnn_args(q: Array, causal: bool) -> dict:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # private: see the module docstring

    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    return dict(scale=q.shape[-1] ** -0.5, seed=42, dropout_rate=0.0, variadic_args=(False, False),
                mask_type=mask, layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None)


def _unused(q: Array) -> list[Array]:
    """The bias, sequence lengths, offsets and page tables cuDNN's primitives take, all absent."""
    return [jnp.zeros(0, q.dtype)] * 7


def _padded(v: Array, width: int) -> Array:
    # cuDNN takes one head dim for q, k and v off Hopper's latent-attention path: a narrower v
    # (multi-head latent attention's) gets zero columns, which change no score.
    return v if v.shape[-1] == width else jnp.pad(v, ((0, 0),) * 3 + ((0, width - v.shape[-1]),))


def _cudnn_forward(q: Array, k: Array, v: Array, causal: bool) -> tuple[Array, Array]:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    dv, v = v.shape[-1], _padded(v, q.shape[-1])
    cudnn.check_is_flash_attention(q, k, v, cudnn.AttentionLayout.BTNH.value, cudnn.check_cudnn_version(),
                                   False, True)
    out, lse = cudnn._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *_unused(q), is_training=True, **_cudnn_args(q, causal))
    return out[..., :dv], lse


def _cudnn_backward(x: BlockGrads, causal: bool) -> tuple[Array, Array, Array]:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    width, dv = x.q.shape[-1], x.v.shape[-1]
    wide = lambda a: _padded(a, width)  # noqa: E731
    dq, dk, dv_ = cudnn._dot_product_attention_bwd_p_wrapper.bind(
        x.q, x.k, wide(x.v), *_unused(x.q), x.lse, wide(x.out.astype(x.q.dtype)), wide(x.dout.astype(x.q.dtype)),
        **_cudnn_args(x.q, causal))
    return dq, dk, dv_[..., :dv]


CUDNN = BlockKernel("cudnn", _cudnn_forward, _cudnn_backward)


# The named scope of a splash call on a block every query sees whole: the mask is data in the
# compiled program, and the planner (planner/pallas.py UNMASKED) charges such calls every block.
UNMASKED = "unmasked_block"


def _scope(causal: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if causal else jax.named_scope(UNMASKED)


def _splash_forward(q: Array, k: Array, v: Array, causal: bool, interpret: bool) -> tuple[Array, Array]:
    kernel = splash_kernel(q.shape[1], k.shape[1], q.shape[2], causal, interpret, save_residuals=True)
    with _scope(causal):
        out, (lse,) = jax.vmap(kernel)(*(heads_first(a) for a in (scaled(q), k, v)))
    return heads_first(out), lse


def _splash_backward(x: BlockGrads, causal: bool, interpret: bool) -> tuple[Array, Array, Array]:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    kernel = splash_kernel(x.q.shape[1], x.k.shape[1], x.q.shape[2], causal, interpret, save_residuals=True)
    q, k, v, out, dout = (heads_first(a) for a in (scaled(x.q), x.k, x.v, x.out.astype(x.q.dtype),
                                                     x.dout.astype(x.q.dtype)))
    kw = kernel.kwargs

    def one_row(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array) -> tuple[Array, ...]:
        res = (q, k, v, None, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
        grads = sk._splash_attention_bwd(False, kw["mask_value"], False, kw["block_sizes"], None, kw["mask_function"],
                                         None, interpret, res, dout)
        return grads[3:6]

    with _scope(causal):
        dq, dk, dv = jax.vmap(one_row)(q, k, v, out, x.lse, dout)
    # The kernel differentiated the scaled queries: dq of the unscaled ones takes the scale once more.
    return (heads_first(dq) * x.q.shape[-1] ** -0.5).astype(x.q.dtype), heads_first(dk), heads_first(dv)


def splash_blocks(interpret: bool) -> BlockKernel:
    """The splash kernel as ring blocks (`interpret`: Pallas interpret mode, off TPU)."""
    return BlockKernel("splash", functools.partial(_splash_forward, interpret=interpret),
                       functools.partial(_splash_backward, interpret=interpret))
