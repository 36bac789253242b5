"""meshlm's Mixtral 8x7B expert-parallel and Llama-3-70B FSDP steps, compiled by libtpu, against
MaxText's compiled programs of the same models and layouts (tests/fixtures/peers): bytes sent,
expert dispatch and memory per device.

The whole programs, every layer (the layer stack is one scanned body, so each compiles in about
a minute here). MaxText's programs are read by the same parser (bench/collectives.py), its
arguments from the `memory_analysis()` saved beside each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.collectives import MIXTRAL, MOE_TPU, PEERS, peer
from bench.collectives import _program as by_kind
from conftest import ROOT, real_target_env
from planner.targets import has_compiler
from sharding.hardware import HARDWARE

pytestmark = pytest.mark.real_target
SENT = 2  # index of the bytes sent in a kind's [executions, buffer bytes, bytes sent, balanced]


def compiled(tmp: str, preset: str, devices: int, overrides: list[str]) -> tuple[dict, dict]:
    """(collectives by kind, memory: bytes of arguments and of arguments + temporaries) per device
    of `preset`'s step compiled by libtpu for `devices` v5p chips."""
    if not has_compiler(HARDWARE["tpu-v5p"]):
        if os.environ.get("MESHLM_REQUIRE_EXTRAS"):
            pytest.fail("libtpu is not installed, but make test installs it (make compilers)")
        pytest.skip("libtpu is not installed (make compilers)")
    out = os.path.join(tmp, "plan.json")
    done = subprocess.run([sys.executable, "plan.py", "--config", preset, "--devices", str(devices), "--hardware",
                           "tpu-v5p", "--dump-hlo", tmp, "--out", out, *overrides],
                          cwd=ROOT, env=real_target_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (hlo,) = [f for f in os.listdir(tmp) if f.endswith(".hlo")]
    with open(os.path.join(tmp, hlo)) as f:
        kinds = by_kind(f.read(), devices)
    with open(out) as f:
        memory = json.load(f)["plans"][0]["memory"]
    return kinds, {"arguments": memory["arguments"], "total": memory["arguments"] + memory["temps"]}


def _sent(kinds: dict, kind: str | None = None) -> float:
    return sum(v[SENT] for k, v in kinds.items() if kind is None or k.split(" ")[0] == kind)


def peer_memory(name: str) -> dict:
    """MaxText's program's memory as `compiled` gives meshlm's, from its `memory_analysis()`."""
    with open(os.path.join(PEERS, name.removesuffix(".hlo.gz") + ".mem.json")) as f:
        mem = json.load(f)
    return {"arguments": mem["argument_size_in_bytes"],
            "total": mem["argument_size_in_bytes"] + mem["temp_size_in_bytes"]}


def at_most_maxtext(ours: dict, theirs: dict) -> None:
    assert all(ours[k] <= theirs[k] for k in ("arguments", "total")), (ours, theirs)


def test_mixtral_fsdp_sends_and_holds_no_more_than_maxtext(tmp_path) -> None:
    """Mixtral 8x7B, fsdp=64 on a v5p-64, 64 x 4096: bytes sent per device, arguments and
    arguments + temporaries at most MaxText's."""
    name = MIXTRAL + "fsdp64-flash-seq4096.hlo.gz"
    kinds, memory = compiled(str(tmp_path), "mixtral-8x7b", 64, ["mesh.data=1", "mesh.fsdp=64", *MOE_TPU.split()])
    theirs = peer(os.path.join(PEERS, name), 64)["kinds"]
    assert _sent(kinds) <= _sent(theirs), (_sent(kinds) / 1e9, _sent(theirs) / 1e9)
    at_most_maxtext(memory, peer_memory(name))


def test_mixtral_expert_parallel_sends_routed_rows_and_no_more_than_maxtext(tmp_path) -> None:
    """Mixtral 8x7B, fsdp=16 x expert=4 on a v5p-64: the experts' rows travel as
    ragged-all-to-alls (six a layer, dispatch and return in the forward, its recompute under
    full remat and the backward: MaxText's 192), all bytes sent per device at most MaxText's (its ragged dispatch counted at its
    bound), arguments and arguments + temporaries at most MaxText's."""
    name = MIXTRAL + "fsdp16-expert4-flash-seq4096.hlo.gz"
    kinds, memory = compiled(str(tmp_path), "mixtral-8x7b", 64,
                             ["mesh.data=1", "mesh.fsdp=16", "mesh.expert=4", *MOE_TPU.split()])
    theirs = peer(os.path.join(PEERS, name), 64)["kinds"]
    ragged = kinds.get("ragged-all-to-all", [0])[0]
    assert ragged == theirs["ragged-all-to-all"][0] == 192, (kinds, theirs)
    # No padded dispatch: the only all-to-alls left are the embedding lookup's, as in MaxText's.
    assert kinds.get("all-to-all", [0])[0] == theirs["all-to-all"][0], (kinds, theirs)
    assert _sent(kinds, "all-to-all") <= _sent(theirs, "all-to-all"), (kinds, theirs)
    assert _sent(kinds) <= _sent(theirs), (_sent(kinds) / 1e9, _sent(theirs) / 1e9)
    at_most_maxtext(memory, peer_memory(name))


def test_llama3_70b_gathers_no_more_than_maxtext(tmp_path) -> None:
    """Llama-3-70B, fsdp=128 on 128 v5p chips, 128 x 8192: the bytes all-gathers send per device
    at most MaxText's 273.75 GB (each layer's attention weights gathered as often as in its
    program), arguments and arguments + temporaries at most MaxText's."""
    name = "maxtext-e591f30-llama3-70b-v5p128chips-fsdp128-flash-seq8192.hlo.gz"
    kinds, memory = compiled(str(tmp_path), "llama3-70b", 128,
                             ["mesh.data=1", "mesh.fsdp=128", "train.global_batch=128", "train.grad_accum=1",
                              "model.attention=splash"])
    theirs = peer(os.path.join(PEERS, name), 128)["kinds"]
    assert _sent(kinds, "all-gather") <= _sent(theirs, "all-gather"), (kinds, theirs)
    at_most_maxtext(memory, peer_memory(name))
