"""`model.quant`: the FP8 and int8 matmuls compute what they claim, each mode trains the tiny
model, resumes bitwise, and gives one device's losses on a sharded layout within its rounding.
`model.gather_dtype=fp8`: the gathered weight is rounded once, its gradient passes straight, an
FSDP run learns within the FP8 tolerance of its compute-dtype gathers (the H100 program's bytes:
tests/test_targets.py), and a layout that gathers nothing is refused."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trainer
from configs import ConfigError
from conftest import stopped_at
from model.quant import E4M3, E5M2, fp8_einsum, int8_einsum
from test_train import WARMUP

SPEC = "bld,dhk->blhk"  # a q/k/v projection: the weight keeps two output dims
STEPS = 3
# The learning-rate schedule of every run here (a constant of the compiled step) and its scanned
# stack: tests/test_train.py's 4-step runs', so the one-device and fsdp=8 full-precision runs
# below are its programs, served by the shared compilation cache; 3 steps of it show the loss
# falling.
HORIZON = ["optim.decay_steps=4", WARMUP]
# Loss gaps allowed between a sharded layout and one device in each mode. float32 layouts agree
# to 2e-5 (test_train.py); a reduction order that moves one value across a rounding boundary
# moves it one step of the format: 2^-3 relative for e4m3, 2^-7 for int8 near its channel max.
LAYOUT_RTOL = {"fp8": 1e-3, "int8": 1e-4}


def operands() -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (2, 3, 16)), 0.02 * jax.random.normal(kw, (16, 4, 8))


def fp8_round(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x rounded onto the per-tensor scaled grid of `dtype`, back in float32."""
    scale = jnp.max(jnp.abs(x)) / float(jnp.finfo(dtype).max)
    return (x / scale).astype(dtype).astype(jnp.float32) * scale


def test_fp8_einsum_is_the_einsum_of_fp8_operands_and_gradients():
    x, w = operands()
    out, vjp = jax.vjp(lambda a, b: fp8_einsum(SPEC, a, b), x, w)
    exact = jnp.einsum(SPEC, x, w)
    assert not np.array_equal(out, exact), "fp8 must round something"
    np.testing.assert_allclose(out, jnp.einsum(SPEC, fp8_round(x, E4M3), fp8_round(w, E4M3)), rtol=1e-5, atol=1e-7)
    g = jax.random.normal(jax.random.key(1), out.shape)
    dx, dw = vjp(g)
    gq = fp8_round(g, E5M2)
    np.testing.assert_allclose(dx, jnp.einsum("blhk,dhk->bld", gq, fp8_round(w, E4M3)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, jnp.einsum("bld,blhk->dhk", fp8_round(x, E4M3), gq), rtol=1e-5, atol=1e-6)


def test_int8_einsum_scales_per_row_and_per_output_channel():
    x, w = operands()
    w = w * jnp.arange(1, 33, dtype=jnp.float32).reshape(1, 4, 8)  # channels of very different ranges
    out = int8_einsum(SPEC, x, w)
    sx = jnp.max(jnp.abs(x), axis=2, keepdims=True) / 127
    sw = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127
    want = jnp.einsum(SPEC, jnp.round(x / sx) * sx, jnp.round(w / sw) * sw)
    assert not np.array_equal(out, jnp.einsum(SPEC, x, w)), "int8 must round something"
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # The gradient of the quantized forward, straight through the rounding alone: the gradient
    # matmuls read the dequantized operands, not the unrounded ones (whose gradient is that of a
    # function no pass computed, which leaves int8 training clearly behind bf16).
    g = jax.random.normal(jax.random.key(2), out.shape)
    got = jax.grad(lambda a, b: jnp.sum(int8_einsum(SPEC, a, b) * g), argnums=(0, 1))(x, w)
    dx = jnp.einsum("blhk,dhk->bld", g, jnp.round(w / sw) * sw)
    dw = jnp.einsum("bld,blhk->dhk", jnp.round(x / sx) * sx, g)
    unrounded = jax.grad(lambda a, b: jnp.sum(jnp.einsum(SPEC, a, b) * g), argnums=(0, 1))(x, w)
    for a, b, c in zip(got, (dx, dw), unrounded):
        assert not np.allclose(b, c, rtol=1e-4, atol=0), "the rounding must move the gradient"
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def losses(history: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in history])


