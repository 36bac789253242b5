"""Expert parallelism that moves only the routed rows (`model.moe.dispatch=ragged`), on fake CPU
devices: the exchange XLA:CPU lacks, emulated, delivers what `jax.lax.ragged_all_to_all`'s
documented semantics say; the ragged dispatcher gives the padded one's outputs, kept mask and
gradients bit for bit, and one device's outputs, with every token routed to one device's experts
(the worst-case buffer) and with capacity dropping some; `auto` picks it on TPU and GPU only.
The whole step under mesh.expert with it equals one device in tests/test_moe.py; that TPU and GPU
programs hold ragged-all-to-alls, in tests/test_targets.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import load_config
from conftest import ROOT
from model.kernels import Experts
from model.moe import local_dispatch
from sharding import activation_rules
from sharding.experts import expert_parallel
from sharding.ragged import Slices, exchange
from trainer.kernels import ragged_exchange

P = 4


def test_the_emulated_exchange_follows_ragged_all_to_all_s_documented_semantics():
    """Each of 4 devices sends each other one a slice of its 10 rows of its own size, from its own
    offset, to an offset the sender picks in the receiver's 24-row buffer (gaps left as given);
    a numpy loop over the docstring's SEND/RECEIVE pseudo-code is the reference."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 3, (P, P)).astype(np.int32)  # [sender, receiver]
    operand = rng.normal(size=(P, 10, 2)).astype(np.float32)
    in_off = np.zeros((P, P), np.int32)
    out_off = np.zeros((P, P), np.int32)
    for s in range(P):
        in_off[s] = np.concatenate([[0], np.cumsum(sizes[s])[:-1]]) + 1  # row 0 of each operand unsent
    for r in range(P):
        out_off[:, r] = np.concatenate([[0], np.cumsum(sizes[:, r])[:-1]]) * 2 + 3  # gaps between slices
    output = np.full((P, 24, 2), -1.0, np.float32)
    want = output.copy()
    for s in range(P):
        for r in range(P):
            want[r, out_off[s, r]:out_off[s, r] + sizes[s, r]] = operand[s, in_off[s, r]:in_off[s, r] + sizes[s, r]]
    assert (sizes > 0).sum() > P and not np.array_equal(want, output)

    mesh = Mesh(np.array(jax.devices()[:P]), ("x",))

    def one(operand, output, in_off, send, out_off, recv):
        slices = Slices(in_off[0], send[0], out_off[0], recv[0])
        return exchange(operand[0], output[0], slices, "x", native=False)[None]

    spec = PartitionSpec("x")
    got = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(
        operand, output, in_off, sizes, out_off, np.ascontiguousarray(sizes.T))
    np.testing.assert_array_equal(np.asarray(got), want)


def _inputs(skewed: bool) -> tuple:
    """8 x 6 tokens of width 16, 8 experts of width 8, top-2 routing; `skewed`: every token's two
    experts are device 0's (of 4), so one device receives every row."""
    x = jax.random.normal(jax.random.key(0), (8, 6, 16))
    experts = Experts(*(0.3 * jax.random.normal(jax.random.key(i + 1), s)
                        for i, s in enumerate([(8, 16, 8), (8, 16, 8), (8, 8, 16)])))
    logits = jax.random.normal(jax.random.key(5), (8, 6, 8))
    if skewed:
        logits = logits.at[..., :2].add(10.0)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), 2)
    return x, ids, weights, experts


def _run(ragged: str, capacity_factor: float, skewed: bool) -> tuple:
    """(y, kept, gradients of sum(y^2) in x and the experts) of the expert-parallel dispatcher on 4 devices."""
    x, ids, weights, experts = _inputs(skewed)
    mesh = Mesh(np.array(jax.devices()[:P]), ("expert",))
    rules = (("batch", ("expert",)), ("expert", "expert"))
    dispatch = expert_parallel(rules, P, ragged=ragged)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("expert")))  # noqa: E731
    x, experts, ids, weights = put(x), put(experts), put(ids), put(weights)

    def loss(x, experts):
        y, kept = dispatch(x, ids, weights, experts, capacity_factor)
        return (y ** 2).sum(), (y, kept)

    with activation_rules(mesh, rules):  # one program: outputs and gradients
        (_, (y, kept)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, experts)
    return np.asarray(y), np.asarray(kept), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("skewed", [False, True], ids=["routed", "every token to device 0"])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_ragged_dispatch_gives_the_padded_one_s_outputs_and_gradients(capacity_factor, skewed):
    dense = _run("", capacity_factor, skewed)
    ragged = _run("emulated", capacity_factor, skewed)
    kept = dense[1]
    assert kept.all() if capacity_factor == 0 else 0 < kept.mean() < 1, kept.mean()
    assert np.abs(dense[0]).min(axis=-1).max() > 0 and all(np.abs(g).max() > 0 for g in dense[2])
    np.testing.assert_array_equal(ragged[1], kept)
    np.testing.assert_array_equal(ragged[0], dense[0])
    for got, want in zip(ragged[2], dense[2]):
        np.testing.assert_array_equal(got, want)
    if capacity_factor == 0:  # the absolute anchor: every expert on one device
        x, ids, weights, experts = _inputs(skewed)
        np.testing.assert_allclose(ragged[0], local_dispatch(x, ids, weights, experts, 0.0)[0], rtol=1e-5, atol=1e-6)


def test_auto_moves_routed_rows_on_accelerators_and_padded_buffers_on_cpu():
    cfg = lambda *o: load_config(f"{ROOT}/configs/tiny-moe.yaml", list(o))  # noqa: E731
    assert [ragged_exchange(cfg(), p) for p in ("tpu", "gpu", "cpu")] == ["native", "native", ""]
    assert [ragged_exchange(cfg("model.moe.dispatch=ragged"), p) for p in ("tpu", "cpu")] == ["native", "emulated"]
    assert ragged_exchange(cfg("model.moe.dispatch=dense"), "tpu") == ""
