"""Does bfloat16 compute track float32? The same run twice, `model.dtype=float32` and
`model.dtype=bfloat16` (float32 master weights both times), on the same real text, step by step.

    python -m bench.precision                                   # the default model, 50 steps, CPU is fine
    python -m bench.precision --config configs/llama3-1b.yaml data.source=text model.seq_len=1024 \
        train.global_batch=8 model.vocab_size=384 model.attention=xla   # the 1B body on one GPU, byte text
                                                                 # (cuDNN attention has no float32 path)

Prints both losses at a few steps, the largest per-step relative gap, and the largest gap between
their 10-step means; exits 1 if the windowed gap exceeds `--tolerance` (default 2%). Why windows:
both runs see the same batches, but once rounding has moved the weights their single-step losses
wander apart and back (measured: 2.2% at one step, 0.02% at the last); a precision bug, such as a
softmax or loss in bf16, shows as a sustained offset instead, which the windowed gap keeps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

import trainer  # sets the stack's XLA flags before JAX starts
from configs import ConfigError, load_config

WINDOW = 10


def losses(config: str | None, overrides: list[str], dtype: str, steps: int, root: str) -> np.ndarray:
    """Per-step training losses of a fresh run with compute dtype `dtype`."""
    cfg = load_config(config, [
        *overrides, f"model.dtype={dtype}", f"train.steps={steps}", "train.log_every=1", "eval.every=0",
        f"checkpoint.every={steps}", f"run.dir={os.path.join(root, dtype)}",
    ])
    return np.array([r["loss"] for r in trainer.run(cfg)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="preset (default: the built-in default run)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=0.02, help=f"largest allowed gap between {WINDOW}-step mean losses, relative")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-precision-")
    try:
        f32 = losses(args.config, args.overrides, "float32", args.steps, root)
        bf16 = losses(args.config, args.overrides, "bfloat16", args.steps, root)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines, ok = compare(f32, bf16, args.tolerance)
    print("\n".join(lines))
    return 0 if ok else 1


def compare(f32: np.ndarray, bf16: np.ndarray, tolerance: float) -> tuple[list[str], bool]:
    """(the report's lines, whether the gap between WINDOW-step means stays within tolerance)."""
    gap = np.abs(bf16 - f32) / np.abs(f32)
    steps = len(f32)
    lines = ["| step | float32 loss | bfloat16 loss | relative gap |", "| --- | --- | --- | --- |"]
    for s in sorted({1, *range(10, steps + 1, 10), steps, int(np.argmax(gap)) + 1}):
        lines.append(f"| {s} | {f32[s - 1]:.4f} | {bf16[s - 1]:.4f} | {gap[s - 1]:.2%} |")
    worst = int(np.argmax(gap))
    window = min(WINDOW, steps)
    mean = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")  # noqa: E731
    windowed = np.abs(mean(bf16) - mean(f32)) / mean(f32)
    w = int(np.argmax(windowed))
    ok = bool(windowed[w] <= tolerance)
    lines.append(f"per step: largest gap {gap[worst]:.2%} at step {worst + 1}, mean {gap.mean():.2%}")
    lines.append(f"{window}-step means: largest gap {windowed[w]:.2%} (steps {w + 1}-{w + window}); "
                 f"tolerance {tolerance:.2%}: {'within' if ok else 'EXCEEDED'}")
    return lines, ok

if __name__ == "__main__":
    sys.exit(main())
