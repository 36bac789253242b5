"""A stated hardware model: what a device can do, and the step time that follows from a plan.

The figures are vendor peaks (dense bf16, HBM, links), not measurements; `matmul_efficiency`
and `memory_reserve` are assumptions, named as such. The step-time model, per device:

    compute  = hardware FLOPs / (peak x matmul_efficiency)         (model FLOPs + remat recompute)
    hbm      = HBM bytes / HBM bandwidth                           (a rough lower bound, see hbm_bytes)
    overlap  = time of collectives over batch axes only (data, fsdp): weight gathers and gradient
               reductions, which XLA's latency-hiding scheduler runs beside the layers' compute
    exposed  = time of every other collective (tensor: activations on the critical path;
               pipeline: stage hand-offs and weight regrouping)
    step     = max(compute, hbm, overlap) / (1 - pipeline bubble) + exposed
    MFU      = model FLOPs / (step x peak)

A collective costs ring-algorithm bytes (sharding.hlo.RING_FACTORS) over the slowest link its
groups use: the intra-node link if every group stays inside one node, else the inter-node one.
Per-op latency is left out (about 1,000 ops per step for an 8B model: milliseconds, against a
step of seconds).
"""

from __future__ import annotations

import dataclasses

BATCH_AXES = ("data", "fsdp")  # activations never cross these inside a step, weights/grads do


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes_per_s: float
    memory_bytes: float
    intra_node_bytes_per_s: float  # per device per direction
    inter_node_bytes_per_s: float  # per device per direction
    devices_per_node: int  # devices sharing the fast link
    matmul_efficiency: float = 0.7  # assumed fraction of peak the step's matmuls reach
    memory_reserve: float = 0.1  # assumed share of memory kept by the runtime (context, workspaces, NCCL)

    @property
    def memory_budget(self) -> float:
        return self.memory_bytes * (1 - self.memory_reserve)


HARDWARE = {
    # H100 SXM: NVLink 4 gives 900 GB/s per GPU both ways; InfiniBand NDR 400 Gb/s per GPU.
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9, 450e9, 50e9, 8),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, 450e9, 50e9, 8),
    # v5p: 4,800 Gb/s of ICI per chip over 6 links; a ring along one torus axis uses 2 of them
    # (2 x 100 GB/s, an assumption). A slice (up to 8,960 chips) is all ICI; between slices the
    # data-center network, assumed 25 GB/s per chip.
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 2.76e12, 95e9, 200e9, 25e9, 8960),
}


def collective_seconds(wire_bytes: float, inter_node: bool, hw: Hardware) -> float:
    return wire_bytes / (hw.inter_node_bytes_per_s if inter_node else hw.intra_node_bytes_per_s)


def hbm_bytes(state_bytes: float, weight_bytes: float, weight_passes: int, temp_bytes: float) -> float:
    """A rough lower bound on HBM traffic per step and device: the optimizer reads parameters,
    gradients and both moments and writes three of them back (28 bytes per 12 bytes of f32
    state); every matmul pass (forward, two backward, and a recompute under remat) reads the
    weights in compute dtype; every temporary is written once and read once."""
    return state_bytes * 28 / 12 + weight_passes * weight_bytes + 2 * temp_bytes


def predict(
    *,
    hw: Hardware,
    model_flops: float,
    hardware_flops: float,
    hbm: float,
    collectives: list[dict],
    bubble: float,
) -> dict[str, float]:
    """Step-time terms in seconds and the MFU. collectives: dicts with `axes`, `wire_bytes`
    (per step, all executions) and `inter_node`; each gains `seconds` and `overlapped`."""
    overlap = exposed = 0.0
    for c in collectives:
        c["seconds"] = collective_seconds(c["wire_bytes"], c["inter_node"], hw)
        c["overlapped"] = all(a in BATCH_AXES for a in c["axes"])
        if c["overlapped"]:
            overlap += c["seconds"]
        else:
            exposed += c["seconds"]
    compute = hardware_flops / (hw.peak_flops * hw.matmul_efficiency)
    memory = hbm / hw.hbm_bytes_per_s
    step = max(compute, memory, overlap) / (1 - bubble) + exposed
    return {
        "compute_s": compute,
        "hbm_s": memory,
        "overlapped_comm_s": overlap,
        "exposed_comm_s": exposed,
        "bubble": bubble,
        "step_s": step,
        "mfu": model_flops / (step * hw.peak_flops) if step > 0 else 0.0,
    }
