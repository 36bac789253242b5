"""Low-precision matmuls for the blocks (`model.quant`): `none`, `fp8`, `int8`.

Every projection of a block (q, k, v, o, gate, up, down) goes through `qeinsum`; the embedding,
output head, norms and the attention softmax keep their precision.

- `fp8`: both operands of the forward matmul in float8_e4m3fn, the incoming gradient in
  float8_e5m2 for both backward matmuls (its wider range, as the FP8 recipes of Transformer
  Engine and torchtitan), one scale per tensor, each matmul's output in the compute dtype and
  scaled after (the hardware accumulates in float32). Scaling is *current*: each scale is the
  tensor's own absolute maximum of this step (a max-reduction the partitioner runs over the
  shards), not a history of past maxima. Delayed scaling would save
  that reduction but needs an amax history per matmul per layer in the train state, threaded
  through the layer scan and the pipeline stages; current scaling has no state, so a resume is
  exact with nothing to checkpoint, and a step's scale can never lag a jump in magnitude.
- `int8`: symmetric, per channel: one scale per output channel of the weight and one per row
  (token) of the activation, each over the contracted dims, products accumulated in int32. The
  gradient matmuls run in the compute dtype on the *dequantized* operands (int8 values times
  their scales): the gradient of the function the forward computed, straight through the
  rounding only, as fake-quantized training does it (qwix's and AQT's quantization-aware
  training, and the FP8 path here, whose gradients read the e4m3 operands). Per-channel int8
  gradients would need scales along the forward's contracted dims, and a gradient's range is
  what 8 bits hold worst, so the gradients stay in the compute dtype.

`model.grad_reduce` picks the dtype each block weight's gradient leaves its matmul in
(`compute`: the compute dtype, as autodiff gives it). The partitioner reduces a weight gradient
over the batch shards (data-parallel all-reduce, FSDP reduce-scatter) right where its matmul
produces the partial sums, in that matmul's output dtype: `bfloat16` halves the bytes of a
float32 run's gradient reductions, `float32` doubles a bfloat16 run's for an exact sum.

`model.gather_dtype=fp8` (`fp8_gather`) moves each block weight between devices in FP8: the
weight, still sharded as stored, is rounded to float8_e4m3fn with one scale per tensor (its
amax over the shards: one scalar all-reduce), constrained by its own logical axes to the layout
the matmul wants (the FSDP all-gather then moves the 8-bit array, as `embed` in transformer.py
casts before its gather), and turned back into the compute dtype after the gather. The matmul
itself runs as `model.quant` says on the rounded weight. The backward pass is straight-through
(the gradient of the rounded weight is the weight's) and leaves the gradient reduction to
`model.grad_reduce`: the reduce-scatters keep their dtype. The embedding and output head are
gathered in the compute dtype. Under remat an unquantized block weight goes through `gather`, the
same constraint in the compute dtype without the rounding, so the recomputed forward matmul and
the input gradient's share one all-gather.

Why written here and not through a library: both are `jnp.einsum` on low-precision operand
types with `preferred_element_type` inside one `jax.custom_vjp` each, about a hundred lines
(compiled for an H100, GEMM fusions on f8e4m3fn operands; by libtpu for a v5e, convolutions on
s8 operands with s32 results: tests/test_quant.py). qwix 0.1.8 (MaxText's choice) imports with
jax 0.10.2 and flax 0.12.8, but it quantizes by intercepting the calls of NNX modules picked by path rules on a model it rewrites; this
model is re-merged from its state inside the layer scan and the pipeline runners on every
step, and the scaling would be hidden in its providers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

Array = jax.Array

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_TINY = 1e-12  # an all-zero tensor gets this amax, not a division by zero


def weight_grad(spec: str, x: Array, g: Array, **kwargs: object) -> Array:
    """The weight gradient of `einsum(spec, x, w)`: `einsum("{a},{out}->{b}", x, g, **kwargs)`."""
    a, b, out = _split(spec)
    return jnp.einsum(f"{a},{out}->{b}", x, g, **kwargs)


def _split(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    return a, b, out


def _to_fp8(x: Array, dtype: jnp.dtype) -> tuple[Array, Array]:
    """(x / scale in `dtype`, scale), scale = amax(|x|) / the format's largest finite value."""
    x32 = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x32)), _TINY) / float(jnp.finfo(dtype).max)
    return (x32 / scale).astype(dtype), scale


