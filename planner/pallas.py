"""Pallas kernels in compiled HLO: which kernel a custom call is, and its FLOPs from its shapes.

A Pallas kernel compiles to an opaque custom call (`tpu_custom_call` on TPU, Triton or Mosaic
GPU on GPU), which XLA's cost analysis counts as 0 FLOPs. The kernel is named by the
`pallas_call`'s name: the instruction's name (`gmm.10`, `splash_mha_fwd_segmented_residuals.3`)
and its `op_name` metadata (`.../jit(tgmm)/pallas_call`); a splash call named only
`_splash_attention` (the phase's name is not always kept) by the block sizes in its
`kernel_metadata`: the forward's carry `block_q`, the dq kernel's only `block_q_dq`, the dkv
kernel's only `block_q_dkv`. Known kernels get their own formula:

- megablox `gmm`: lhs [m, k] times each row's expert of rhs [G, k, n] -> [m, n]: 2 m k n.
- megablox `tgmm`: lhs [m, k] transposed times rhs [m, n], summed per group -> [G, k, n]: 2 m k n.
  Both run only the row tiles their group sizes fill (data), so all m rows are a bound: exact
  when every row is routed (dropless without expert parallelism), 4x the balanced work on the
  padded buffer a ragged all-to-all fills under `expert`=4.
- splash attention (`splash_{mha,mqa}_{fwd,dq,dkv}`): q [..., H, T, D] against k [..., S, D]:
  2 T S D per q head per matmul: the forward runs 2 (Q K^T, P V), the dq kernel 3 (Q K^T,
  dO V^T, dS K), the dkv kernel 4 (Q K^T, P^T dO, dO V^T, dS^T Q), 5 when it is the fused
  backward (it also writes dq). Splash skips the blocks its mask leaves empty and computes the
  others whole; the mask is data (its literal is elided in the text), so the kernels are charged
  as causal, the mask every training step here (meshlm's and MaxText's) uses: the blocks on or
  below the diagonal of the block grid its `s8[h, nq, nk]` block-mask operand has, (n + 1) / 2n
  of the square for n x n blocks (half as n grows, as the cuDNN case is charged). A ring block
  every query sees whole (model/ring_blocks.py names its scope `unmasked_block`) is charged whole.

Any other Pallas kernel has unknown FLOPs: `flops` returns None and the planner says so.
"""

from __future__ import annotations

import math
import re

from model.ring_blocks import UNMASKED  # the named scope (in op_name) of a splash call on a ring block seen whole

_DIMS = re.compile(r"\b(?:pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_FLOAT = re.compile(r"\b(?:bf16|f16|f32|f8e\w+)\[([\d,]*)\]")
TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")
_SPLASH = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)")
_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}
CAUSAL = 0.5  # the share of the [T, S] scores a causal mask leaves to compute


def is_pallas(target: str) -> bool:
    """Whether a custom call's target is a Pallas kernel's."""
    return target in TARGETS


def kernel_name(name: str, attrs: str) -> str:
    """Which kernel: "gmm", "tgmm", "splash_fwd", "splash_dq", "splash_dkv", or "" (unknown),
    from the instruction's name and its `op_name`."""
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    text = name + " " + (op_name.group(1) if op_name else "")
    splash = _SPLASH.search(text)
    if splash:
        return "splash_" + splash.group(2)
    if "splash" in text:  # named only `_splash_attention`: the block sizes it was given name the phase
        blocks = set(re.findall(r'\\"(block_\w+)\\"', attrs))
        phase = "fwd" if "block_q" in blocks else "dq" if "block_q_dq" in blocks else "dkv" if "block_q_dkv" in blocks else ""
        return "splash_" + phase if phase else ""
    words = set(re.findall(r"[a-z]+", text.replace("_", " ")))
    return "tgmm" if "tgmm" in words else "gmm" if "gmm" in words else ""


def _dims(type_text: str) -> list[list[int]]:
    return [[int(d) for d in dims.split(",") if d] for dims in _DIMS.findall(type_text)]


def _floats(types: list[str]) -> list[list[int]]:
    """The float arrays among the operand types, in order (the index and mask operands dropped)."""
    return [[int(d) for d in m.split(",") if d] for t in types for m in _FLOAT.findall(t)]


def _grouped(kernel: str, result: list[int], operands: list[list[int]]) -> float | None:
    """gmm: a 2D lhs then a 3D rhs; tgmm: two 2D operands sharing m (an accumulated output, when
    given, follows them)."""
    pairs = list(zip(operands, operands[1:]))
    if kernel == "gmm" and len(result) == 2:
        lhs = next((a for a, b in pairs if len(a) == 2 and len(b) == 3), None)
        return 2.0 * lhs[0] * lhs[1] * result[1] if lhs else None
    if kernel == "tgmm" and len(result) == 3:
        lhs = next((a for a, b in pairs if len(a) == len(b) == 2 and a[0] == b[0]), None)
        return 2.0 * lhs[0] * result[1] * result[2] if lhs else None
    return None


def causal_share(t: int, s: int, grid: list[int]) -> float:
    """The share of the [t, s] scores a causal kernel computes: the blocks of its [nq, nk] grid
    holding a key at or before some query of the block (a block on the diagonal is computed whole);
    half when the grid is unknown."""
    if len(grid) < 2 or not grid[-2] or not grid[-1] or t % grid[-2] or s % grid[-1]:
        return CAUSAL
    nq, nk = grid[-2:]
    bq, bk = t // nq, s // nk
    return sum(min(nk, ((i + 1) * bq - 1) // bk + 1) for i in range(nq)) / (nq * nk)


def _splash(kernel: str, results: list[list[int]], operands: list[list[int]], grid: list[int] | None) -> float | None:
    """grid: the block-mask operand's [h, nq, nk] (causal), [] when absent (causal, half), None:
    the call runs unmasked (every block)."""
    if len(operands) < 2 or len(operands[0]) < 3 or len(operands[1]) < 2:
        return None
    q, k = operands[0], operands[1]
    heads, t, d = math.prod(q[:-2]), q[-2], q[-1]
    matmuls = _MATMULS[kernel.removeprefix("splash_")]
    if kernel == "splash_dkv" and any(len(r) > len(q) and r[-len(q):] == q for r in results):
        matmuls = 5  # the fused backward also writes (unreduced) dq
    share = 1.0 if grid is None else causal_share(t, k[-2], grid)
    return matmuls * 2.0 * heads * t * k[-2] * d * share


def flops(name: str, attrs: str, result_type: str, operand_types: list[str]) -> tuple[str, float | None]:
    """The kernel's name and its FLOPs per execution (None: a kernel this module does not know,
    or a known one whose shapes are not the ones its formula reads)."""
    kernel = kernel_name(name, attrs)
    operands = _floats(operand_types)
    if kernel in ("gmm", "tgmm"):
        result = _dims(result_type)
        return kernel, _grouped(kernel, result[0] if result else [], operands)
    if kernel.startswith("splash_"):
        masks = [m for t in operand_types for m in _dims(t) if t.startswith("s8[") and len(m) == 3]
        # A ring block whose keys every query sees runs under model/ring_blocks.py's named scope.
        unmasked = UNMASKED in attrs
        return kernel, _splash(kernel, _dims(result_type), operands, None if unmasked else masks[0] if masks else [])
    return kernel, None
