"""The toy task of reinforcement learning: two-operand addition of numbers below 100.

    python -m data.addition --output prepared/addition   # writes addition.jsonl, train.jsonl, heldout.jsonl

Every pair (a, b) with 0 <= a, b < 100 is one row {"prompt": "37+48=", "answer": "85",
"completion": "85"}: the raw text, no chat template; the answer is what `rl.reward=exact_match`
compares a completion with, and the same text as "completion" lets the one file warm a model up
with `data.prepare --objective sft` first. The rows are in a seeded shuffle (the same files on
every machine and Python version: `random.Random` with an int seed).

The held-out split is the one `data.prepare --eval-fraction F` makes from addition.jsonl (the
content hash of each line, data.sources.held_out), so train.jsonl and heldout.jsonl are exactly
the two splits of a corpus prepared from addition.jsonl with the same fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from data.sources import held_out

LIMIT = 100  # operands are below this
SEED = 0
EVAL_FRACTION = 0.1


def addition_rows(seed: int = SEED) -> list[dict[str, str]]:
    """Every two-operand sum of numbers below LIMIT, in a seeded order."""
    pairs = [(a, b) for a in range(LIMIT) for b in range(LIMIT)]
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b), "completion": str(a + b)} for a, b in pairs]


def line(row: dict[str, str]) -> str:
    """A row as its JSONL line (no newline): the bytes the held-out hash reads."""
    return json.dumps(row)


def split(rows: list[dict[str, str]], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows, split as data.prepare splits addition.jsonl: by each line's hash."""
    held = [held_out(line(r).encode(), eval_fraction) for r in rows]
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def write(path: str, rows: list[dict[str, str]]) -> None:
    with open(path, "w") as f:
        f.writelines(line(r) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.addition", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="directory for addition.jsonl, train.jsonl and heldout.jsonl")
    p.add_argument("--eval-fraction", type=float, default=EVAL_FRACTION, help="share held out, by content hash")
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    if not 0 < args.eval_fraction < 1:
        print(f"error: --eval-fraction: must be in (0, 1), got {args.eval_fraction}", file=sys.stderr)
        return 2
    rows = addition_rows(args.seed)
    train, held = split(rows, args.eval_fraction)
    os.makedirs(args.output, exist_ok=True)
    for name, part in (("addition", rows), ("train", train), ("heldout", held)):
        write(os.path.join(args.output, f"{name}.jsonl"), part)
    print(f"wrote {args.output}/addition.jsonl ({len(rows)} rows) = train.jsonl ({len(train)}) + heldout.jsonl "
          f"({len(held)}); prepare addition.jsonl with --eval-fraction {args.eval_fraction} for the same split")
    return 0


if __name__ == "__main__":
    sys.exit(main())