def _fp8_dot(spec: str, a: Array, b: Array, sa: Array, sb: Array, dtype: jnp.dtype) -> Array:
    # The matmul itself outputs `dtype` and the scales apply after: a weight gradient's partial
    # sums are reduced over the batch shards in the matmul's output dtype (model.grad_reduce).
    return _scaled(jnp.einsum(spec, a, b, preferred_element_type=dtype), sa, sb, dtype)


def _scaled(out: Array, sa: Array, sb: Array, dtype: jnp.dtype) -> Array:
    return (out.astype(jnp.float32) * (sa * sb)).astype(dtype)


def _grad_dtype(grad_reduce: str, w_dtype: jnp.dtype) -> jnp.dtype:
    return w_dtype if grad_reduce == "compute" else jnp.dtype(grad_reduce)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(spec: str, x: Array, w: Array, grad_reduce: str = "compute") -> Array:
    """`jnp.einsum(spec, x, w)` with FP8 operands (e4m3 forward, e5m2 gradients); output in x's
    dtype, the weight gradient out of its matmul in `grad_reduce` ('compute': w's dtype)."""
    return _fp8_fwd(spec, x, w, grad_reduce)[0]


def _fp8_fwd(spec: str, x: Array, w: Array, grad_reduce: str) -> tuple[Array, tuple]:
    xq, sx = _to_fp8(x, E4M3)
    wq, sw = _to_fp8(w, E4M3)
    # The FP8 copies are the residuals: a quarter of a float32 activation's bytes. Residuals
    # must be arrays, so w's dtype travels as an empty array of it (dx takes g's dtype, x's).
    return _fp8_dot(spec, xq, wq, sx, sw, x.dtype), (xq, wq, sx, sw, jnp.zeros((0,), w.dtype))


def _fp8_bwd(spec: str, grad_reduce: str, res: tuple, g: Array) -> tuple[Array, Array]:
    xq, wq, sx, sw, w_like = res
    a, b, out = _split(spec)
    gq, sg = _to_fp8(g, E5M2)
    dx = _fp8_dot(f"{out},{b}->{a}", gq, wq, sg, sw, g.dtype)
    dtype = _grad_dtype(grad_reduce, w_like.dtype)
    dw = _scaled(weight_grad(spec, xq, gq, preferred_element_type=dtype), sx, sg, dtype)
    return dx, dw.astype(w_like.dtype)


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


def _to_int8(x: Array, keep: str, dims: str) -> tuple[Array, Array]:
    """(round(x / scale) in int8, scale), one scale per index of the dims in `keep`; the others
    (the contracted ones) stay in the scale's shape with size 1."""
    x32 = x.astype(jnp.float32)
    reduce = tuple(i for i, d in enumerate(dims) if d not in keep)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=reduce, keepdims=True), _TINY) / 127.0
    return jnp.clip(jnp.round(x32 / scale), -127, 127).astype(jnp.int8), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def int8_einsum(spec: str, x: Array, w: Array, grad_reduce: str = "compute") -> Array:
    """`jnp.einsum(spec, x, w)` with per-channel int8 operands in the forward pass; output in x's dtype."""
    return _int8_fwd(spec, x, w, grad_reduce)[0]


def _int8_fwd(spec: str, x: Array, w: Array, grad_reduce: str) -> tuple[Array, tuple]:
    a, b, out = _split(spec)
    xq, sx = _to_int8(x, out, a)
    wq, sw = _to_int8(w, out, b)
    acc = jnp.einsum(spec, xq, wq, preferred_element_type=jnp.int32)
    # The scales keep the contracted dims at size 1, so the same einsum multiplies them out
    # into the output's shape: row scale times channel scale.
    y = (acc.astype(jnp.float32) * jnp.einsum(spec, sx, sw)).astype(x.dtype)
    # The int8 copies and their scales are the residuals (a quarter of a float32 activation's
    # bytes); w's dtype travels as an empty array of it, as in the FP8 path.
    return y, (xq, sx, wq, sw, jnp.zeros((0,), w.dtype))


