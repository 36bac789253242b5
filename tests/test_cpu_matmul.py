"""The CPU matmul kernel (model/cpu_matmul.py, `model.cpu_matmul`): its products and gradients
against float64 NumPy and `jnp.einsum`, under vmap and with several calls in flight at once, the
einsums it takes, the trainer's pick, and a train.py run with the kernel missing. The whole step
with the kernel is anchored by the golden values (tests/test_golden.py: the default one-device
variants run it, the `xla-matmuls` ones XLA's own)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REQUIRE_EXTRAS, ROOT
from configs import ConfigError, load_config
from model import cpu_matmul as cm
from trainer.layout import cpu_matmul as pick, cpu_matmul_note

TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    why = cm.unavailable()
    if why and (platform.machine() != "x86_64" or sys.platform != "linux"):
        pytest.skip(f"the cpu extra's MKL is for x86-64 Linux, this is {platform.machine()} {sys.platform}: {why}",
                    allow_module_level=True)
    if why and os.environ.get(REQUIRE_EXTRAS) == "1":
        pytest.fail(f"the CPU matmul kernel is unavailable but {REQUIRE_EXTRAS}=1 (make venv builds it): {why}",
                    pytrace=False)
    if why:
        pytest.skip(f"the CPU matmul kernel is unavailable: {why}", allow_module_level=True)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)


def close(got: jax.Array, want: np.ndarray) -> None:
    """Equal to float32 rounding of sums over at most a few hundred terms, relative to the largest."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# Row counts below, at and past the kernel's row block (64), odd sizes, a single row or column,
# and the transposed reads of the gradients.
@pytest.mark.parametrize("m, k, n", [(1, 3, 5), (64, 1, 7), (129, 33, 1), (300, 70, 130)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_the_kernel_multiplies_as_float64_numpy(m, k, n, trans_a, trans_b):
    a, b = rand(m, k), rand(k, n, seed=1)
    a_in, b_in = (a.T.copy() if trans_a else a), (b.T.copy() if trans_b else b)
    got = jax.jit(cm.matmul, static_argnums=(2, 3))(a_in, b_in, trans_a, trans_b)
    close(got, a.astype(np.float64) @ b.astype(np.float64))


def test_batched_products_and_vmap():
    a, b = rand(3, 2, 130, 8), rand(3, 2, 8, 40, seed=1)
    want = np.einsum("xymk,xykn->xymn", a.astype(np.float64), b.astype(np.float64))
    close(jax.jit(cm.matmul)(a, b), want)
    # vmap adds a batch dim (broadcast where an operand lacks it: a weight shared by the rows).
    w = rand(8, 40, seed=2)
    close(jax.jit(jax.vmap(cm.matmul, in_axes=(0, None)))(a[:, 0], w), np.einsum("xmk,kn->xmn", a[:, 0], w))


@pytest.mark.parametrize("spec, x_shape, y_shape", [
    ("bld,df->blf", (2, 70, 16), (16, 24)),          # a projection
    ("blhk,hkd->bld", (2, 70, 4, 8), (4, 8, 16)),    # the output projection: two contracted dims
    ("bld,dhk->blhk", (2, 70, 16), (16, 4, 8)),      # q, k, v: two free dims of the weight
    ("bkqd,bkds->bkqs", (2, 3, 128, 8), (2, 3, 8, 96)),  # the attention blocks' products
    ("bkqs,bksd->bkqd", (2, 3, 128, 96), (2, 3, 96, 8)),
])
def test_einsum_and_its_gradients_match_jnp_einsum(spec, x_shape, y_shape):
    x, y = rand(*x_shape), rand(*y_shape, seed=1)
    out = jnp.einsum(spec, x, y)
    cot = rand(*out.shape, seed=2)  # a cotangent of its own, so no gradient is a plain sum

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, y: jnp.vdot(fn(spec, x, y), cot), argnums=(0, 1)))(x, y)

    want_value, want_grads = loss(jnp.einsum)
    value, grads = loss(cm.einsum)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        close(got, np.asarray(want, np.float64))


def test_calls_in_flight_at_once_finish_and_agree():
    # Four independent products in one program: XLA:CPU runs them side by side, each kernel call
    # scheduling helpers on a pool whose threads are busy with the others' calls. A call waits
    # only for work another thread has started, so none can wait on the pool for ever.
    xs = [rand(256, 64, seed=i) for i in range(4)]
    w = rand(64, 200, seed=9)
    fn = jax.jit(lambda xs, w: [cm.matmul(x, w) for x in xs])
    want = [x.astype(np.float64) @ w for x in xs]
    for _ in range(30):
        for got, ref in zip(fn(xs, w), want):
            close(got, ref)


