"""The hardware table: what each target device is, which compiler builds for it, and the step
time that follows from a compiled program.

Vendor figures (dense bf16 peak, HBM size and bandwidth, link bandwidths) are datasheet values;
`matmul_efficiency` and `hbm_efficiency` are calibrations: the fractions of peak that a large
bf16 matmul and an elementwise pass reach on an H100 SXM, carried over as assumptions to the
other devices. `memory_reserve` is an
assumption for GPUs (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers); a TPU compile checks
its own memory, so TPUs reserve nothing here.

The step-time model, per device (inputs from planner/roofline.py and planner/hlo.py):

    compute  = sum over the compiled program's kernels of max(FLOPs / (peak x matmul_efficiency),
               bytes / (HBM bandwidth x hbm_efficiency)), loop trips included
    overlap  = collectives over batch axes only (data, fsdp): weight gathers and gradient
               reductions, which the latency-hiding scheduler runs beside the layers' compute;
               and collective-permutes the compiled schedule runs beside kernels (kernels
               between their start and done: ring attention's next block)
    exposed  = every other collective (tensor: activations on the critical path; pipeline:
               stage hand-offs)
    step     = max(compute, overlap) + exposed
               (no bubble term: every pipeline schedule here runs each stage on every tick, idle
               ones on masked inputs, so the compiled compute already holds the bubble)
    MFU      = model FLOPs / (step x peak)

`peak` in the compute term is the rate of the kernel's matmul operands (`low_precision_flops`:
FP8 and int8 dense peaks from the datasheets, where the device has them; every other kernel at
the bf16 peak). MFU stays defined against the bf16 peak whatever `model.quant` is, so an FP8
run's MFU can pass what bf16 could reach but stays comparable between runs.

A collective costs ring-algorithm bytes (planner.hlo.RING_FACTORS) over the slowest link its
groups cross: the intra-node link (NVLink, ICI) if every group stays inside one node or slice,
else the inter-node one (InfiniBand, data-center network).
"""

from __future__ import annotations

import dataclasses

BATCH_AXES = ("data", "fsdp")  # activations never cross these inside a step, weights/grads do


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    platform: str  # the compiler that builds for it: "cuda" or "tpu"
    spec: str  # cuda: the GPU target description in planner/gpu_specs/; tpu: libtpu's generation name
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes_per_s: float
    memory_bytes: float  # what the device reports (GPU: the target description's device_memory_size)
    intra_node_bytes_per_s: float  # per device per direction
    inter_node_bytes_per_s: float  # per device per direction
    devices_per_node: int  # GPUs sharing NVLink; TPU: 0, a slice is all ICI (slices are the nodes)
    device_kinds: tuple[str, ...]  # substrings of jax's `device_kind` that name this device
    torus_dims: int = 0  # TPU: 2 (v5e, v6e) or 3 (v5p) slice dimensions
    matmul_efficiency: float = 0.70
    hbm_efficiency: float = 0.78
    memory_reserve: float = 0.0
    # Dense peaks of the low-precision matmuls, by roofline precision ("fp8", "int8"); a
    # `model.quant` mode missing here has no matmul unit on the device and is refused.
    low_precision_flops: dict[str, float] = dataclasses.field(default_factory=dict, hash=False)

    def peak_for(self, precision: str) -> float:
        """FLOP/s of a matmul kernel whose operands are `precision` ("bf16": the peak_flops)."""
        return self.low_precision_flops.get(precision, self.peak_flops)

    @property
    def memory_budget(self) -> float:
        return self.memory_bytes * (1 - self.memory_reserve)


