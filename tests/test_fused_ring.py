"""Ring attention with a fused kernel on each block (sharding/fused_ring.py), on 4 fake CPU devices
with the float32 reference blocks (model/ring_blocks.py): the outputs and gradients of whole causal
attention (model/attention.py's xla kernel, the anchor), on the contiguous and the load-balanced
split, on 2 and 4 devices, with grouped kv heads and a narrower v; and the config's rules for cuDNN under a split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from bench.procs import TINY
from configs import ConfigError, load_config
from configs.schema import REMAT_SAVES
from model.attention import xla_attention
from model.attn_kernels import get
from model.ring_blocks import REFERENCE, RESIDUALS, BlockGrads, splash_blocks
from sharding.context import balanced_order
from sharding.fused_ring import FusedRing, fused_ring_attention

B, T, H, KV, D, DV = 2, 64, 4, 2, 8, 4
# The splash kernel's tiles are 128 positions: a load-balanced ring step's blocks are half a
# device's positions, so 2 devices take 512 (and its interpret mode is slow: one batch row).
SPLASH = dict(b=1, t=512, d=128, dv=64)


def qkv_and_cotangent(b: int = B, t: int = T, d: int = D, dv: int = DV) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.key(3), 4)
    return (jax.random.normal(ks[0], (b, t, H, d)), jax.random.normal(ks[1], (b, t, KV, d)),
            jax.random.normal(ks[2], (b, t, KV, dv)), jax.random.normal(ks[3], (b, t, H, dv)))


def whole(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return xla_attention(q, k, v, None)


def test_a_reference_block_is_whole_attention_with_its_log_sum_exp_and_gradients():
    """On one block holding every key, the block's forward is the softmax itself and its backward,
    given its own output and log-sum-exp, is autodiff's."""
    q, k, v, dout = qkv_and_cotangent()
    out, lse = REFERENCE.forward(q, k, v, True)
    np.testing.assert_allclose(out, whole(q, k, v), rtol=1e-5, atol=1e-5)
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, H // KV, axis=2)) * D**-0.5
    causal = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(causal, axis=-1), rtol=1e-5, atol=1e-5)
    grads = REFERENCE.backward(BlockGrads(q, k, v, out, lse, dout), True)
    expected = jax.grad(lambda *a: (whole(*a) * dout).sum(), argnums=(0, 1, 2))(q, k, v)
    for ours, theirs in zip(grads, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_splash_meets_the_ring_block_contract(causal: bool):
    """The TPU kernel (Pallas interpret mode) against the reference block: output, log-sum-exp, and
    the gradients it returns when handed another block's statistics (the reference's)."""
    q, k, v, dout = qkv_and_cotangent(b=1, t=256, d=128, dv=64)
    ours, ref = splash_blocks(interpret=True), REFERENCE
    (out, lse), (ref_out, ref_lse) = ours.forward(q, k, v, causal), ref.forward(q, k, v, causal)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=2e-5)
    given = BlockGrads(q, k, v, ref_out, ref_lse, dout)
    for name, a, b in zip("qkv", ours.backward(given, causal), ref.backward(given, causal)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("kernel, C, balanced", [("reference", C, balanced) for C in (2, 4) for balanced in (False, True)]
                         + [("splash", 2, True)],
                         ids=lambda a: {False: "contiguous", True: "load-balanced"}.get(a, str(a)) if isinstance(a, bool)
                         else str(a))
def test_the_fused_ring_gives_whole_attention_and_its_gradients(kernel: str, C: int, balanced: bool):
    """C = 2: the last ring step only, which the loop leaves out."""
    q, k, v, dout = qkv_and_cotangent(**(SPLASH if kernel == "splash" else {}))
    t = q.shape[1]
    blocks = splash_blocks(interpret=True) if kernel == "splash" else REFERENCE
    order = balanced_order(t, C) if balanced else np.arange(t)
    back = np.argsort(order)
    mesh = Mesh(np.array(jax.devices()[:C]), ("context",))
    spec = P(None, "context")
    ring = jax.shard_map(lambda *a: fused_ring_attention(*a, FusedRing("context", C, blocks, balanced)),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    ours = lambda q, k, v: ring(q[:, order], k[:, order], v[:, order])[:, back]  # noqa: E731
    loss = lambda fn: lambda *a: (fn(*a) * dout).sum()  # noqa: E731
    out, grads = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    expected, expected_grads = jax.value_and_grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), whole(q, k, v), rtol=1e-5, atol=2e-5)
    for name, a, b in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"d{name}")


