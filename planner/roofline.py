"""A roofline over a compiled program: the FLOPs and HBM bytes of every kernel the compiler
emitted, each timed at the slower of its matmul rate and its memory traffic.

Works on the optimized HLO text of any compiler (GPU, TPU, CPU), which is what runs: a
*kernel* is an instruction of a non-fused computation (the entry, loop bodies, called
computations) that does work: a fusion, a custom call (cuBLAS GEMM, cuDNN attention), or a
bare op. Its executions per step are its computation's loop trip counts (planner.hlo).

- FLOPs: 2 x result elements x contracted elements for every `dot` inside a fusion (nested
  fusions included) or a GEMM custom call, and for every `convolution` (the TPU's matmul) the
  multiply-adds that land on real input (a padded window is not all work); cuDNN flash attention counts its
  two (forward) or five (backward) matmuls of [T, S] per head, halved when causal; a Pallas
  kernel (megablox gmm/tgmm, splash attention) its own formula (planner.pallas). A Pallas kernel
  that module does not know is charged its bytes and 0 FLOPs, and `unknown_flops` names it.
- Bytes: the kernel's operands plus its result, except that an operand a fusion only reads
  through `dynamic-slice` counts the slices (a scan reading layer i of a stacked weight), also
  when the slice sits in a fusion nested inside it, and a fusion whose root is
  `dynamic-update-slice` writes only the update (in place), as does a bare one; a bare
  `dynamic-slice` moves its slice.
- Precision: a kernel whose matmul reads float8 operands is "fp8", one reading int8 "int8"
  (timed at that rate, sharding.hardware), any other "bf16" (the device's default peak).
Collectives are left to planner.hlo and the step-time model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any, Callable, NamedTuple

from planner import pallas
from planner.hlo import COLLECTIVES, HEADER, multiplicities, shape_bytes

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_DIMS = re.compile(r"\[([\d,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "copy-done",
         "send-done", "recv-done", "async-done", "get-dimension-size"}


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    args: str  # the raw operand text (a parameter's index)


def _split_args(text: str) -> tuple[str, str]:
    """'a, b), attr=...' -> ('a, b', 'attr=...'): the operand list and what follows it."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "({["
        depth -= ch in ")}]"
        if depth < 0:
            return text[:i], text[i + 1:]
    return text, ""


def _instruction_lines(hlo_text: str) -> list[str]:
    """The text's lines with an instruction that spans several (a Pallas call's `kernel_metadata`
    holds newlines) joined into one, so its `op_name` and backend_config stay with it. A line
    that starts an instruction or a computation always starts a new one."""
    out: list[str] = []
    depth = 0
    for line in hlo_text.splitlines():
        starts = bool(_INSTR.match(line) or HEADER.match(line))
        if depth > 0 and not starts:
            out[-1] += line
        else:
            out.append(line)
            depth = 0
        if starts or depth > 0:
            depth += line.count("{") - line.count("}")
        if HEADER.match(line):
            depth = 0
    return out


def parse(hlo_text: str) -> dict[str, list[Instr]]:
    """Computation name -> its instructions, in order."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in _instruction_lines(hlo_text):
        header = HEADER.match(line)
        if header:
            current = comps.setdefault(header.group(2), [])
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            args, attrs = _split_args(m.group(4))
            current.append(Instr(m.group(1), m.group(2), m.group(3), re.findall(r"%([\w.\-]+)", args), attrs, args))
    return comps


def _dims(type_text: str) -> list[int]:
    m = _DIMS.search(type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _precision(ins: Instr, types: dict[str, str]) -> str | None:
    """A matmul's operand precision ("fp8", "int8", "bf16"); None for an op that is no matmul."""
    if ins.op not in ("dot", "convolution", "custom-call"):
        return None
    operands = " ".join(types.get(o, "") for o in ins.operands[:2])
    return "fp8" if re.search(r"\bf8e", operands) else "int8" if re.search(r"\bs8\[", operands) else "bf16"


def _fusion_precision(comp: str, comps: dict[str, list[Instr]], types: dict[str, str]) -> str:
    """The lowest operand precision of the matmuls in a fusion (nested ones included)."""
    found = set()
    for ins in comps.get(comp, []):
        if ins.op in ("dot", "convolution"):
            found.add(_precision(ins, types))
        elif ins.op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
            found.add(_fusion_precision(called.group(1), comps, types) if called else "bf16")
    return next((p for p in ("fp8", "int8") if p in found), "bf16")


def _dot_flops(ins: Instr, types: dict[str, str]) -> float:
    lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
    return 2.0 * math.prod(_dims(ins.type)) * k


class _Window(NamedTuple):
    """One spatial dimension of a convolution's window, as the HLO's `window={...}` gives it."""

    pad_lo: int = 0  # padding before the input
    stride: int = 1
    lhs_dilate: int = 1  # holes between input elements
    rhs_dilate: int = 1  # holes between kernel elements


def _taps(out: int, size: int, extent: int, window: _Window) -> int:
    """How many (output position, kernel position) pairs of one spatial dimension (`out` outputs,
    a kernel of `size`, an input of `extent`) land on real input, not on padding or dilation
    holes: the multiply-adds that dimension contributes."""
    pad_lo, stride, lhs_dilate, rhs_dilate = window
    span = (extent - 1) * lhs_dilate + 1
    if lhs_dilate > 1:  # holes in the input: count pair by pair (rare: transposed strided convolutions)
        return sum(1 for o in range(out) for k in range(size)
                   if 0 <= (x := o * stride + k * rhs_dilate - pad_lo) < span and x % lhs_dilate == 0)
    # Per kernel position k, the outputs o with 0 <= o*stride + k*rhs_dilate - pad_lo < span form
    # one range: O(size), not O(out x size) (an attention matmul at seq 8192 has both in the thousands).
    total = 0
    for k in range(size):
        offset = k * rhs_dilate - pad_lo
        first = max(0, (-offset + stride - 1) // stride)
        last = min(out - 1, (span - 1 - offset) // stride)
        total += max(0, last - first + 1)
    return total


def _conv_flops(ins: Instr, types: dict[str, str]) -> float:
    """A convolution, which is how the TPU compiler writes a matmul (a batched one puts the batch
    on a padded spatial window, so counting the whole window would overcount): 2 x output batch
    x output features x input features per group x the taps of each spatial dimension."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels or len(ins.operands) < 2:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs, out = _dims(types.get(ins.operands[0], "")), _dims(types.get(ins.operands[1], "")), _dims(ins.type)
    if len(lhs) != len(lhs_l) or len(rhs) != len(rhs_l) or len(out) != len(out_l):
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}

    def per_dim(key: str) -> list[str]:  # one entry per spatial dimension; [] = the default everywhere
        return fields[key].split("x") if key in fields else []

    spatial = sorted(c for c in out_l if c.isdigit())
    pads, strides, lhs_dil, rhs_dil = per_dim("pad"), per_dim("stride"), per_dim("lhs_dilate"), per_dim("rhs_dilate")
    taps = 1
    for j, d in enumerate(spatial):
        pad_lo = int(pads[j].split("_")[0]) if pads else 0
        window = _Window(pad_lo, int(strides[j]) if strides else 1, int(lhs_dil[j]) if lhs_dil else 1,
                         int(rhs_dil[j]) if rhs_dil else 1)
        taps *= _taps(out[out_l.index(d)], rhs[rhs_l.index(d)], lhs[lhs_l.index(d)], window)
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _gemm_flops(ins: Instr, types: dict[str, str]) -> float:
    config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
    k = math.prod(lhs[int(d.strip('"'))] for d in config.group(1).split(",") if d) if config and lhs else 1
    result = re.match(r"\(?\s*([a-z0-9]+\[[\d,]*\])", ins.type)
    return 2.0 * math.prod(_dims(result.group(1) if result else ins.type)) * k


def _attention_flops(ins: Instr, types: dict[str, str]) -> float:
    """cuDNN fused attention: q [B, T, H, D], k [B, S, Hkv, D]; two matmuls forward, five backward."""
    q, k = (_dims(types.get(o, "")) for o in ins.operands[:2])
    if len(q) != 4 or len(k) != 4:
        return 0.0
    b, t, h, d = q
    matmuls = 5 if "Backward" in ins.attrs or "backward" in ins.attrs.lower() else 2
    causal = 0.5 if re.search(r'"mask_type":"CAUSAL"|CAUSAL', ins.attrs) else 1.0
    return matmuls * 2.0 * b * h * t * k[1] * d * causal


def _custom_call_flops(ins: Instr, types: dict[str, str]) -> float | None:
    """A custom call's FLOPs (None: a Pallas kernel of unknown FLOPs)."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    target = target.group(1) if target else ""
    if pallas.is_pallas(target):
        return pallas.flops(ins.name, ins.attrs, ins.type, [types.get(o, "") for o in ins.operands])[1]
    if "gemm" in target or "matmul" in target:
        return _gemm_flops(ins, types)
    return _attention_flops(ins, types) if "fmha" in target else 0.0


def _fusion_flops(comp: str, comps: dict[str, list[Instr]], types: dict[str, str]) -> float:
    total = 0.0
    for ins in comps.get(comp, []):
        if ins.op in ("dot", "convolution"):
            total += _conv_flops(ins, types) if ins.op == "convolution" else _dot_flops(ins, types)
        elif ins.op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
            total += _fusion_flops(called.group(1), comps, types) if called else 0.0
    return total


def _sliced_bytes(comp: str, index: int, comps: dict[str, list[Instr]]) -> float | None:
    """The bytes fused computation `comp` reads of its parameter `index` when it reads it only
    through dynamic-slices, its own or those of the fusions nested in it (a layer of a stacked
    buffer); None when it reads more."""
    body = comps.get(comp, [])
    param = next((i for i in body if i.op == "parameter" and int(i.args.strip() or 0) == index), None)
    uses = [u for u in body if param is not None and param.name in u.operands]
    if not uses:
        return None
    total = 0.0
    for use in uses:
        called = re.search(r"calls=%([\w.\-]+)", use.attrs) if use.op == "fusion" else None
        if use.op == "dynamic-slice" and use.operands.index(param.name) == 0 and use.operands.count(param.name) == 1:
            total += shape_bytes(use.type)
        elif called:
            parts = [_sliced_bytes(called.group(1), j, comps) for j, o in enumerate(use.operands) if o == param.name]
            if None in parts:
                return None
            total += sum(parts)
        else:
            return None
    return total


def _fusion_bytes(ins: Instr, comps: dict[str, list[Instr]], types: dict[str, str]) -> float:
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    body = comps.get(called.group(1), []) if called else []
    by_name = {i.name: i for i in body}
    users: dict[str, list[Instr]] = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)
    param_list = sorted((i for i in body if i.op == "parameter"), key=lambda i: int(i.args.strip() or 0))
    total = 0.0
    for index, operand in enumerate(ins.operands):
        p = param_list[index] if index < len(param_list) else None
        uses = users.get(p.name, []) if p else []
        if uses and all(u.op == "dynamic-update-slice" and u.operands[0] == p.name for u in uses):
            continue  # the buffer a dynamic-update-slice writes into in place: not read
        full = shape_bytes(types.get(operand, ""))
        sliced = _sliced_bytes(called.group(1), index, comps) if called and uses else None
        total += full if sliced is None else min(sliced, full)
    root = body[-1] if body else None
    outputs = [by_name.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
    for out in outputs:
        if out is not None and out.op == "dynamic-update-slice" and len(out.operands) > 1:
            total += shape_bytes(types.get(out.operands[1], ""))  # written in place: only the update
        elif out is not None:
            total += shape_bytes(out.type)
    return total


def _bare_bytes(ins: Instr, types: dict[str, str]) -> float:
    """An unfused op's operands plus its result; a dynamic-slice reads and writes its slice, and a
    dynamic-update-slice (in place) the update, not the whole buffer."""
    if ins.op == "dynamic-slice":
        return 2.0 * shape_bytes(ins.type)
    if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
        return 2.0 * shape_bytes(types.get(ins.operands[1], ""))
    return sum(shape_bytes(types.get(o, "")) for o in ins.operands) + shape_bytes(ins.type)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    op: str
    flops: float  # per execution
    bytes: float  # per execution
    count: int  # executions per step
    precision: str = "bf16"  # of its matmul operands: "fp8", "int8" or "bf16" (any other)
    unknown_flops: bool = False  # a Pallas kernel planner.pallas does not know: charged 0 FLOPs


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel of a compiled module with its FLOPs, bytes and executions per step."""
    comps = parse(hlo_text)
    mults, _ = multiplicities(hlo_text.splitlines())
    types = {i.name: i.type for body in comps.values() for i in body}
    fused = {m for body in comps.values() for i in body if i.op == "fusion"
             for m in re.findall(r"calls=%([\w.\-]+)", i.attrs)}
    found = []
    for comp, body in comps.items():
        count = mults.get(comp, 0)
        if comp in fused or count == 0:
            continue
        for ins in body:
            base = ins.op.removesuffix("-start")
            if ins.op in _FREE or base in COLLECTIVES or ins.op.endswith("-done"):
                continue
            if ins.op == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
                flops = _fusion_flops(called.group(1), comps, types) if called else 0.0
                precision = _fusion_precision(called.group(1), comps, types) if called else "bf16"
                size = _fusion_bytes(ins, comps, types)
            elif ins.op == "custom-call":
                flops = _custom_call_flops(ins, types)
                precision = _precision(ins, types) if flops else "bf16"
                size = sum(shape_bytes(types.get(o, "")) for o in ins.operands) + shape_bytes(ins.type)
                if flops is None:
                    found.append(Kernel(ins.name, ins.op, 0.0, size, count, precision, unknown_flops=True))
                    continue
            else:
                flops = (_conv_flops(ins, types) if ins.op == "convolution"
                         else _dot_flops(ins, types) if ins.op == "dot" else 0.0)
                precision = _precision(ins, types) or "bf16"
                size = _bare_bytes(ins, types)
            found.append(Kernel(ins.name, ins.op, flops, size, count, precision))
    return found


def compute_seconds(found: list[Kernel], seconds: Callable[[float, float, str], float]) -> dict[str, Any]:
    """Roofline totals per step: FLOPs (all, and those of FP8 and int8 matmuls), bytes, the
    time `seconds(flops, bytes, precision)` sums to, and the Pallas kernels whose FLOPs are
    unknown (charged their bytes only)."""
    return {
        "flops": sum(k.flops * k.count for k in found),
        **{f"{p}_flops": sum(k.flops * k.count for k in found if k.precision == p) for p in ("fp8", "int8")},
        "bytes": sum(k.bytes * k.count for k in found),
        "seconds": sum(seconds(k.flops, k.bytes, k.precision) * k.count for k in found),
        "kernels": sum(k.count for k in found),
        "unknown_flops": sorted({k.name for k in found if k.unknown_flops}),
    }
