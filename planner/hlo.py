"""Collectives in compiled HLO text: what kind, how many bytes, over which mesh axes, how often.

`collectives(hlo_text, mesh_shape)` reads every all-reduce, all-gather, reduce-scatter,
all-to-all, ragged-all-to-all and collective-permute of a compiled (SPMD-partitioned) module and
returns one `Collective` per op. Sizes come from the op's result type (dtype x dims; a tuple
result is the sum of its parts). A ragged all-to-all (an expert dispatch that sends only the
routed rows) moves as much as the routing asks: it is charged its bound, the output buffer, and
carries the balanced-routing estimate beside it. Device groups come from `replica_groups` in any of the three forms XLA
prints (explicit `{{0,1},{2,3}}`, iota `[4,2]<=[2,4]T(1,0)`, and named `mesh['axis_0'=2,...]
device_ids=(...) {'axis_0'}`) or from `source_target_pairs`; a group's ids are positions in
the device assignment, which is the jit mesh flattened in row-major order, so the mesh axes
a group spans are those whose coordinate varies inside it.

Loops: `lax.scan` over the layer stack, over micro-batches and over pipeline ticks compiles
to a `while` whose body is a separate computation. XLA records the trip count of such loops
in the while's backend_config (`known_trip_count`); an op's `count` is the product of the trip
counts of the loops around it (found by walking call edges from ENTRY), so a per-layer
all-gather in the scanned stack counts num_layers times. A loop without a known trip count
counts once and is reported in `unknown_trip_counts`.

CPU compiles reduce bf16 in f32 (the reducer is renamed `..._promoted`); such ops are counted
at the bf16 size the program asked for, as a GPU or TPU would move them.

This module knows no trainer or model: the planner (`plan.py`) hands it text and a mesh.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Sequence

import numpy as np

from planner.hlo_graph import Graph

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")

# Ring-algorithm bytes each device sends per byte of the op's full buffer (n devices per group):
# all-reduce = reduce-scatter + all-gather; a permute sends its whole operand once.
RING_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
    # The rows a ragged all-to-all sends depend on the routing: charged at its bound, the whole
    # output buffer arriving from the others (`Collective.balanced` holds the even-routing estimate).
    "ragged-all-to-all": lambda n: 1.0,
}

_OP = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALL = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes the device groups span, mesh order; () = no movement
    group_size: int
    bytes: int  # the op's full buffer: result size, or operand size for reduce-scatter
    count: int  # executions per step (static occurrences x enclosing loop trip counts)
    inter_node: bool  # some group holds devices of more than one node
    dtype: str = ""  # element type(s) of the buffer, e.g. "bf16" or "bf16+f32" for a combined op
    by_dtype: tuple[tuple[str, int], ...] = ()  # `bytes` split by element type (a combined op mixes them)
    lowered_as: str = ""  # the op the compiler wrote it as, where that is another (planner/hlo_graph.py)
    balanced: float = 0.0  # ragged-all-to-all: bytes one device sends per execution if routing were balanced
    beside: bool = False  # a collective-permute the schedule runs beside kernels (`runs_beside_kernels`)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution under the ring algorithm of the op as written."""
        factor = RING_FACTORS[self.lowered_as or self.kind](self.group_size)
        return factor * self.bytes if self.group_size > 1 else 0.0