# What a GPU keeps outside JAX's memory (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers): the
# planner's budget, and the share the entry points leave outside JAX's pool (ops.xla_env).
GPU_MEMORY_RESERVE = 0.1
_GPU = dict(platform="cuda", devices_per_node=8, memory_reserve=GPU_MEMORY_RESERVE)
# Dense datasheet peaks: H100/H200 SXM FP8 and INT8 1,979 T/s (twice bf16); A100 INT8 624 TOPS,
# no FP8; TPU INT8 (v4 275, v5e 394, v5p 918, v6e 1,836 TOPS), no FP8 before TPU7x.
_HOPPER_8BIT = {"fp8": 1979e12, "int8": 1979e12}
HARDWARE = {
    # NVLink 4 (H100/H200): 900 GB/s per GPU both ways; InfiniBand NDR: 400 Gb/s per GPU.
    "h100": Hardware("h100", spec="h100_sxm.txtpb", peak_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=84.94e9,
                     intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, device_kinds=("H100",),
                     low_precision_flops=_HOPPER_8BIT, **_GPU),
    "h200": Hardware("h200", spec="h200.txtpb", peak_flops=989e12, hbm_bytes_per_s=4.8e12, memory_bytes=151.4e9,
                     intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, device_kinds=("H200", "GH200"),
                     low_precision_flops=_HOPPER_8BIT, **_GPU),
    # NVLink 3 (A100): 600 GB/s per GPU both ways; InfiniBand HDR: 200 Gb/s per GPU.
    "a100": Hardware("a100", spec="a100_sxm_80.txtpb", peak_flops=312e12, hbm_bytes_per_s=2.039e12,
                     memory_bytes=85.2e9, intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9,
                     device_kinds=("A100",), low_precision_flops={"int8": 624e12}, **_GPU),
    # TPU ICI per chip: v5e 1,600 Gb/s, v5p 4,800 Gb/s, v6e 3,584 Gb/s over all links; a ring
    # along one torus axis is assumed to use two links' worth. Between slices the data-center
    # network, assumed 25 GB/s per chip. A slice is the "node": every chip of it shares ICI.
    "tpu-v4": Hardware("tpu-v4", platform="tpu", spec="v4", peak_flops=275e12, hbm_bytes_per_s=1.2e12,
                       memory_bytes=32e9, intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=25e9,
                       devices_per_node=0, device_kinds=("TPU v4",), torus_dims=3, low_precision_flops={"int8": 275e12}),
    "tpu-v5e": Hardware("tpu-v5e", platform="tpu", spec="v5e", peak_flops=197e12, hbm_bytes_per_s=0.819e12,
                        memory_bytes=16e9, intra_node_bytes_per_s=50e9, inter_node_bytes_per_s=25e9,
                        devices_per_node=0, device_kinds=("TPU v5 lite", "TPU v5e"), torus_dims=2,
                        low_precision_flops={"int8": 394e12}),
    "tpu-v5p": Hardware("tpu-v5p", platform="tpu", spec="v5p", peak_flops=459e12, hbm_bytes_per_s=2.765e12,
                        memory_bytes=95e9, intra_node_bytes_per_s=200e9, inter_node_bytes_per_s=25e9,
                        devices_per_node=0, device_kinds=("TPU v5p", "TPU v5"), torus_dims=3,
                        low_precision_flops={"int8": 918e12}),
    "tpu-v6e": Hardware("tpu-v6e", platform="tpu", spec="v6e", peak_flops=918e12, hbm_bytes_per_s=1.64e12,
                        memory_bytes=32e9, intra_node_bytes_per_s=112e9, inter_node_bytes_per_s=25e9,
                        devices_per_node=0, device_kinds=("TPU v6 lite", "TPU v6e"), torus_dims=2,
                        low_precision_flops={"int8": 1836e12}),
}


def hardware_of_kind(device_kind: str) -> Hardware | None:
    """The table's entry for a jax `device_kind` (longest matching name wins); None for a device
    not in the table (a CPU)."""
    matches = [(k, hw) for hw in HARDWARE.values() for k in hw.device_kinds if k in device_kind]
    return max(matches, key=lambda m: len(m[0]))[1] if matches else None


def peak_flops_of_kind(device_kind: str) -> float | None:
    """The dense bf16 peak of a device by its jax `device_kind`; None for one not in the table."""
    hw = hardware_of_kind(device_kind)
    return hw.peak_flops if hw else None


def collective_seconds(wire_bytes: float, inter_node: bool, hw: Hardware) -> float:
    return wire_bytes / (hw.inter_node_bytes_per_s if inter_node else hw.intra_node_bytes_per_s)


def kernel_seconds(flops: float, bytes_accessed: float, hw: Hardware, precision: str = "bf16") -> float:
    """Roofline time of one kernel: bound by its matmul rate (that of its operands' `precision`)
    or by its memory traffic."""
    return max(flops / (hw.peak_for(precision) * hw.matmul_efficiency),
               bytes_accessed / (hw.hbm_bytes_per_s * hw.hbm_efficiency))


def check_quant(quant: str, hw: Hardware) -> str | None:
    """Why `model.quant=quant` cannot run on `hw` (None: it can)."""
    if quant == "none" or quant in hw.low_precision_flops:
        return None
    has = ", ".join(sorted(hw.low_precision_flops)) or "none"
    return f"{quant} has no matmul unit on {hw.name} (its low-precision matmuls: {has})"


def predict(*, hw: Hardware, model_flops: float, compute_s: float, collectives: list[dict], bubble: float) -> dict[str, float]:
    """Step-time terms in seconds and the MFU. compute_s: the roofline of the compiled kernels;
    collectives: dicts with `axes`, `wire_bytes` (per step), `inter_node` and `beside` (a
    permute the schedule runs beside kernels; absent: False); each gains
    `seconds` and `overlapped`."""
    overlap = exposed = 0.0
    for c in collectives:
        c["seconds"] = collective_seconds(c["wire_bytes"], c["inter_node"], hw)
        c["overlapped"] = all(a in BATCH_AXES for a in c["axes"]) or c.get("beside", False)
        if c["overlapped"]:
            overlap += c["seconds"]
        else:
            exposed += c["seconds"]
    step = max(compute_s, overlap) + exposed  # `bubble` is reported only: compute_s already holds it
    return {
        "compute_s": compute_s,
        "overlapped_comm_s": overlap,
        "exposed_comm_s": exposed,
        "bubble": bubble,
        "step_s": step,
        "mfu": model_flops / (step * hw.peak_flops) if step > 0 else 0.0,
    }
