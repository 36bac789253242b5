"""A small instruction and preference data set made on the machine, for the tiny SFT/DPO presets.

    python -m data.examples --output prepared/examples    # writes sft.jsonl and dpo.jsonl

Each example asks for a word in upper case, reversed or repeated, and answers it (a task a tiny
byte-level model learns in minutes on a CPU). SFT rows are chat `messages` or
`prompt`/`completion` pairs; DPO rows pair the right answer (chosen) with a wrong one (rejected),
the prompt and answers as chat messages. Seeded: the same files on every machine.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = "run the same command again"

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import json
import os
import sys

import numpy as np

from configs.interrupt import guarded
from configs.schema import ConfigError
from configs.writable import check_writable

WORDS = (
    "the quick brown fox jumps over lazy dog while seven wise owls sing about rivers and stone bridges under "
    "pale winter skies where hungry wolves wander past quiet villages making yellow candles glow"
).split()
TASKS = {
    "upper": lambda w: w.upper(),
    "reverse": lambda w: w[::-1],
    "twice": lambda w: f"{w} {w}",
}


def _example(rng: np.random.Generator) -> tuple[str, str, str]:
    """(prompt, right answer, a wrong answer: another task's, or another word's)."""
    task = str(rng.choice(list(TASKS)))
    word = str(rng.choice(WORDS))
    other = str(rng.choice([t for t in TASKS if TASKS[t](word) != TASKS[task](word)] or ["upper"]))
    wrong = TASKS[other](word) if TASKS[other](word) != TASKS[task](word) else TASKS[task](word + "s")
    return f"{task}: {word}", TASKS[task](word), wrong


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat conversations (one or two turns), one in four a plain prompt/completion pair."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt, answer, _ = _example(rng)
        if i % 4 == 3:
            rows.append({"prompt": prompt + " =", "completion": " " + answer})
            continue
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if i % 4 == 1:
            prompt2, answer2, _ = _example(rng)
            messages += [{"role": "user", "content": prompt2}, {"role": "assistant", "content": answer2}]
        rows.append({"messages": messages})
    return rows


def dpo_rows(n: int, seed: int = 1) -> list[dict]:
    """Preference pairs in the conversational form: prompt, chosen and rejected as messages."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        prompt, answer, wrong = _example(rng)
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": answer}],
                     "rejected": [{"role": "assistant", "content": wrong}]})
    return rows


def write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.examples", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="directory for sft.jsonl and dpo.jsonl")
    p.add_argument("--sft-rows", type=int, default=4000)
    p.add_argument("--dpo-rows", type=int, default=512)
    args = p.parse_args(argv)
    try:
        check_writable(args.output, "--output")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.output, exist_ok=True)
    write(os.path.join(args.output, "sft.jsonl"), sft_rows(args.sft_rows))
    write(os.path.join(args.output, "dpo.jsonl"), dpo_rows(args.dpo_rows))
    print(f"wrote {args.output}/sft.jsonl ({args.sft_rows} rows) and dpo.jsonl ({args.dpo_rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, KEPT))