def dtype_bytes(dtype: str) -> float:
    if dtype == "pred":
        return 1.0
    return int(re.search(r"\d+", dtype).group()) / 8  # f32 -> 4, bf16 -> 2, c64 -> 8, s4 -> 0.5


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type: `f32[4,8]{1,0}` or a tuple `(f32[4]{0}, s32[])`."""
    return int(sum(dtype_bytes(dt) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(type_text)))


def tuple_parts(type_text: str) -> list[str]:
    """The top-level parts of a tuple type `(a, (b, c))` -> ['a', '(b, c)']; a plain type -> [it]."""
    text = re.sub(r"/\*[^*]*\*/", "", type_text).strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
            if depth == 0:
                break
    return [p for p in parts if p]


def buffer_bytes(kind: str, start: bool, type_text: str, line: str) -> int:
    """The full buffer of one collective, from its type.

    Asynchronous ops (GPU `*-start`) carry (operands, results) in one tuple, and a combined op
    (one reduce-scatter for all of a layer's gradients) holds a tuple on each side: an
    all-gather's buffer is its results, a reduce-scatter's its operands (the unreduced input),
    a permute's its operand. An all-reduce's type is its result(s) either way."""
    if start and kind in ("all-gather", "reduce-scatter", "collective-permute", "all-to-all"):
        parts = tuple_parts(type_text)
        side = parts[-1] if kind in ("all-gather", "all-to-all") else parts[0]
        return shape_bytes(side)
    if re.search(r"to_apply=%[\w.\-]*_promoted\b", line):
        # The CPU backend reduces bf16 in f32 (it widens the op and names the reducer
        # `..._promoted`); a GPU or TPU reduces the bf16 the program asked for.
        return shape_bytes(type_text.replace("f32[", "bf16["))
    return shape_bytes(type_text)


def _dtypes(type_text: str, size: int) -> tuple[str, tuple[tuple[str, int], ...]]:
    """The op's dtype label ("bf16", "bf16+f32") and `size` bytes shared out in proportion to
    each element type's bytes in the op's type (both sides of an async tuple hold the same mix);
    indices and tokens are not data, unless the op moves nothing else (an MoE dispatch's expert ids)."""
    shapes = [(dt, dims) for dt, dims in _SHAPE.findall(type_text) if dt != "token"]
    data = [(dt, dims) for dt, dims in shapes if dt not in ("u32", "s32")] or shapes
    raw: dict[str, float] = {}
    for dt, dims in data:
        raw[dt] = raw.get(dt, 0.0) + dtype_bytes(dt) * math.prod(int(d) for d in dims.split(",") if d)
    total, names = sum(raw.values()), sorted(raw)
    parts = [round(size * raw[dt] / total) if total else 0 for dt in names[:-1]]
    return "+".join(names), tuple(zip(names, [*parts, size - sum(parts)])) if names else ()


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _named_groups(line: str, num_devices: int) -> list[list[int]]:
    """`mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}` -> groups of ids: the
    devices (iota by default) laid out on that mesh; a group varies the axes in braces. A
    selected sub-axis `'axis_0':(pre)size` takes `size` out of the middle of that axis."""
    dims = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", re.search(r"mesh\[([^\]]*)\]", line).group(1))]
    iota = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", line)
    listed = re.search(r"device_ids=\{([\d,]*)\}", line)
    if iota:
        devices = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None).reshape(-1)
    else:
        devices = np.array(_ints(listed.group(1))) if listed else np.arange(num_devices)
    chosen = re.search(r"mesh\[[^\]]*\](?:, device_ids=\S+)?\s*\{([^}]*)\}", line)
    chosen = chosen.group(1) if chosen else ""
    sub = {name: (int(pre), int(size)) for name, pre, size in re.findall(r"'(\w+)':\((\d+)\)(\d+)", chosen)}
    whole = set(re.findall(r"'(\w+)'(?!:)", chosen))
    shape, selected = [], []
    for name, size in dims:
        if name in sub:
            pre, part = sub[name]
            shape += [pre, part, size // (pre * part)]
            selected.append(len(shape) - 2)
        else:
            shape.append(size)
            if name in whole:
                selected.append(len(shape) - 1)
    rest = [i for i in range(len(shape)) if i not in selected]
    size = math.prod(shape[i] for i in selected)
    return devices.reshape(shape).transpose(rest + selected).reshape(-1, size).tolist()


def device_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective instruction (a permute: its source/target pairs)."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if pairs:
        return [[int(s), int(t)] for s, t in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    if "replica_groups=mesh[" in line:
        return _named_groups(line, num_devices)
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(_ints(m.group(1))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))] if m else []
    return groups or [list(range(num_devices))]  # `{}`: every device in one group


def spanned_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    names = list(mesh_shape)
    coords = np.array(np.unravel_index(np.array(groups), tuple(mesh_shape.values())))  # [axis, group, member]
    varies = (coords != coords[:, :, :1]).any(axis=(1, 2))
    return tuple(n for n, v in zip(names, varies) if v)


