"""Tensor parallelism really splits the layers: equal losses cannot tell a sharded run from a
replicated one, so this reads the compiled train step. With `tensor=2` the per-device MLP hidden,
attention heads and logits are half as wide and all-reduces run over `tensor` once per layer;
the same step with `tensor=1` (the same per-device batch) holds them whole and has none."""

from __future__ import annotations

import re

import jax
import pytest

import trainer
from configs import load_config
from bench.procs import TINY
from planner.hlo import collectives

# d_ff 192 is no other dim of the tiny model (d_model 64, vocab 264, 16 heads and 8 kv heads of
# 8), so a [4, 32, 192] array can only be a whole MLP hidden and [4, 32, 96] only half of one.
D_FF, HEADS, KV_HEADS, VOCAB, LAYERS = 192, 16, 8, 264, 4
PER_DEVICE = "4,32"  # batch 16 over data=2 x fsdp=2, seq_len 32


@pytest.fixture(scope="module")
def compiled() -> dict[int, tuple[str, list]]:
    """tensor size -> (compiled HLO text, its collectives), on 8 and on 4 devices."""
    out = {}
    for tensor, n in ((2, 8), (1, 4)):
        cfg = load_config(TINY, ["data.source=synthetic", f"model.d_ff={D_FF}", "mesh.data=2", "mesh.fsdp=2",
                                 f"mesh.tensor={tensor}"])
        program = trainer.abstract_program(cfg, jax.devices()[:n])
        text = program.compile()[0].as_text()
        out[tensor] = text, collectives(text, program.spec.layout.sizes, 8)[0]
    return out


def widths(text: str) -> set[str]:
    """The last dims of the per-device [batch, length, ...] arrays of the step."""
    return set(re.findall(rf"f32\[{PER_DEVICE},([\d,]+)\]", text))


def test_tensor_splits_the_activations_inside_the_layers(compiled):
    split, whole = widths(compiled[2][0]), widths(compiled[1][0])
    assert split != whole
    # The MLP hidden, the logits, the query heads ([..., 16, 8] whole) and the 8 kv heads
    # ([..., 4, 8] split; [..., 8, 8] is both whole kv and split q, so it tells nothing).
    pairs = [(f"{D_FF}", f"{D_FF // 2}"), (f"{VOCAB}", f"{VOCAB // 2}"), (f"{HEADS},8", f"{KV_HEADS // 2},8")]
    for full, half in pairs:
        assert full in whole and half not in whole, (full, sorted(whole))
        assert half in split and full not in split, (half, sorted(split))


def test_tensor_collectives_run_on_the_tensor_axis_once_per_layer_or_more(compiled):
    on_tensor = [c for c in compiled[2][1] if "tensor" in c.axes]
    assert {c.kind for c in on_tensor} >= {"all-reduce"}, on_tensor
    assert sum(c.count for c in on_tensor if c.kind == "all-reduce") >= LAYERS
    assert all(c.axes == ("tensor",) for c in on_tensor if c.kind == "all-reduce"), on_tensor
    assert compiled[1][1] and not [c for c in compiled[1][1] if "tensor" in c.axes], "the control has none"
