"""The analytic ranking `plan.py --search --top K` orders layouts by before it compiles the K
best: a model's step has to be compiled to be known, and a 671B model's compile takes minutes,
so a search of hundreds of layouts compiles only the most promising ones.

Per device, from the config and the exact state sizes (nothing compiled):

    memory   = parameters + optimizer state + one gradient the size of the parameters
               + the layer inputs `remat: full` keeps (L x A; A: one layer's activations
               [local batch, length, embed] in the compute dtype). Other policies keep more:
               this is the floor of what the compile will need, so a layout over the budget
               here is dropped, and one under it is only a candidate.
    compute  = model FLOPs / (peak x matmul_efficiency), x 4/3 under `remat: full` (the
               forward again), divided by (1 - bubble) on a pipelined mesh
    comm     = the layout's minimum traffic (planner/minimum.py: the gathers of the weights
               outside the experts stored over fsdp x expert included) plus, over `expert`, the
               all-to-all (each token's top-k copies of A's row out to the experts and back,
               forward and backward, and the forward again under `remat: full`, over every MoE
               layer and the prediction modules' MoE blocks, (n-1)/n of it leaving the device)
    step     = max(compute, comm over data and fsdp) + the rest of comm, each axis at the
               speed of the slowest link its groups cross (sharding/hardware.py)
"""

from __future__ import annotations

import numpy as np

from configs import Config
from configs.schema import MESH_AXES, RECOMPUTES_ALL
from model import flops_per_token
from model.flops import moe_layer_count
from pipeline import bubble_fraction
from sharding.hardware import BATCH_AXES, Hardware, collective_seconds
from sharding.mesh import resolve_mesh_shape
from sharding.rules import axes_size, mesh_axes, to_rules


def activation_bytes(cfg: Config, sizes: dict[str, int]) -> float:
    """One layer's activations on one device: [local batch, length / context, embed]."""
    m = cfg.model
    shards = axes_size(mesh_axes("batch", to_rules(cfg.sharding.activations)), sizes) * sizes["context"]
    return cfg.train.global_batch / shards * m.seq_len * m.d_model * np.dtype(m.dtype).itemsize


def expert_bytes(cfg: Config, sizes: dict[str, int]) -> float:
    """The least bytes one device sends over `expert` per step: its tokens' routed copies."""
    n, m = sizes["expert"], cfg.model
    if n == 1 or m.moe.num_experts <= 1:
        return 0.0
    moe_layers = moe_layer_count(m) + m.mtp_depth  # a prediction module's block is an MoE too
    passes = 4 + (2 if m.remat in RECOMPUTES_ALL else 0)  # dispatch and combine, forward, backward (and recompute)
    return moe_layers * passes * m.moe.experts_per_token * activation_bytes(cfg, sizes) * (n - 1) / n


def inter_node_axes(cfg: Config, sizes: dict[str, int], hw: Hardware) -> set[str]:
    """The mesh axes whose groups cross nodes: `mesh.across` on a hybrid mesh; on one GPU
    "node" of more devices than a host has, the axes whose groups span more than one host (the
    mesh is laid out row-major, outermost axis first); none inside one TPU slice."""
    if cfg.mesh.nodes > 1:
        return {cfg.mesh.across} if sizes[cfg.mesh.across] > 1 else set()
    if not hw.devices_per_node:
        return set()
    inner = 1
    crossing = set()
    for axis in reversed(MESH_AXES):
        inner *= sizes[axis]
        if sizes[axis] > 1 and inner > hw.devices_per_node:
            crossing.add(axis)
    return crossing


def estimate(cfg: Config, n: int, state: dict, hw: Hardware) -> dict[str, float]:
    """Memory floor and step time of one layout on n devices, per device, in bytes and seconds."""
    sizes = resolve_mesh_shape(cfg.mesh, n)
    m = cfg.model
    memory = 2 * state["params"] + state["optimizer"] + m.num_layers * activation_bytes(cfg, sizes)
    tokens = state["sequences"] * m.seq_len
    compute = flops_per_token(m) * tokens / n / (hw.peak_flops * hw.matmul_efficiency)
    compute *= 4 / 3 if m.remat in RECOMPUTES_ALL else 1.0
    if sizes["pipeline"] > 1:
        p = cfg.pipeline
        compute /= 1 - bubble_fraction(sizes["pipeline"], p.repeats, p.microbatches, p.schedule)
    sent = dict(state["minimum"])
    sent["expert"] = sent.get("expert", 0.0) + expert_bytes(cfg, sizes)
    crossing = inter_node_axes(cfg, sizes, hw)
    overlapped = exposed = 0.0
    for key, wire in sent.items():
        group = key.split("+")  # a group of axes, e.g. fsdp+expert: crosses nodes where one of them does
        seconds = collective_seconds(wire, any(a in crossing for a in group), hw)
        if all(a in BATCH_AXES for a in group):
            overlapped += seconds
        else:
            exposed += seconds
    return {"memory": memory, "compute_s": compute, "comm_s": overlapped + exposed,
            "step_s": max(compute, overlapped) + exposed}


def rank(rows: list[dict], n: int, hw: Hardware, top: int) -> None:
    """Orders the pending rows by their estimate (those whose memory floor fits first, fastest
    first) and marks all but the `top` best as not compiled, each with its analytic rank."""
    pending = [r for r in rows if r["status"] == "pending"]
    for r in pending:
        r["estimate"] = estimate(r["cfg"], n, r["state"], hw)
    pending.sort(key=lambda r: (r["estimate"]["memory"] > hw.memory_budget, r["estimate"]["step_s"]))
    for i, r in enumerate(pending, start=1):
        r["analytic_rank"] = i
        if r["estimate"]["memory"] > hw.memory_budget:
            r.update(status="does not fit", reason=f"at least {r['estimate']['memory'] / 1e9:.1f} GB by the analytic "
                                                   "estimate (state, gradient, layer inputs)")
        elif i > top:
            e = r["estimate"]
            r.update(status="not compiled", reason=f"analytic rank {i}: step about {e['step_s']:.3g} s, "
                                                   f"at least {e['memory'] / 1e9:.1f} GB")
