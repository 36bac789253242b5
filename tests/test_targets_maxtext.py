"""meshlm's Mixtral 8x7B and Llama-3-70B steps, compiled by libtpu, against MaxText's compiled
programs of the same models and layouts (tests/fixtures/peers): bytes sent, expert dispatch and
memory per device.

The whole programs, every layer (the layer stack is one scanned body, so each compiles in about
a minute here). MaxText's programs are read by the same parser (bench/collectives.py `peer`), its
memory from the `memory_analysis()` saved beside each.
"""

from __future__ import annotations

import os

import pytest

from bench.collectives import MIXTRAL, MOE_TPU, PEERS, peer
from bench.collectives import _program as by_kind
from test_targets import _need, plan

pytestmark = pytest.mark.real_target
SENT = 2  # index of the bytes sent in a kind's [executions, buffer bytes, bytes sent, balanced]


def compiled(tmp_path_factory: pytest.TempPathFactory, preset: str, devices: int, overrides: list[str]) -> dict:
    """`preset`'s step compiled by libtpu for `devices` v5p chips, per device as `peer` gives
    MaxText's: collectives by kind, memory (arguments + temporaries) and arguments, in bytes."""
    _need("tpu-v5p")
    dump = tmp_path_factory.mktemp("hlo")
    p, out, status = plan(tmp_path_factory, "--config", preset, "--devices", str(devices), "--hardware", "tpu-v5p",
                          "--dump-hlo", str(dump), *overrides)
    assert status == 0, out
    (text,) = [f.read_text() for f in dump.iterdir() if f.suffix == ".hlo"]
    memory = p["plans"][0]["memory"]
    return {"memory": memory["arguments"] + memory["temps"], "arguments": memory["arguments"],
            "kinds": by_kind(text, devices)}


def maxtext(name: str, devices: int) -> dict:
    return peer(os.path.join(PEERS, name), devices)


def _sent(kinds: dict, kind: str | None = None) -> float:
    return sum(v[SENT] for k, v in kinds.items() if kind is None or k.split(" ")[0] == kind)


def at_most_maxtext_memory(ours: dict, theirs: dict) -> None:
    assert all(ours[k] <= theirs[k] for k in ("arguments", "memory")), (ours, theirs)


def test_mixtral_fsdp_sends_and_holds_no_more_than_maxtext(tmp_path_factory) -> None:
    """Mixtral 8x7B, fsdp=64 on a v5p-64, 64 x 4096: bytes sent per device, arguments and
    arguments + temporaries at most MaxText's."""
    ours = compiled(tmp_path_factory, "mixtral-8x7b", 64, ["mesh.data=1", "mesh.fsdp=64", *MOE_TPU.split()])
    theirs = maxtext(MIXTRAL + "fsdp64-flash-seq4096.hlo.gz", 64)
    assert _sent(ours["kinds"]) <= _sent(theirs["kinds"]), (_sent(ours["kinds"]) / 1e9, _sent(theirs["kinds"]) / 1e9)
    at_most_maxtext_memory(ours, theirs)


def test_mixtral_expert_parallel_sends_routed_rows_and_no_more_than_maxtext(tmp_path_factory) -> None:
    """Mixtral 8x7B, fsdp=16 x expert=4 on a v5p-64: the experts' rows travel as
    ragged-all-to-alls (six a layer, dispatch and return in the forward, its recompute under
    full remat and the backward: MaxText's 192), all bytes sent per device at most MaxText's (its
    ragged dispatch counted at its bound), arguments and arguments + temporaries at most MaxText's."""
    ours = compiled(tmp_path_factory, "mixtral-8x7b", 64,
                    ["mesh.data=1", "mesh.fsdp=16", "mesh.expert=4", *MOE_TPU.split()])
    theirs = maxtext(MIXTRAL + "fsdp16-expert4-flash-seq4096.hlo.gz", 64)
    kinds, their_kinds = ours["kinds"], theirs["kinds"]
    ragged = kinds.get("ragged-all-to-all", [0])[0]
    assert ragged == their_kinds["ragged-all-to-all"][0] == 192, (kinds, their_kinds)
    # No padded dispatch: the only all-to-alls left are the embedding lookup's, as in MaxText's.
    assert kinds.get("all-to-all", [0])[0] == their_kinds["all-to-all"][0], (kinds, their_kinds)
    assert _sent(kinds, "all-to-all") <= _sent(their_kinds, "all-to-all"), (kinds, their_kinds)
    assert _sent(kinds) <= _sent(their_kinds), (_sent(kinds) / 1e9, _sent(their_kinds) / 1e9)
    at_most_maxtext_memory(ours, theirs)


def test_llama3_70b_gathers_no_more_than_maxtext(tmp_path_factory) -> None:
    """Llama-3-70B, fsdp=128 on 128 v5p chips, 128 x 8192: the bytes all-gathers send per device
    at most MaxText's 273.75 GB (each layer's attention weights gathered as often as in its
    program), arguments and arguments + temporaries at most MaxText's."""
    ours = compiled(tmp_path_factory, "llama3-70b", 128,
                    ["mesh.data=1", "mesh.fsdp=128", "train.global_batch=128", "train.grad_accum=1",
                     "model.attention=splash"])
    theirs = maxtext("maxtext-e591f30-llama3-70b-v5p128chips-fsdp128-flash-seq8192.hlo.gz", 128)
    assert _sent(ours["kinds"], "all-gather") <= _sent(theirs["kinds"], "all-gather"), (ours["kinds"], theirs["kinds"])
    at_most_maxtext_memory(ours, theirs)
