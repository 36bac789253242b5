"""Collectives read by what they do and charged what they send (planner/hlo.py, hlo_graph.py):
a gather written as an all-reduce of a zero-padded buffer, a reduce-scatter written as an
all-reduce whose readers keep their shard, operands reached through copies, bitcasts and
fusions, a combined all-reduce holding both; and MaxText's llama3-8b fsdp=64 program for a v5p
4x4x4 (tests/fixtures/peers, made by MaxText's own compile) against independent counts.
"""

from __future__ import annotations

import gzip
import os
import re

from conftest import ROOT
from planner.hlo import collectives, shape_bytes

PEERS = os.path.join(ROOT, "tests", "fixtures", "peers")
MESH = {"fsdp": 8}
RING = 7 / 8  # an all-gather's or reduce-scatter's ring bytes per buffer byte over 8 devices

HEAD = """\
HloModule lowering

%add (a: bf16[], b: bf16[]) -> bf16[] {
  ROOT %s = bf16[] add(bf16[] %a, bf16[] %b)
}

%pad_fused (p0: bf16[8,16], p1: s32[]) -> bf16[64,16] {
  %z = bf16[64,16]{1,0} broadcast(%zero), dimensions={}
  ROOT %u = bf16[64,16]{1,0} dynamic-update-slice(%z, %p0, %p1, %zero_i)
}

%slice_fused (q0: bf16[64,16], q1: s32[]) -> f32[8,16] {
  %d = bf16[8,16]{1,0} dynamic-slice(%q0, %q1, %zero_i), dynamic_slice_sizes={8,16}
  ROOT %c = f32[8,16]{1,0} convert(%d)
}

ENTRY %main (shard: bf16[8,16], g: bf16[64,16]) -> f32[8,16] {
  %zeros = bf16[64,16]{1,0} broadcast(%zero), dimensions={}
  %padded = bf16[64,16]{1,0} dynamic-update-slice(%zeros, %shard, %offset, %zero_i)
"""
GROUPS = "channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add"


def _ops(body: str) -> list:
    ops, unknown = collectives(HEAD + body + "}\n", MESH, 8)
    assert unknown == 0
    return [(c.kind, c.lowered_as, c.bytes, c.wire_bytes) for c in ops]


def test_a_padded_all_reduce_through_copies_and_a_bitcast_is_a_gather_sent_as_an_all_reduce() -> None:
    body = """\
  %cs = (bf16[64,16]{1,0}, bf16[64,16]{1,0}, u32[]) copy-start(%padded)
  %cd = bf16[64,16]{1,0} copy-done(%cs)
  %bc = bf16[16,64]{0,1} bitcast(%cd)
  ROOT %ar = bf16[16,64]{0,1} all-reduce(%bc), """ + GROUPS + "\n"
    assert _ops(body) == [("all-gather", "all-reduce", 2048, 2 * RING * 2048)]
    # The same all-reduce of an unpadded buffer is an all-reduce.
    assert _ops(body.replace("copy-start(%padded)", "copy-start(%g)")) == [("all-reduce", "", 2048, 2 * RING * 2048)]


def test_a_fusion_ending_in_a_dynamic_update_slice_is_a_padded_buffer() -> None:
    body = """\
  %f = bf16[64,16]{1,0} fusion(%shard, %offset), kind=kLoop, calls=%pad_fused
  ROOT %ar = bf16[64,16]{1,0} all-reduce(%f), """ + GROUPS + "\n"
    assert _ops(body) == [("all-gather", "all-reduce", 2048, 2 * RING * 2048)]


def test_an_all_reduce_whose_readers_keep_their_shard_is_a_reduce_scatter() -> None:
    sliced = """\
  %ar = (bf16[64,16]{1,0}, bf16[64,16]{1,0}) all-reduce(%g, %padded), """ + GROUPS + """
  %part = bf16[64,16]{1,0} get-tuple-element(%ar), index=0
  %mine = bf16[8,16]{1,0} dynamic-slice(%part, %offset, %zero_i), dynamic_slice_sizes={8,16}
  %gathered = bf16[64,16]{1,0} get-tuple-element(%ar), index=1
  ROOT %f = f32[8,16]{1,0} fusion(%gathered, %offset), kind=kLoop, calls=%slice_fused
"""
    # One combined op: part 0 is reduced then sliced (a reduce-scatter), part 1 was padded (a gather).
    assert sorted(_ops(sliced)) == [("all-gather", "all-reduce", 2048, 2 * RING * 2048),
                                    ("reduce-scatter", "all-reduce", 2048, 2 * RING * 2048)]
    # A reader of the whole reduced part makes it an all-reduce.
    whole = sliced.replace("  ROOT %f", "  %use = bf16[64,16]{1,0} negate(%part)\n  ROOT %f")
    assert ("all-reduce", "", 2048, 2 * RING * 2048) in _ops(whole)


def _peer(name: str) -> str:
    with gzip.open(os.path.join(PEERS, name), "rt") as f:
        return f.read()


def test_maxtext_fsdp64_program_is_counted_as_an_independent_count_says() -> None:
    """MaxText's llama3-8b step, fsdp=64 on a v5p 4x4x4: its README's figures (an independent
    parser, per step with loop trips) are 545 bf16 all-gathers of 30.58 GB for the weights and
    15.01 GB of bf16 gradient all-reduces, each kept as one shard (reduce-scatters lowered as
    all-reduces): about 60 GB sent per device on a ring. The op-by-op sizes also agree with a
    plain regular-expression count of the text."""
    text = _peer("maxtext-e591f30-llama3-8b-v5p64-fsdp64.hlo.gz")
    mesh = {"data": 1, "stage": 1, "fsdp": 64}
    ops, unknown = collectives(text, mesh, 64)
    assert unknown == 0
    gathers = [c for c in ops if c.kind == "all-gather" and c.dtype == "bf16"]
    assert sum(c.count for c in gathers) == 545 and all(not c.lowered_as for c in gathers)
    assert abs(sum(c.count * c.bytes for c in gathers) / 30.58e9 - 1) < 0.02
    scatters = [c for c in ops if c.kind == "reduce-scatter"]
    assert all(c.lowered_as == "all-reduce" and c.dtype == "bf16" for c in scatters)
    assert abs(sum(c.count * c.bytes for c in scatters) / 15.01e9 - 1) < 0.02
    sent = sum(c.count * c.wire_bytes for c in ops)
    assert 58e9 < sent < 62e9, sent
    # Static (each op once): the text's all-gather result bytes, by a regular expression alone.
    regex = sum(shape_bytes(t) for t in re.findall(r"= (\S+) all-gather\(", text))
    assert sum(c.bytes for c in ops if c.kind == "all-gather") == regex
