"""The collectives parser and the roofline on programs the real compilers emitted.

Fixtures: the tiny preset in bf16 with FSDP over 8 devices, compiled by XLA's GPU compiler for
8 H100s and by libtpu for a v5p 2x2x2 slice, and over 4 devices for one v5p host (2x2x1)
(regenerate: tests/fixtures/make_hlo.sh). GPU collectives are async start/done pairs, and one
reduce-scatter-start combines a layer's gradients into a tuple of (operands, results). libtpu
writes a reduce-scatter as a kCustom fusion over an `all-reduce-scatter` computation (all-reduce
of the padded buffer, then this device's slice) on a 2x2x1 host, and as a plain all-reduce then
a dynamic-slice on a 3D torus (2x2x2 and larger): the latter is read as a reduce-scatter
lowered as an all-reduce, and moves an all-reduce's bytes.
"""

from __future__ import annotations

import os
import re

import pytest

from configs import load_config
from conftest import ROOT
from planner.hlo import collectives, runs_beside_kernels, shape_bytes, tuple_parts
from planner.minimum import minimum
from planner.roofline import kernels
from sharding.hardware import HARDWARE, predict
from trainer.state import abstract_model

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MESH = {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}


def _text(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


@pytest.fixture(scope="module")
def least() -> float:
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      ["mesh.data=1", "mesh.fsdp=8", "model.dtype=bfloat16", "train.global_batch=16"])
    _, shapes, axes = abstract_model(cfg.model)
    return minimum(cfg, MESH, shapes, axes)["fsdp"]


def test_combined_gpu_reduce_scatter_counts_its_operands() -> None:
    text = _text("h100_tiny_fsdp8.hlo")
    combined = [line for line in text.splitlines() if " reduce-scatter-start(" in line and line.split("=")[1].strip().startswith("((")]
    assert combined, "the fixture no longer holds a combined reduce-scatter"
    line = combined[0]
    operands, results = tuple_parts(re.match(r"\s*%\S+ = (.+?) reduce-scatter-start\(", line).group(1))
    assert shape_bytes(operands) == 8 * shape_bytes(results)  # 8 shards: the operand side is the full buffer
    ops, _ = collectives(text, MESH, 8)
    name = re.match(r"\s*%(\S+) =", line).group(1)
    assert any(c.kind == "reduce-scatter" and c.bytes == shape_bytes(operands) for c in ops), name


def test_gpu_fsdp_program_moves_bf16_at_its_minimum(least: float) -> None:
    ops, unknown = collectives(_text("h100_tiny_fsdp8.hlo"), MESH, 8)
    assert unknown == 0
    big = [c for c in ops if c.bytes >= 16 * 1024 and c.kind in ("all-gather", "reduce-scatter")]
    assert {c.kind for c in big} == {"all-gather", "reduce-scatter"}
    assert all("bf16" in c.dtype for c in big), [(c.kind, c.dtype, c.bytes) for c in big]
    # float32 travels only for the norm scales (kept float32 on purpose: sharding/cast.py).
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"))
    norms = (2 * cfg.model.num_layers + 1) * cfg.model.d_model * 4
    wide = 0
    for line in _text("h100_tiny_fsdp8.hlo").splitlines():
        if " all-gather-start(" in line:
            results = tuple_parts(re.match(r"\s*%\S+ = (.+?) all-gather-start\(", line).group(1))[-1]
            wide += sum(shape_bytes(part) for part in tuple_parts(results) if part.startswith("f32"))
    assert 0 < wide <= 2 * norms, (wide, norms)  # gathered for the forward and the backward
    assert sum(dict(c.by_dtype).get("f32", 0) for c in ops if c.kind == "all-gather") == wide  # the parser's split
    assert all(sum(b for _, b in c.by_dtype) == c.bytes for c in ops)
    sent = sum(c.wire_bytes * c.count for c in ops if c.axes == ("fsdp",))
    assert 0.9 <= sent / least <= 1.1, (sent, least)


def test_tpu_program_gathers_bf16(least: float) -> None:
    ops, _ = collectives(_text("v5p_tiny_fsdp8.hlo"), MESH, 8)
    gathers = [c for c in ops if c.kind == "all-gather" and c.bytes >= 16 * 1024]
    assert gathers and all(c.dtype == "bf16" for c in gathers)
    assert all(c.axes == ("fsdp",) for c in ops if c.bytes >= 16 * 1024)


@pytest.mark.parametrize("fixture,devices", [("h100_tiny_fsdp8.hlo", 8), ("v5p_tiny_fsdp8.hlo", 8),
                                             ("v5p_tiny_fsdp4.hlo", 4)])
