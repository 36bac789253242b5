"""The `straggler` section: when a process slower than the others is named (ops/stragglers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from configs.fields import Range


@dataclass(kw_only=True)
class StragglerConfig:
    """Naming a process whose own work per step is slower than the others' (several processes)."""

    factor: Annotated[float, Range(ge=0, hint="0: off")] = 2.0
    """A process whose own seconds per step exceed the median process's this many times is slow (> 1)."""
    steps: Annotated[int, Range(gt=0)] = 5
    """Steps in a row a process must be slow before the log names it."""