@pytest.mark.parametrize("spec, dims", [
    ("bld,df->blf", (0, 2, 1)), ("blhk,hkd->bld", (0, 2, 2)), ("bkqd,bkds->bkqs", (2, 1, 1)), ("ij,jk->ik", (0, 1, 1)),
    ("ij,kj->ik", None),                 # the second operand transposed: not as the kernel reads it
    ("btkgd,bskd->bkgts", None),         # heads split from their queries: no single matmul
    ("bd,bd->b", None), ("ii,ij->j", None),
])
def test_the_einsums_the_kernel_takes(spec, dims):
    assert cm.matmul_dims(spec) == dims
    x = jnp.zeros((1,), jnp.float32)  # `takes` reads the dtypes and the spec
    with cm.cpu_matmul(True):
        assert cm.takes(spec, x, x) == (dims is not None)
        assert not cm.takes(spec, x, x.astype(jnp.bfloat16))  # float32 only
    assert not cm.takes(spec, x, x)  # off outside the trainer's tracing


def test_the_trainer_picks_the_kernel_on_one_float32_cpu_device_only():
    model = load_config(TINY).model
    assert pick(model, 1, "cpu")
    assert not pick(model, 8, "cpu") and not pick(model, 1, "gpu") and not pick(model, 1, "tpu")
    bf16 = load_config(TINY, ["model.dtype=bfloat16"]).model
    assert not pick(bf16, 1, "cpu")
    assert not pick(load_config(TINY, ["model.cpu_matmul=xla"]).model, 1, "cpu")
    assert not pick(load_config(TINY, ["model.remat=save_dots"]).model, 1, "cpu")  # would recompute them all
    assert pick(load_config(TINY, ["model.remat=full"]).model, 1, "cpu")
    mkl = load_config(TINY, ["model.cpu_matmul=mkl"]).model
    assert pick(mkl, 1, "cpu")
    dots = load_config(TINY, ["model.cpu_matmul=mkl", "model.remat=save_dots_no_batch"]).model
    for args, where in [((mkl, 8, "cpu"), "the mesh has 8 devices"), ((mkl, 1, "gpu"), "the devices are gpu"),
                        ((dots, 1, "cpu"), "model.remat=save_dots_no_batch saves XLA's dots only")]:
        with pytest.raises(ConfigError, match=f"model.cpu_matmul=mkl .* but {where}"):
            pick(*args)


def custom_calls(*overrides: str) -> int:
    """The kernel's calls in the tiny preset's compiled step on one CPU device (compiled: the
    lowered text holds each distinct call once, in a function the layers share)."""
    import trainer

    cfg = load_config(TINY, ["mesh.data=1", "data.source=synthetic", *overrides])
    compiled, _ = trainer.abstract_program(cfg, jax.devices()[:1]).compile()
    return compiled.as_text().count(f'custom_call_target="{cm.TARGET}"')


def test_the_default_one_device_step_calls_the_kernel():
    # 4 layers x (q, k, v, o, gate, up, down) x (forward, two gradients); with query blocks the
    # attention's products and gradients too.
    layers = load_config(TINY).model.num_layers
    assert custom_calls() == 3 * 7 * layers
    assert custom_calls("model.attention_block=8") == 3 * 7 * layers + 3 * 2 * 4 * layers
    assert custom_calls("model.cpu_matmul=xla") == 0


def test_a_missing_kernel_falls_back_under_auto_and_is_refused_under_mkl(tmp_path, monkeypatch):
    missing = str(tmp_path / "no_such_kernel.so")
    # train.py as a user runs it (one CPU device, without the suite's device count): exit 2 with
    # one line naming the key, before anything is written.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env.update(JAX_PLATFORMS="cpu", MESHLM_CPU_MATMUL_LIB=missing)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "mesh.data=1",
                          "model.cpu_matmul=mkl", f"run.dir={tmp_path / 'r'}"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: model.cpu_matmul=mkl: {missing} is not built (`make venv` builds it: scripts/build_cpu_matmul.py)"]
    assert not (tmp_path / "r").exists()
    # auto keeps XLA's matmuls (the golden `xla-matmuls` variants train that program) and says why.
    monkeypatch.setattr(cm, "LIBRARY", Path(missing))
    model = load_config(TINY).model
    assert not pick(model, 1, "cpu")
    assert cpu_matmul_note(model, 1, "cpu", False) == (
        f"model.cpu_matmul=auto: XLA's matmuls ({missing} is not built (`make venv` builds it: "
        "scripts/build_cpu_matmul.py))")