def test_roofline_counts_the_model_flops(fixture: str, devices: int) -> None:
    """The program's matmul FLOPs against the model formula (6 N per token plus attention): the
    compiled kernels (GPU dots and GEMMs; TPU convolutions, some with the batch on a padded
    window) do at least the model's work and not much more (no remat here)."""
    from model import flops_per_token

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["model.dtype=bfloat16"])
    found = kernels(_text(fixture))
    compiled = sum(k.flops * k.count for k in found)
    model = flops_per_token(cfg.model) * 16 * cfg.model.seq_len / devices
    assert 0.95 * model <= compiled <= 1.3 * model, (compiled, model)


def test_tpu_all_reduce_scatter_fusion_is_a_reduce_scatter() -> None:
    text = _text("v5p_tiny_fsdp4.hlo")
    inside = re.findall(r"^%all-reduce-scatter[\w.\-]* \(.*?^}", text, re.M | re.S)
    assert inside, "the fixture no longer holds an all-reduce-scatter fusion"
    buffers = {shape_bytes(m) for body in inside for m in re.findall(r"= (\S+) all-reduce\(", body)}
    ops, unknown = collectives(text, {"pipeline": 1, "data": 1, "fsdp": 4, "tensor": 1}, 4)
    fused = [c for c in ops if c.kind == "reduce-scatter" and not c.lowered_as]  # sent as a reduce-scatter
    assert unknown == 0 and fused and {c.bytes for c in fused} == buffers, (fused, buffers)
    assert all(c.axes == ("fsdp",) and c.group_size == 4 for c in fused)
    assert all(c.wire_bytes == 3 / 4 * c.bytes for c in fused)
    # The 3D-torus program reduces the same gradients with plain all-reduces whose readers keep
    # their shard: reduce-scatters by what they do, charged an all-reduce's bytes by what they send.
    ops8, _ = collectives(_text("v5p_tiny_fsdp8.hlo"), MESH, 8)
    big = [c for c in ops8 if c.dtype == "bf16" and c.bytes >= 16 * 1024 and c.kind != "all-gather"]
    assert big and all(c.kind == "reduce-scatter" and c.lowered_as == "all-reduce" for c in big), big
    assert all(c.wire_bytes == 2 * 7 / 8 * c.bytes for c in big)


_RING_STEP = """ENTRY %step (p: (bf16[2,64], bf16[2,64])) -> (bf16[2,64], bf16[2,64]) {
  %p = (bf16[2,64], bf16[2,64]) parameter(0)
  %kv = bf16[2,64] get-tuple-element(%p), index=0
  %collective-permute-start = (bf16[2,64], bf16[2,64]) collective-permute-start(%kv), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %{work}
  %collective-permute-done = bf16[2,64] collective-permute-done(%collective-permute-start)
  %collective-permute-start.1 = (bf16[2,64], bf16[2,64]) collective-permute-start(%kv), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done.1 = bf16[2,64] collective-permute-done(%collective-permute-start.1)
  ROOT %t = (bf16[2,64], bf16[2,64]) tuple(%collective-permute-done, %collective-permute-done.1)
}
"""


@pytest.mark.parametrize("work", ["fusion = bf16[2,64] fusion(%kv), kind=kLoop, calls=%f",
                                  'fmha = (bf16[2,64], u8[0]) custom-call(%kv), custom_call_target="__cudnn$fmhaSoftmax"'])
def test_a_permute_with_kernels_between_its_start_and_done_runs_beside_them(work: str) -> None:
    """The GPU compiler's schedule: a hop whose start and done bracket a kernel (a fusion, a custom
    call) is sent while it runs, and the step-time model counts it overlapped; an adjacent pair waits."""
    lines = _RING_STEP.replace("{work}", work).splitlines()
    at = {line.split("=")[0].strip(" %"): i for i, line in enumerate(lines) if "collective-permute-start(" in line}
    assert runs_beside_kernels(lines, at["collective-permute-start"], "collective-permute-start")
    assert not runs_beside_kernels(lines, at["collective-permute-start.1"], "collective-permute-start.1")
    ops, _ = collectives("\n".join(lines), {"context": 2}, 8)
    assert [c.beside for c in ops] == [True, False]
    time = predict(hw=HARDWARE["h100"], model_flops=1.0, compute_s=1.0, bubble=0.0,
                   collectives=[{"axes": list(c.axes), "wire_bytes": 1e9, "inter_node": False, "beside": c.beside}
                                for c in ops])
    assert time["overlapped_comm_s"] > 0 and time["exposed_comm_s"] == time["overlapped_comm_s"]
