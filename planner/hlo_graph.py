"""What a compiled collective does, read from its operands and users in the HLO text.

A compiler may write one collective as another: libtpu writes an all-gather it has no torus
emitter for as an all-reduce of a zero-padded buffer (each device writes its shard into zeros,
a dynamic-update-slice, and the sum is the gathered array), and a reduce-scatter over a whole
3D torus as an all-reduce whose users keep only their own shard (a dynamic-slice of 1/n of it).
The program gets what the first op would give; the links carry what the second sends. `Graph`
follows operands back and results forward through the instructions that only move or rename a
buffer (copies, async copy pairs, bitcasts, tuple parts) and into fused computations, so
planner/hlo.py can label each op by what it does and charge it the bytes it sends.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_SHAPE = re.compile(r"\b(?:pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
# Instructions that hand their (first) operand on unchanged, as far as the bytes are concerned.
_MOVES = ("copy", "copy-start", "copy-done", "bitcast")


def elements(type_text: str) -> list[int]:
    """Element counts of each array in an HLO type, in order."""
    return [math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(type_text)]


class Graph:
    """Every instruction of a module: its opcode, type, operands, users and (a fusion) the
    computation it calls, and each computation's instructions."""

    def __init__(self, lines: list[str]):
        self.op: dict[str, str] = {}
        self.type: dict[str, str] = {}
        self.operands: dict[str, list[str]] = {}
        self.users: dict[str, list[str]] = defaultdict(list)
        self.calls: dict[str, str] = {}
        self.index: dict[str, int] = {}  # get-tuple-element: which part
        self.body: dict[str, list[str]] = defaultdict(list)  # computation -> its instructions
        current = None
        for line in lines:
            header = _HEADER.match(line)
            if header:
                current = header.group(1)
                continue
            m = _DEF.match(line)
            if not m:
                continue
            name, type_text, op, rest = m.groups()
            args = rest.split(")", 1)[0]
            self.op[name], self.type[name] = op, type_text
            self.operands[name] = re.findall(r"%([\w.\-]+)", args)
            for operand in self.operands[name]:
                self.users[operand].append(name)
            called = re.search(r"\bcalls=%([\w.\-]+)", rest)
            if called:
                self.calls[name] = called.group(1)
            index = re.search(r"\bindex=(\d+)", rest)
            if op == "get-tuple-element" and index:
                self.index[name] = int(index.group(1))
            if current is not None:
                self.body[current].append(name)

    def origin(self, name: str) -> str:
        """The instruction that made `name`'s buffer, looked through copies and bitcasts."""
        seen = 0
        while self.op.get(name) in _MOVES and self.operands.get(name) and seen < 64:
            name, seen = self.operands[name][0], seen + 1
        return name

    def _fused_root(self, name: str) -> str:
        body = self.body.get(self.calls.get(name, ""), [])
        return self.op.get(body[-1], "") if body else ""

    def padded(self, name: str) -> bool:
        """Whether `name` (through copies) writes a shard into a buffer: a dynamic-update-slice,
        or a fusion whose result is one."""
        source = self.origin(name)
        op = self.op.get(source, "")
        return op == "dynamic-update-slice" or (op == "fusion" and self._fused_root(source) == "dynamic-update-slice")

    def _readers(self, name: str, part: int | None) -> list[str]:
        """The instructions that read `name` (part `part` of a tuple), through copies and tuple parts."""
        found, todo = [], [(name, part)]
        while todo:
            current, want = todo.pop()
            for user in self.users.get(current, []):
                op = self.op.get(user, "")
                if op == "get-tuple-element":
                    if want is None or self.index.get(user) == want:
                        todo.append((user, None))
                elif op in _MOVES:
                    todo.append((user, want))
                else:
                    found.append(user)
        return found

    def _slices(self, reader: str, size: int) -> bool:
        """Whether `reader` keeps only a `size`-element slice: a dynamic-slice of that size, or a
        fusion holding one."""
        names = [reader] if self.op.get(reader) == "dynamic-slice" else []
        names += [n for n in self.body.get(self.calls.get(reader, ""), []) if self.op.get(n) == "dynamic-slice"]
        return any(elements(self.type[n])[:1] == [size] for n in names)

    def scattered(self, name: str, part: int | None, shards: int) -> bool:
        """Whether every reader of all-reduce `name`'s result (part `part` of a tuple) keeps one
        1/`shards` slice of it: a reduce-scatter written as an all-reduce and a slice."""
        parts = elements(self.type.get(name, ""))
        total = parts[part or 0] if parts else 0
        readers = self._readers(name, part)
        return bool(readers) and total % shards == 0 and all(self._slices(r, total // shards) for r in readers)