def _bound(condition: list[str]) -> int | None:
    """The trip count of a counted loop whose condition is `i < N` for a constant N (the TPU
    compiler records no known_trip_count; its scans count from 0 by 1)."""
    root = next((line for line in condition if line.lstrip().startswith("ROOT") and "direction=LT" in line), "")
    constants = dict(re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", "\n".join(condition)))
    used = [int(constants[n]) for n in re.findall(r"%([\w.\-]+)", root.split("compare(", 1)[-1]) if n in constants]
    return used[0] if len(used) == 1 else None


def multiplicities(lines: list[str]) -> tuple[dict[str, int], int]:
    """Executions per step of every computation, and how many loops had no known trip count."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    bodies: dict[str, list[str]] = defaultdict(list)
    current = None
    for line in lines:
        header = HEADER.match(line)
        current = header.group(2) if header else current
        if current is not None and not header:
            bodies[current].append(line)
    entry, current, unknown = None, None, 0
    for line in lines:
        header = HEADER.match(line)
        if header:
            current = header.group(2)
            entry = current if header.group(1) else entry
            continue
        if current is None:
            continue
        known = _TRIP.search(line)
        trip = int(known.group(1)) if known else None
        if " while(" in line and trip is None:
            condition = re.search(r"condition=%([\w.\-]+)", line)
            trip = _bound(bodies.get(condition.group(1), [])) if condition else None
            unknown += trip is None
        for role, callee in _CALL.findall(line):
            callers[callee].append((current, trip if role == "body" and trip else 1))
        for branches in _BRANCHES.findall(line):
            for callee in re.findall(r"%([\w.\-]+)", branches):
                callers[callee].append((current, 1))
    memo: dict[str, int] = {entry: 1}

    def mult(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # guards against a cycle, which valid HLO does not have
            memo[name] = sum(mult(c) * f for c, f in callers.get(name, []))
        return memo[name]

    return {name: mult(name) for name in set(callers) | {entry}}, unknown


def collectives(
    hlo_text: str, mesh_shape: dict[str, int], nodes: int | Sequence[int]
) -> tuple[list[Collective], int]:
    """Every collective op of a compiled module, and the number of loops of unknown trip count.

    mesh_shape: axis name -> size, outermost first, as the jit mesh. nodes: the node (GPU host,
    TPU slice) of each device position of the mesh, or an int n: positions p and q share a
    node iff p // n == q // n.

    A multi-slice TPU program is one slice's: its device ids number that slice's chips (the
    mesh positions of slice 0, in mesh order), and what crosses slices (DCN) is a host-transfer
    `send` the megascale runtime carries out, read here as the collective it names."""
    lines = hlo_text.splitlines()
    mults, unknown = multiplicities(lines)
    graph = Graph(lines)
    num_devices = math.prod(mesh_shape.values())
    node_of = [p // nodes for p in range(num_devices)] if isinstance(nodes, int) else list(nodes)
    per_slice = _MEGASCALE.search(hlo_text) is not None
    local = [p for p in range(num_devices) if node_of[p] == node_of[0]] if per_slice else list(range(num_devices))
    found, current = [], None
    for at, line in enumerate(lines):
        header = HEADER.match(line)
        if header:
            current = header.group(2)
            continue
        if current is None or mults.get(current, 0) == 0:
            continue
        dcn = _MEGASCALE.search(line) if " send(" in line else None
        if dcn:
            found.append(_across_slices(dcn.group(1), line, mesh_shape, node_of, mults[current]))
            continue
        op = _OP.match(line)
        if not op:
            continue
        name, type_text, kind, start = op.groups()
        if start and kind == "ragged-all-to-all":
            # Its buffer and its element types are its result's, the output buffer: the start's
            # tuple also holds its operands (the input rows, that buffer again, four offset vectors).
            type_text = tuple_parts(type_text)[-1]
        size = buffer_bytes(kind, bool(start), type_text, line)
        groups = [[local[i] for i in g] for g in device_groups(line, len(local))]
        if not groups:  # a permute with no source-target pairs (a shift by zero blocks) sends nothing
            continue
        n = max(len(g) for g in groups) if kind != "collective-permute" else 2
        if kind == "reduce-scatter" and not start:
            size *= n  # a synchronous op's type is its result: one shard of the reduced buffer
        crossing = any(len({node_of[p] for p in g}) > 1 for g in groups)
        where = (spanned_axes(groups, mesh_shape), n, mults[current], crossing)  # what every part shares
        if kind == "all-reduce" and current.startswith("all-reduce-scatter"):
            # libtpu's reduce-scatter: a kCustom fusion whose computation holds an all-reduce of the
            # (padded) full buffer and the dynamic-slice of this device's shard; its emitter
            # (AllReduceScatterFusion) reduces and scatters in one pass, so it moves a reduce-scatter.
            found.append(_op("reduce-scatter", where, type_text, size))
        elif kind == "all-reduce" and not start:
            found += _all_reduce_parts(name, type_text, line, graph, where)
        elif kind == "ragged-all-to-all":
            found.append(dataclasses.replace(_op(kind, where, type_text, size), balanced=_balanced(name, size, n, graph)))
        elif kind == "collective-permute" and start:
            beside = runs_beside_kernels(lines, at, name)
            found.append(dataclasses.replace(_op(kind, where, type_text, size), beside=beside))
        else:
            found.append(_op(kind, where, type_text, size))
    return found, unknown


_KERNEL = re.compile(r" (fusion|custom-call|dot|convolution)\(")


def runs_beside_kernels(lines: list[str], at: int, name: str) -> bool:
    """Whether the asynchronous op `name` starting on line `at` has kernels scheduled between its
    start and its done (the GPU compiler's order is the run order of its main stream): it then
    runs beside them, as a ring attention step's next block does while the step's kernels run."""
    work = False
    for line in lines[at + 1:]:
        if f"-done(%{name})" in line:
            return work
        if HEADER.match(line) or line.startswith("}"):
            return False
        work = work or _KERNEL.search(line) is not None
    return False


def _balanced(name: str, size: int, n: int, graph: Graph) -> float:
    """What a ragged all-to-all sends if routing were balanced: each device's rows (the smaller of
    its input and output buffers: a dispatch's input holds its own rows, a combine's output the
    rows coming home; the other is sized for the worst case) less the 1/n that stays put."""
    operands = graph.operands.get(name, [])
    rows = min(shape_bytes(graph.type.get(operands[0], "")), size) if operands else size
    return rows * (n - 1) / n


def _op(kind: str, where: tuple, type_text: str, size: int, lowered_as: str = "") -> Collective:
    axes, n, count, crossing = where
    return Collective(kind, axes, n, size, count, crossing, *_dtypes(type_text, size), lowered_as=lowered_as)


def _all_reduce_parts(name: str, type_text: str, line: str, graph: Graph, where: tuple) -> list[Collective]:
    """A synchronous all-reduce, one Collective per thing its parts do (a combined op may hold
    gathers and reductions): a part whose operand is a zero-padded buffer is an all-gather, one
    whose readers keep 1/n of it a reduce-scatter, both lowered as (and sending) an all-reduce."""
    parts = tuple_parts(type_text)
    operands = graph.operands.get(name, [])
    n = where[1]
    by_kind: dict[str, list[str]] = defaultdict(list)
    for i, part in enumerate(parts):
        index = i if len(parts) > 1 else None
        if i < len(operands) and graph.padded(operands[i]):
            by_kind["all-gather"].append(part)
        elif n > 1 and graph.scattered(name, index, n):
            by_kind["reduce-scatter"].append(part)
        else:
            by_kind["all-reduce"].append(part)
    out = []
    for kind, kept in by_kind.items():
        text = "(" + ", ".join(kept) + ")"
        size = buffer_bytes("all-reduce", False, text, line)
        out.append(_op(kind, where, text, size, "" if kind == "all-reduce" else "all-reduce"))
    return out


def _across_slices(transfer: str, line: str, mesh_shape: dict[str, int], node_of: list[int], count: int) -> Collective:
    """A megascale `send`: this slice's part of a collective among the slices, over DCN."""
    kind = transfer.lower().replace("_", "-")
    operand = tuple_parts(line.split(" = ", 1)[1].split(" send(", 1)[0])[0]
    n = len(set(node_of))
    size = shape_bytes(operand) * (n if kind == "all-gather" else 1)  # a gather sends its shard, holds n
    grid = np.asarray(node_of).reshape(tuple(mesh_shape.values()))
    axes = tuple(name for i, name in enumerate(mesh_shape) if np.any(np.diff(grid, axis=i)))  # the node changes along it
    return Collective(kind, axes, n, size, count, True, *_dtypes(operand, size))


def static_counts(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the text holds (each op once, loops not unrolled)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        op = _OP.match(line)
        if op:
            counts[op.group(3)] += 1
    return counts