def _int8_bwd(spec: str, grad_reduce: str, res: tuple, g: Array) -> tuple[Array, Array]:
    # Why the dequantized operands and not x and w themselves: the forward computed
    # deq(xq) . deq(wq), and the gradient of *that* (straight through the rounding alone) is
    # g . deq(wq) for x and deq(xq) . g for w. With the unrounded operands instead, the
    # gradient is the one of a function no pass computed, and training drifts from bf16's loss.
    xq, sx, wq, sw, w_like = res
    a, b, out = _split(spec)
    x = (xq.astype(jnp.float32) * sx).astype(g.dtype)
    w = (wq.astype(jnp.float32) * sw).astype(g.dtype)
    dw = weight_grad(spec, x, g, preferred_element_type=_grad_dtype(grad_reduce, w_like.dtype))
    return jnp.einsum(f"{out},{b}->{a}", g, w), dw.astype(w_like.dtype)


int8_einsum.defvjp(_int8_fwd, _int8_bwd)

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def reduced_einsum(spec: str, x: Array, w: Array, grad_dtype: str) -> Array:
    """`jnp.einsum(spec, x, w)` whose weight gradient comes out of its matmul in `grad_dtype`."""
    return jnp.einsum(spec, x, w)


def _reduced_fwd(spec: str, x: Array, w: Array, grad_dtype: str) -> tuple[Array, tuple[Array, Array]]:
    return jnp.einsum(spec, x, w), (x, w)


def _reduced_bwd(spec: str, grad_dtype: str, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = res
    a, b, out = _split(spec)
    dw = weight_grad(spec, x, g, preferred_element_type=jnp.dtype(grad_dtype))
    return jnp.einsum(f"{out},{b}->{a}", g, w), dw.astype(w.dtype)


reduced_einsum.defvjp(_reduced_fwd, _reduced_bwd)

_EINSUMS = {"fp8": fp8_einsum, "int8": int8_einsum}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_gather(w: Array, axes: tuple[str | None, ...]) -> Array:
    """`w` (a weight as stored: sharded like its parameter) quantized to float8_e4m3fn with one
    scale while still sharded, constrained to the compute layout of its logical `axes` so the
    partitioner's all-gather moves the 8-bit array, then back in w's dtype (`model.gather_dtype=fp8`)."""
    wq, scale = _to_fp8(w, E4M3)
    wq = nn.with_logical_constraint(wq, axes)
    return (wq.astype(jnp.float32) * scale).astype(w.dtype)


def _gather_fwd(w: Array, axes: tuple[str | None, ...]) -> tuple[Array, None]:
    return fp8_gather(w, axes), None


def _gather_bwd(axes: tuple[str | None, ...], _: None, g: Array) -> tuple[Array]:
    # Straight-through: the rounding passes the gradient unchanged, which then reduces over the
    # batch shards (FSDP: reduce-scatters) in the dtype its matmul gave it (model.grad_reduce).
    return (g,)


fp8_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather(w: Array, axes: tuple[str | None, ...]) -> Array:
    """`w` (a weight as stored, in the compute dtype) constrained to the compute layout of its
    logical `axes` (`model.gather_dtype=compute`): one value the partitioner gathers once, which
    every matmul that reads the weight shares. Left to each matmul, the partitioner gathers the
    weight once per matmul, and under remat XLA merges the recomputed projection's gather with the
    input gradient's only when the two sit close in the layer's graph (a distance threshold the
    TPU compiler's collective CSE applies): a query or key weight, whose uses lie the whole
    recomputed layer apart, would be gathered a third time. The backward passes the gradient
    unchanged, as `fp8_gather` does, so it reduces over the batch shards where its matmul
    produces it (a constraint's own transpose would all-reduce the whole gradient first)."""
    return nn.with_logical_constraint(w, axes)


def _plain_gather_fwd(w: Array, axes: tuple[str | None, ...]) -> tuple[Array, None]:
    return gather(w, axes), None


gather.defvjp(_plain_gather_fwd, _gather_bwd)


def qeinsum(spec: str, x: Array, w: Array, quant: str, grad_reduce: str = "compute") -> Array:
    """A block's matmul `x` [activation] by `w` [weight, already in the compute dtype] under
    `model.quant` ('none': the plain einsum) and `model.grad_reduce`."""
    if quant != "none":
        return _EINSUMS[quant](spec, x, w, grad_reduce)
    # One path for every grad_reduce: the custom gradient writes the weight gradient as
    # activation x incoming gradient (autodiff's transpose puts the gradient first, which XLA:CPU
    # lays out with a transposed copy of the larger operand; the GPU and TPU compilers pick their
    # own layouts either way). The same products and sums.
    return reduced_einsum(spec, x, w, w.dtype.name if grad_reduce == "compute" else grad_reduce)