def _cfg(kernel: str, *overrides: str):
    return load_config(TINY, ["data.source=synthetic", f"model.attention={kernel}", "mesh.data=2", "mesh.context=4",
                              "model.seq_len=1024", *overrides])


@pytest.mark.parametrize("name", ["cudnn", "splash"])
def test_a_fused_kernel_takes_a_sequence_split_only_as_ring_blocks_of_single_document_rows(name: str):
    kernel = get(name)
    kernel.check_split(_cfg(name, "context.strategy=ring", "data.packing=concat"), 4)  # accepted
    with pytest.raises(ConfigError, match="context.strategy=ring"):
        kernel.check_split(_cfg(name, "context.strategy=allgather"), 4)
    with pytest.raises(ConfigError, match="data.packing=document"):
        kernel.check_split(_cfg(name, "context.strategy=ring", "data.source=text", "data.packing=document"), 4)
    # 512 positions over 4 devices, load-balanced: ring blocks of 64, under splash's 128 tile.
    short = _cfg(name, "context.strategy=ring", "model.seq_len=512")
    if kernel.tile > 1:
        with pytest.raises(ConfigError, match="model.seq_len=512: the ring's blocks of model.attention=splash need a "
                                              "multiple of 1024"):
            kernel.check_split(short, 4)
    else:
        kernel.check_split(short, 4)


def test_save_ring_attention_keeps_the_rings_output_and_runs_it_once():
    """model.remat=save_ring_attention keeps the ring's output and log-sum-exp for the backward pass:
    the gradients are full remat's (and whole attention's), and the backward pass does not run the
    ring's forward again (its program sends as many blocks round the ring as without remat; full
    remat sends the forward's again), while the work around it is recomputed."""
    from model.layers import remat

    q, k, v, dout = qkv_and_cotangent()
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    spec = P(None, "context")
    ring = jax.shard_map(lambda *a: fused_ring_attention(*a, FusedRing("context", 4, REFERENCE, False)),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    # A layer's work around attention, so that remat has something to recompute before it.
    layer = lambda q, k, v: ring(jnp.tanh(q), jnp.tanh(k), v)  # noqa: E731
    program, grads = {}, {}
    for policy in ("none", "full", "save_ring_attention"):
        fn = jax.grad(lambda *a: (remat(layer, policy, in_scan=False)(*a) * dout).sum(), argnums=(0, 1, 2))
        text = str(jax.make_jaxpr(fn)(q, k, v))
        program[policy] = (text.count(" ppermute["), text.count(" tanh "))
        grads[policy] = jax.jit(fn)(q, k, v)
    expected = jax.grad(lambda *a: (whole(jnp.tanh(a[0]), jnp.tanh(a[1]), a[2]) * dout).sum(), argnums=(0, 1, 2))(q, k, v)
    for policy in ("full", "save_ring_attention"):
        for name, a, b in zip("qkv", grads[policy], expected):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"{policy}: d{name}")
    assert REMAT_SAVES["save_ring_attention"] == ("save_only_these_names", RESIDUALS)  # configs cannot import it
    (hops, tanh), (full_hops, full_tanh), (saved_hops, saved_tanh) = (program[p] for p in grads)
    assert full_hops > hops and full_tanh > tanh, program  # full remat runs the whole layer again
    assert saved_hops == hops and saved_tanh == full_tanh, program  # the ring's output kept, the rest again
