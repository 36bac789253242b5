"""Per-device memory and collectives by kind, meshlm's compiled step beside a peer's program.

For each case (preset, layout, hardware) `plan.py` compiles meshlm's step with the target's own
compiler; where the case names a peer's compiled program (MaxText's, tests/fixtures/peers, or
a path given with --peer), the same parser (planner/hlo.py) reads it, and its memory comes from
the `memory_analysis()` saved beside it (`.mem.json`) where there is one. Counts are per step
with loop trips; "buffer" is the ops' full buffers, "sent" the ring bytes each device sends for
the op as the compiler wrote it (a gather written as an all-reduce sends an all-reduce's).
Memory is arguments + temporaries per device. A cell reads "executions: buffer GB / sent GB"; a
ragged all-to-all (an expert dispatch sending only the routed rows) is sent at its bound, its
output buffers, with what balanced routing would send beside it.

    python -m bench.collectives                       # every case: the BENCHMARKS table
    python -m bench.collectives --case "llama3-8b tpu-v5p 64 mesh.data=1 mesh.fsdp=64" --peer PROGRAM.hlo.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

from planner.hlo import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "tests", "fixtures", "peers")
MAXTEXT = "maxtext-e591f30-llama3-8b-v5p64-"
MIXTRAL = "maxtext-e591f30-mixtral-8x7b-v5p64-"
MOE_TPU = "model.attention=splash model.moe.grouped_matmul=megablox"
# (preset, hardware, devices, overrides, the peer's program or "")
CASES = [
    ("llama3-8b", "tpu-v5p", 64, "mesh.data=1 mesh.fsdp=64", MAXTEXT + "fsdp64.hlo.gz"),
    ("llama3-8b", "tpu-v5p", 64, "mesh.data=4 mesh.fsdp=16", MAXTEXT + "data4-fsdp16.hlo.gz"),
    ("llama3-8b", "tpu-v5p", 64, "mesh.data=1 mesh.fsdp=64 model.attention=splash", ""),
    # MaxText's MoE and 70B programs (flash attention, megablox, remat full), meshlm's the same way
    ("mixtral-8x7b", "tpu-v5p", 64, f"mesh.data=1 mesh.fsdp=64 {MOE_TPU}", MIXTRAL + "fsdp64-flash-seq4096.hlo.gz"),
    ("mixtral-8x7b", "tpu-v5p", 64, f"mesh.data=1 mesh.fsdp=16 mesh.expert=4 {MOE_TPU}",
     MIXTRAL + "fsdp16-expert4-flash-seq4096.hlo.gz"),
    ("llama3-70b", "tpu-v5p", 128, "mesh.data=1 mesh.fsdp=128 train.global_batch=128 train.grad_accum=1 model.attention=splash",
     "maxtext-e591f30-llama3-70b-v5p128chips-fsdp128-flash-seq8192.hlo.gz"),
]
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
GB = 1e9


def _by_kind(ops: list[dict]) -> dict[str, list[float]]:
    """kind (with the op it is written as) -> [executions, buffer bytes, bytes sent, bytes sent
    under balanced routing], per step (a ragged all-to-all's "sent" is its bound, the buffer)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for c in ops:
        if c["group_size"] <= 1:
            continue
        key = c["kind"] + (f" (as {c['lowered_as']})" if c["lowered_as"] else "")
        t = out[key]
        t[0] += c["count"]
        t[1] += c["bytes"] * c["count"]
        t[2] += c["wire_bytes"] * c["count"]
        t[3] += (c.get("balanced") or c["wire_bytes"]) * c["count"]
    return dict(out)


def meshlm(preset: str, hardware: str, devices: int, overrides: str, keep: str = "") -> dict:
    """meshlm's step compiled by plan.py: memory (arguments + temporaries) and collectives by
    kind; `keep`: a folder to leave the compiled program and the plan in."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = os.path.join(keep, "_".join(overrides.split()).replace("=", "")) if keep else scratch
        out = os.path.join(tmp, "plan.json")
        cmd = [sys.executable, os.path.join(ROOT, "plan.py"), "--config", preset, "--devices", str(devices),
               "--hardware", hardware, "--out", out, "--dump-hlo", tmp, *overrides.split()]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode not in (0, 1):
            raise SystemExit(f"plan.py failed for {preset} {overrides}:\n{done.stderr[-2000:]}")
        p = json.load(open(out))["plans"][0]
        hlo = sorted(f for f in os.listdir(tmp) if f.endswith(".hlo"))[-1]
        with open(os.path.join(tmp, hlo)) as f:
            return {"memory": p["memory"]["arguments"] + p["memory"]["temps"], "kinds": _program(f.read(), devices)}


def _program(text: str, devices: int) -> dict[str, list[float]]:
    ops, _ = collectives(text, {"devices": devices}, devices)
    return _by_kind([{**c.__dict__, "wire_bytes": c.wire_bytes} for c in ops])


def peer(path: str, devices: int) -> dict:
    """A peer's compiled program (HLO text, gzipped or not) and its `.mem.json` beside it, if any:
    collectives by kind, memory (arguments + temporaries) and arguments, in bytes."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        kinds = _program(f.read(), devices)
    mem_path = path.removesuffix(".gz").removesuffix(".hlo") + ".mem.json"
    memory = arguments = None
    if os.path.exists(mem_path):
        mem = json.load(open(mem_path))
        arguments = mem["argument_size_in_bytes"]
        memory = arguments + mem["temp_size_in_bytes"]
    return {"memory": memory, "arguments": arguments, "kinds": kinds}


def row(name: str, result: dict) -> str:
    """One table row: memory, then per kind "executions: buffer GB / sent GB" (a kind some of
    whose ops the compiler wrote as another says so), then all bytes sent."""
    memory = f"{result['memory'] / GB:.2f}" if result["memory"] is not None else "-"
    cells = []
    for kind in KINDS:
        parts = {k: v for k, v in result["kinds"].items() if k.split(" ")[0] == kind}
        if not parts:
            cells.append("-")
            continue
        count, buffer, sent = (sum(v[i] for v in parts.values()) for i in range(3))
        written = [f"{v[0]:.0f} as {k.split('(as ')[1].rstrip(')')}" for k, v in sorted(parts.items()) if "(as " in k]
        note = f" ({', '.join(written)})" if written else ""
        balanced = f" (balanced {sum(v[3] for v in parts.values()) / GB:.2f})" if kind == "ragged-all-to-all" else ""
        cells.append(f"{count:.0f}{note}: {buffer / GB:.2f} / {sent / GB:.2f}{balanced}")
    sent = sum(v[2] for v in result["kinds"].values())
    return f"| {name} | {memory} | " + " | ".join(cells) + f" | **{sent / GB:.2f}** |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help='"PRESET HARDWARE DEVICES [KEY=VALUE ...]"')
    parser.add_argument("--peer", action="append", default=[], help="a peer's compiled HLO for each --case, in order")
    parser.add_argument("--keep", default="", help="leave each compiled program and plan in a folder here")
    args = parser.parse_args()
    cases = CASES
    if args.case:
        given = [c.split(maxsplit=3) + [""] * (4 - len(c.split(maxsplit=3))) for c in args.case]
        cases = [(p, h, int(n), o, args.peer[i] if i < len(args.peer) else "") for i, (p, h, n, o) in enumerate(given)]
    print("| program | memory GB | " + " | ".join(KINDS) + " | sent GB |")
    print("| --- | ---: |" + " ---: |" * len(KINDS) + " ---: |")
    for preset, hardware, devices, overrides, other in cases:
        label = f"{preset}, {hardware} x {devices}, `{overrides}`"
        print(row(f"meshlm, {label}", meshlm(preset, hardware, devices, overrides, args.keep)), flush=True)
        if other:
            path = other if os.path.exists(other) else os.path.join(PEERS, other)
            print(row(f"peer: {os.path.basename(path)}", peer(path, devices)), flush=True)


if __name__ == "__main__":
    main()
