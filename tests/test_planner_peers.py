"""The planner on instructions libtpu wrote for MaxText's MoE and 70B programs (snippets cut from
../shared/peers/, tests/fixtures/peers/snippets, nothing compiled): Pallas kernels (megablox
gmm/tgmm, splash attention) charged their own FLOPs, an unknown Pallas kernel charged its bytes
and named, `ragged-all-to-all` read as a collective at its bound with its balanced-routing
estimate (the GPU's asynchronous form too, from a snippet of meshlm's H100 program), and a nested
`dynamic-slice` of a stacked buffer charged the slice. The expected
figures are written from the shapes in the snippets, not from the planner. One real-target
test compiles a splash + megablox step with libtpu and checks its FLOPs against the model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.collectives import _program, row
from conftest import ROOT, real_target_env
from planner.hlo import collectives, static_counts
from planner import pallas
from planner.roofline import compute_seconds, kernels, parse
from planner.targets import has_compiler
from sharding.hardware import HARDWARE

SNIPPETS = os.path.join(ROOT, "tests", "fixtures", "peers", "snippets")
BF16 = 2


def _text(name: str) -> str:
    with open(os.path.join(SNIPPETS, name)) as f:
        return f.read()


def _kernels(text: str) -> dict:
    return {k.name: k for k in kernels(text)}


def test_megablox_and_splash_kernels_are_charged_their_formulas() -> None:
    got = _kernels(_text("mixtral-fsdp64-pallas.hlo"))
    rows, d_model, d_ff = 8192, 4096, 14336  # 4096 tokens x top-2 routed rows; Mixtral's widths
    grouped = 2.0 * rows * d_model * d_ff
    assert got["gmm.10"].flops == grouped  # [8192, 4096] x experts [8, 4096, 14336]
    assert got["gmm.11"].flops == grouped  # [8192, 14336] x experts [8, 14336, 4096]
    assert got["tgmm.3"].flops == grouped  # [8192, 14336]^T x [8192, 4096] -> [8, 14336, 4096]
    heads, seq, head_dim = 32, 4096, 128
    # Causal over an 8 x 8 grid of 512-blocks (the s8[1,8,8] block mask): 36 of the 64 blocks.
    per_matmul = 2.0 * heads * seq * seq * head_dim * 36 / 64
    assert got["splash_mha_fwd_segmented_residuals.3"].flops == 2 * per_matmul
    assert got["splash_mha_dq_segmented_no_residuals.1"].flops == 3 * per_matmul
    assert got["splash_mha_dkv_segmented_no_residuals.1"].flops == 4 * per_matmul
    assert not any(k.unknown_flops for k in got.values())
    assert compute_seconds(list(got.values()), lambda f, b, p: 0.0)["unknown_flops"] == []


def test_a_fused_splash_backward_counts_its_dq_matmul_too() -> None:
    text = _text("mixtral-fsdp64-pallas.hlo").replace(
        "%splash_mha_dkv_segmented_no_residuals.1 = (f32[512,128]{1,0:T(8,128)},",
        "%splash_mha_dkv_segmented_no_residuals.1 = (f32[8,32,4096,128]{3,2,1,0}, f32[512,128]{1,0:T(8,128)},")
    heads, seq, head_dim = 32, 4096, 128
    assert _kernels(text)["splash_mha_dkv_segmented_no_residuals.1"].flops == 5 * 2.0 * heads * seq * seq * head_dim * 36 / 64


def test_a_splash_call_on_a_ring_block_seen_whole_is_charged_every_block() -> None:
    """The mask is data in the program: a call under model/ring_blocks.py's `unmasked_block` scope
    (a ring step's block every query sees) is charged its whole [T, S], not the causal 36 of 64."""
    text = _text("mixtral-fsdp64-pallas.hlo")
    scoped = text.replace("splash_mha_fwd_segmented_residuals/splash_mha_fwd_segmented_residuals/pallas_call",
                          f"{pallas.UNMASKED}/splash_mha_fwd_segmented_residuals/splash_mha_fwd_segmented_residuals/"
                          "pallas_call")
    assert scoped != text
    whole = 2 * 2.0 * 32 * 4096 * 4096 * 128
    assert _kernels(scoped)["splash_mha_fwd_segmented_residuals.3"].flops == whole
    assert _kernels(text)["splash_mha_fwd_segmented_residuals.3"].flops == whole * 36 / 64


def test_a_splash_call_named_only_splash_attention_is_known_by_its_block_sizes() -> None:
    """libtpu may keep only `jit(_splash_attention)` of the op name; each phase is given its own block sizes."""
    text = _text("mixtral-fsdp64-pallas.hlo")
    for phase in ("fwd_segmented_residuals", "dq_segmented_no_residuals", "dkv_segmented_no_residuals"):
        text = text.replace(f"splash_mha_{phase}/splash_mha_{phase}/pallas_call", "pallas_call")
    text = text.replace("%splash_mha_fwd_segmented_residuals.3 =", "%_splash_attention.7 =").replace(
        "%splash_mha_dq_segmented_no_residuals.1 =", "%_splash_attention.6 =").replace(
        "%splash_mha_dkv_segmented_no_residuals.1 =", "%_splash_attention.5 =")
    got = _kernels(text)
    assert "splash_mha" not in text
    per_matmul = 2.0 * 32 * 4096 * 4096 * 128 * 36 / 64
    assert [got[f"_splash_attention.{i}"].flops for i in (7, 6, 5)] == [2 * per_matmul, 3 * per_matmul, 4 * per_matmul]


def test_an_unknown_pallas_kernel_is_charged_its_bytes_and_named() -> None:
    text = _text("mixtral-fsdp64-pallas.hlo").replace("%gmm.10 =", "%my_kernel.1 =").replace(
        "shard_map/jit(gmm)/pallas_call\" stack_frame_id=440", "shard_map/jit(my_kernel)/pallas_call\" stack_frame_id=440")
    found = _kernels(text)
    kernel = found["my_kernel.1"]
    operands = 4 + 9 * 4 + 2 * 23 * 4 + 4 + 8192 * 4096 * BF16 + 8 * 4096 * 14336 * BF16
    assert kernel.unknown_flops and kernel.flops == 0.0
    assert kernel.bytes == operands + 8192 * 14336 * BF16
    assert compute_seconds(list(found.values()), lambda f, b, p: 0.0)["unknown_flops"] == ["my_kernel.1"]


def test_ragged_all_to_all_is_charged_its_buffer_and_a_balanced_estimate() -> None:
    text = _text("mixtral-fsdp16-expert4-ragged.hlo")
    ops, _ = collectives(text, {"fsdp": 16, "expert": 4}, 64)
    row_bytes = 2 * 2048 * BF16  # one routed row: [2, 2048] bf16
    assert [(c.kind, c.axes, c.group_size, c.bytes) for c in ops] == [
        ("ragged-all-to-all", ("expert",), 4, 32768 * row_bytes),  # dispatch: up to 4 x 8192 rows arrive
        ("ragged-all-to-all", ("expert",), 4, 8192 * row_bytes),  # combine: this device's 8192 rows come home
    ]
    assert [c.wire_bytes for c in ops] == [c.bytes for c in ops]  # the bound
    assert [c.balanced for c in ops] == [8192 * row_bytes * 3 / 4] * 2  # even routing: 3/4 of its rows leave
    assert static_counts(text)["ragged-all-to-all"] == 2


def test_the_gpu_s_asynchronous_ragged_all_to_all_is_charged_its_output_buffer() -> None:
    """XLA's GPU compiler writes a ragged all-to-all as a start/done pair whose start carries
    (input rows, output buffer, four offset vectors) and the output again in one tuple (a snippet of
    meshlm's expert=8 step compiled for 8 H100s): its bound is the output buffer alone."""
    ops, _ = collectives(_text("h100-expert8-ragged-async.hlo"), {"expert": 8}, 8)
    row_bytes = 64 * BF16
    assert [(c.kind, c.axes, c.bytes) for c in ops] == [
        ("ragged-all-to-all", ("expert",), 160 * row_bytes),  # dispatch: up to 160 rows arrive
        ("ragged-all-to-all", ("expert",), 128 * row_bytes),  # combine: this device's 128 rows come home
    ]
    assert [c.balanced for c in ops] == [128 * row_bytes * 7 / 8] * 2
    assert [c.dtype for c in ops] == ["bf16", "bf16"]


def test_bench_collectives_shows_the_ragged_dispatch() -> None:
    cells = row("maxtext", {"memory": None, "kinds": _program(_text("mixtral-fsdp16-expert4-ragged.hlo"), 64)}).split(" | ")
    bound, balanced = 40960 * 2 * 2048 * BF16 / 1e9, 2 * 8192 * 2 * 2048 * BF16 * 3 / 4 / 1e9
    assert cells[6] == f"2: {bound:.2f} / {bound:.2f} (balanced {balanced:.2f})"


def test_a_nested_dynamic_slice_of_a_stacked_buffer_is_charged_the_slice() -> None:
    got = _kernels(_text("llama3-70b-stacked-slice.hlo"))
    layer = 1 * 8192 * 8192 * BF16  # one of the 80 layers of bf16[80,1,8192,8192]
    activations = 8192 * 64 * 128 * BF16  # bf16[1,8192,64,128], read and written
    assert got["fusion.384"].bytes == layer + 2 * activations + 8192 * 4 + 8192 * BF16 + 4
    update = 64 * 28672 * 4  # f32[1,64,28672] written in place into f32[80,64,28672]
    assert got["dynamic-update-slice.31"].bytes == 2 * update


def test_a_kernel_is_known_by_its_op_name_on_the_lines_after_its_own() -> None:
    """A Pallas call's `kernel_metadata` runs over several lines and its `op_name` follows it: an
    instruction the compiler renamed is still known by that name (`jit(gmm)/pallas_call`)."""
    text = _text("mixtral-fsdp64-pallas.hlo").replace("%gmm.10 =", "%custom-call.7 =")
    kernel = _kernels(text)["custom-call.7"]
    assert not kernel.unknown_flops and kernel.flops == 2.0 * 8192 * 4096 * 14336


@pytest.mark.real_target
def test_a_splash_and_megablox_step_compiled_by_libtpu_is_charged_its_model_flops(tmp_path) -> None:
    """tiny-moe with splash attention and megablox experts, compiled by libtpu for a v5p 2x2x1:
    the planner's FLOPs hold the model's (XLA's cost analysis counts the Pallas kernels as 0)."""
    if not has_compiler(HARDWARE["tpu-v5p"]):
        pytest.skip("libtpu is not installed (make compilers)")
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "plan.py", "--config", os.path.join(ROOT, "configs", "tiny-moe.yaml"),
                           "--devices", "4", "--hardware", "tpu-v5p", "--dump-hlo", str(tmp_path), "--out", str(out),
                           "model.attention=splash", "model.moe.grouped_matmul=megablox", "model.remat=full",
                           "mesh.data=1", "mesh.fsdp=4"],
                          cwd=ROOT, env=real_target_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    p = json.loads(out.read_text())["plans"][0]
    text = next(tmp_path.glob("*.hlo")).read_text()
    calls = [i for body in parse(text).values() for i in body if 'custom_call_target="tpu_custom_call"' in i.attrs]
    names = {pallas.kernel_name(i.name, i.attrs) for i in calls}
    assert names == {"gmm", "tgmm", "splash_fwd", "splash_dq", "splash_dkv"}, names
    assert not any("Pallas" in note or "planned with" in note for note in p["notes"]), p["notes"]
    flops = p["flops"]
    # Full remat runs the forward twice: more than the model's 6 x params x tokens, less than twice it.
    assert flops["model"] <= flops["compiled"] < 2 * flops["model"], flops