def run_losses(run_dir, *overrides: str, devices: list | None = None) -> np.ndarray:
    """The losses of a tiny run in `run_dir` (the `tiny` fixture's settings, for module fixtures)."""
    from configs import load_config
    from conftest import ROOT, stdlib_glob

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", "train.log_every=1", *HORIZON, *overrides])
    return losses(trainer.run(cfg, devices))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Per mode: the tiny run's losses on one device."""
    return {quant: run_losses(tmp_path_factory.mktemp(quant), f"train.steps={STEPS}", "mesh.data=1", f"model.quant={quant}",
                              devices=jax.devices()[:1])
            for quant in ("none", "fp8", "int8")}


SHARDED = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Per 8-bit mode: the tiny run's losses on data=2 x fsdp=2 x tensor=2, and its run dir (fp8's
    keeps its step-1 checkpoint too: test_fp8_resume_is_bitwise_exact resumes from it)."""
    dirs = {quant: tmp_path_factory.mktemp(quant) for quant in ("fp8", "int8")}
    return {quant: (run_losses(dirs[quant], f"train.steps={STEPS}", *SHARDED, f"model.quant={quant}",
                               *(["checkpoint.every=1", f"checkpoint.keep={STEPS}"] if quant == "fp8" else [])), dirs[quant])
            for quant in ("fp8", "int8")}


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_each_mode_learns_and_differs_from_full_precision(one_device, quant):
    got = one_device[quant]
    assert got[-1] < got[0] - 0.1, f"{quant}: the loss did not fall: {got}"
    assert not np.array_equal(got, one_device["none"]), f"{quant} ran the full-precision matmuls"
    np.testing.assert_allclose(got, one_device["none"], rtol=2e-3)


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_sharded_layout_matches_one_device(sharded, one_device, quant):
    np.testing.assert_allclose(sharded[quant][0], one_device[quant], rtol=LAYOUT_RTOL[quant])


def test_fp8_resume_is_bitwise_exact(sharded, tmp_path, capsys):
    """The sharded fp8 run's step-1 checkpoint (its run dir without the later ones), resumed to
    STEPS: that run's last losses, bit for bit. Two steps after the resume, so the second loss
    also depends on the restored optimizer state (the first one's update used it)."""
    straight, run_dir = sharded["fp8"]
    moved = stopped_at(run_dir, tmp_path / "moved", 1)
    capsys.readouterr()
    second = run_losses(moved, f"train.steps={STEPS}", "checkpoint.every=1", *SHARDED, "model.quant=fp8")
    out = capsys.readouterr().out
    assert "model.quant=fp8: the block matmuls run in 8 bits (emulated on this device)" in out
    assert "resumed from step 1" in out
    assert len(second) == STEPS - 1 >= 2
    np.testing.assert_array_equal(second, straight[1:])


def test_unknown_mode_is_refused(tiny):
    with pytest.raises(ConfigError, match=r"^model\.quant: 'fp4' is not one of none, fp8, int8$"):
        tiny("model.quant=fp4")


def test_precision_bench_refuses_an_unknown_mode_before_any_run(capsys):
    # Its main in this process, not `python -m bench.precision` (seconds of a process's imports
    # for one line of argument checking; tests/test_bench_step.py runs the module as a process).
    from bench.precision import main

    code = main(["--config", "tiny", "--quant", "fp8,fp4"])
    out, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == "error: model.quant: 'fp4' is not one of none, fp8, int8"
    assert "step" not in out


@pytest.mark.parametrize("hardware, quant, has", [("tpu-v5e", "fp8", "int8"), ("tpu-v6e", "fp8", "int8"),
                                                  ("a100", "fp8", "int8")])
def test_a_mode_the_target_has_no_unit_for_exits_2_before_compiling(hardware: str, quant: str, has: str, capsys):
    from plan import main

    assert main(["--config", "tiny", "--devices", "4", "--hardware", hardware, f"model.quant={quant}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: model.quant: {quant} has no matmul unit on {hardware} (its low-precision matmuls: {has})\n"


def test_training_refuses_a_mode_the_devices_lack(tiny, tmp_path):
    """On a real device the check reads its `device_kind` (a CPU emulates every mode)."""
    from types import SimpleNamespace

    from trainer.checks import check_devices

    cfg = tiny("model.quant=fp8")
    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", slice_index=0)
    with pytest.raises(ConfigError, match=r"^model\.quant: fp8 has no matmul unit on tpu-v5e"):
        check_devices(cfg, [v5e])
    check_devices(cfg, [SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", process_index=0)])
    check_devices(cfg, jax.devices())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fixture, hardware, precision, operand", [
    ("h100_tiny_fp8.hlo", "h100", "fp8", r"f8e4m3fn\["),
    ("v5e_tiny_int8_fsdp4.hlo", "tpu-v5e", "int8", r"s8\["),
])
def test_real_compiles_hold_the_low_precision_matmuls(fixture: str, hardware: str, precision: str, operand: str):
    """The tiny step in bf16 with `model.quant` compiled by the real compilers (tests/fixtures/
    make_hlo.sh): its matmuls read FP8 (H100) or int8 (v5e) operands, the roofline finds them and
    times them at the device's low-precision rate."""
    import os
    import re

    from conftest import ROOT
    from sharding.hardware import HARDWARE, kernel_seconds
    from planner.roofline import compute_seconds, kernels

    with open(os.path.join(ROOT, "tests", "fixtures", fixture)) as f:
        text = f.read()
    matmuls = re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ (?:dot|convolution)\((.*)$", text, re.M)
    assert matmuls
    found = kernels(text)
    low = sum(k.flops * k.count for k in found if k.precision == precision)
    total = sum(k.flops * k.count for k in found)
    # The forward block matmuls at least: a quarter of all the work of this tiny model (whose
    # attention and output head stay bf16), three quarters with FP8 gradients as well.
    assert low >= 0.25 * total, (low, total)
    assert re.search(operand, text)
    hw = HARDWARE[hardware]
    # Matmul time alone (this tiny model's kernels are bound by memory, where rates do not show).
    fast = compute_seconds(found, lambda f, b, p: kernel_seconds(f, 0.0, hw, p))["seconds"]
    slow = compute_seconds(found, lambda f, b, p: kernel_seconds(f, 0.0, hw))["seconds"]
    assert fast == pytest.approx(slow - low / hw.matmul_efficiency * (1 / hw.peak_flops - 1 / hw.peak_for(precision)))


@pytest.mark.parametrize("quant", ["none", "fp8", "int8"])
def test_grad_reduce_rounds_only_the_weight_gradient(quant: str):
    """`model.grad_reduce=bfloat16` in a float32 run: the forward and the activation gradient are
    untouched, the weight gradient comes out of its matmul in bfloat16 (what its reduction moves)."""
    from model.quant import qeinsum

    x, w = operands()
    g = jax.random.normal(jax.random.key(2), (2, 3, 4, 8))

    def grads(reduce: str) -> tuple[jax.Array, ...]:
        out, vjp = jax.vjp(lambda a, b: qeinsum(SPEC, a, b, quant, reduce), x, w)
        return (out, *vjp(g))

    out32, dx32, dw32 = grads("compute")
    out16, dx16, dw16 = grads("bfloat16")
    np.testing.assert_array_equal(out16, out32)
    np.testing.assert_array_equal(dx16, dx32)
    assert dw16.dtype == jnp.float32 and not np.array_equal(dw16, dw32)
    np.testing.assert_array_equal(dw16, dw16.astype(jnp.bfloat16).astype(jnp.float32))  # on the bf16 grid
    np.testing.assert_allclose(dw16, dw32, rtol=2**-7, atol=1e-6)



def test_bf16_gradient_reduction_halves_the_block_weights_reduce_bytes():
    """The float32 tiny step, data=8, compiled for 8 H100s (tests/fixtures/make_hlo.sh) with
    `model.grad_reduce=compute` and `=bfloat16`: the block weights' all-reduces move bf16, half
    their float32 bytes; the embedding and norm scales still reduce in float32."""
    import os

    from conftest import ROOT
    from planner.hlo import collectives

    def reduced(name: str) -> dict[str, int]:
        with open(os.path.join(ROOT, "tests", "fixtures", name)) as f:
            ops, unknown = collectives(f.read(), {"pipeline": 1, "data": 8, "fsdp": 1, "tensor": 1}, 8)
        assert unknown == 0
        out: dict[str, int] = {}
        for c in ops:
            assert c.kind == "all-reduce" and c.axes == ("data",), c
            for dtype, size in c.by_dtype:
                out[dtype] = out.get(dtype, 0) + size * c.count
        return out

    f32, bf16 = reduced("h100_tiny_data8_f32.hlo"), reduced("h100_tiny_data8_f32_reduce_bf16.hlo")
    assert set(f32) == {"f32"} and set(bf16) == {"f32", "bf16"}
    blocks = f32["f32"] - bf16["f32"]  # what moved to bf16
    assert blocks > 0.8 * f32["f32"]  # the block weights are most of the model
    assert bf16["bf16"] * 2 == blocks


def test_fp8_gather_rounds_the_weight_once_and_passes_its_gradient_straight():
    """`model.gather_dtype=fp8` on one weight: the value the matmul gets is the weight on the
    per-tensor e4m3 grid, in the weight's dtype; its gradient is the incoming one, unchanged."""
    from model.quant import fp8_gather

    _, w = operands()
    got, vjp = jax.vjp(lambda a: fp8_gather(a, ("embed", "heads", "head_dim")), w)
    assert got.dtype == w.dtype and not np.array_equal(got, w), "fp8 must round something"
    np.testing.assert_allclose(got, fp8_round(w, E4M3), rtol=1e-6, atol=1e-9)
    g = jax.random.normal(jax.random.key(3), w.shape)
    np.testing.assert_array_equal(vjp(g)[0], g)


@pytest.fixture(scope="module")
def fsdp_gathers(tmp_path_factory):
    """The tiny run on fsdp=8, its weights gathered in the compute dtype and in FP8."""
    return {gather: run_losses(tmp_path_factory.mktemp(gather), f"train.steps={STEPS}", "mesh.data=1", "mesh.fsdp=8",
                               f"model.gather_dtype={gather}")
            for gather in ("compute", "fp8")}


def test_fp8_gathers_learn_within_rounding_of_compute_gathers(fsdp_gathers):
    """FP8 weights (3 mantissa bits, one scale per weight) in every block matmul: the losses stay
    within the fp8 matmuls' tolerance of the full-precision run (their gap, about 3e-4 over 8
    steps, sits well inside it)."""
    got, full = fsdp_gathers["fp8"], fsdp_gathers["compute"]
    assert got[-1] < got[0] - 0.1, f"the loss did not fall: {got}"
    assert not np.array_equal(got, full), "the fp8 gathers rounded nothing"
    np.testing.assert_allclose(got, full, rtol=2e-3)


@pytest.mark.parametrize("layout", [["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2"]])
def test_fp8_gathers_on_a_layout_that_gathers_nothing_are_refused(tiny, layout):
    from trainer import prepare

    with pytest.raises(ConfigError, match=r"^model\.gather_dtype=fp8: this layout gathers no parameter"):
        prepare(tiny(*layout, "model.gather_dtype=fp8"), 8, with_data=False)
