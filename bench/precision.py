"""Does bfloat16 compute track float32, and do the low-precision matmuls track bfloat16? The
same run with `model.dtype=float32` and `model.dtype=bfloat16` (float32 master weights both
times), or with `--quant fp8,int8` the bfloat16 run against bfloat16 runs with `model.quant=fp8`
and `=int8` (no float32 run then), on the same real text, step by step.

    python -m bench.precision                                   # the default model, 50 steps, CPU is fine
    python -m bench.precision --config configs/llama3-1b.yaml data.source=text model.seq_len=1024 \
        train.global_batch=8 model.vocab_size=384 model.attention=xla   # the 1B body on one GPU, byte text
                                                                 # (cuDNN attention has no float32 path)

    python -m bench.precision --steps 200 --quant fp8,int8      # each mode against bf16
    python -m bench.precision --steps 200 --quant fp8,int8 --seeds 3   # the same, judged on 3 seeds' mean
    python -m bench.precision --steps 200 --grad-reduce         # float32 against bf16 gradient reductions

Prints both losses at a few steps, the largest per-step relative gap, and the largest gap between
their 10-step means; exits 1 if the windowed gap exceeds `--tolerance` (default 2%). Why windows:
both runs see the same batches, but once rounding has moved the weights their single-step losses
wander apart and back, at single steps by more than the tolerance; a precision bug, such as a
softmax or loss in bf16, shows as a sustained offset instead, which the windowed gap keeps.
Each `--quant` mode is judged against the bfloat16 run with the same tolerance; on CPU its FP8
and int8 matmuls are emulated (the same rounding, float32 arithmetic).

`--seeds N` runs every variant with `run.seed` 0..N-1 (each seed its own initialization and batch
order, the same for every variant) and judges the mean of the N loss curves, step by step, with
the same windows and tolerance; each seed's own windowed gap is printed too. Why: on one seed,
changing one rounding (float32 against bf16 logits, or the gradient matmuls' output dtype) moves
the 10-step means by about the size of the tolerance, in either direction depending on the seed;
what a precision bug does, a sustained offset, survives the mean over seeds, and the trajectory
noise shrinks with it.

`--grad-reduce` judges a float32 run with `model.grad_reduce=bfloat16` (every block weight
gradient leaves its matmul rounded to bfloat16, the dtype its reduction over the batch shards then
moves) against the plain float32 run; in a bfloat16 run that key changes nothing, the gradients are bfloat16 already.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys
import tempfile

import numpy as np

import trainer
from configs import ConfigError, load_config

WINDOW = 10


@dataclasses.dataclass(frozen=True)
class Runs:
    """What every variant's runs share: the preset and overrides, their length, where their run
    directories go and how many seeds each variant runs."""

    config: str | None  # the preset (None: the built-in default run)
    overrides: list[str]  # key=value, before each variant's own
    steps: int
    root: str  # each run's directory is made under it
    seeds: int = 0  # > 0: one run per run.seed 0..seeds-1


def losses(runs: Runs, dtype: str, quant: str = "none", grad_reduce: str = "compute") -> np.ndarray:
    """Per-step training losses of a fresh run with compute dtype `dtype`, `model.quant` and
    `model.grad_reduce`; with `runs.seeds` > 0, [seeds, steps]: one run per `run.seed` 0..seeds-1."""
    config, steps, root, seeds = runs.config, runs.steps, runs.root, runs.seeds
    name = f"{dtype}-{quant}-{grad_reduce}"
    overrides = [*runs.overrides, f"model.dtype={dtype}", f"model.quant={quant}", f"model.grad_reduce={grad_reduce}"]
    if seeds:
        return np.stack([_run(config, [*overrides, f"run.seed={s}"], steps, os.path.join(root, f"{name}-seed{s}"))
                         for s in range(seeds)])
    return _run(config, overrides, steps, os.path.join(root, name))


def _run(config: str | None, overrides: list[str], steps: int, run_dir: str) -> np.ndarray:
    cfg = load_config(config, [*overrides, f"train.steps={steps}", "train.log_every=1", "eval.every=0",
                               f"checkpoint.every={steps}", f"run.dir={run_dir}"])
    got = np.array([r["loss"] for r in trainer.run(cfg)])
    print(f"ran {os.path.basename(run_dir)}: loss {got[0]:.4f} -> {got[-1]:.4f}", flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="preset (default: the built-in default run)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=0.02, help=f"largest allowed gap between {WINDOW}-step mean losses, relative")
    parser.add_argument("--quant", default="", help="comma-separated model.quant modes to compare against bfloat16 (fp8, int8)")
    parser.add_argument("--grad-reduce", action="store_true",
                        help="float32 against float32 with model.grad_reduce=bfloat16 (instead of the bfloat16 run)")
    parser.add_argument("--seeds", type=int, default=0,
                        help="run every variant with run.seed 0..N-1 and judge the mean curve (0: one run, the config's seed)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    trainer.set_default_flags()
    if args.seeds < 0:
        print(f"error: --seeds must be >= 0, got {args.seeds}", file=sys.stderr)
        return 2
    modes = [q.strip() for q in args.quant.split(",") if q.strip()]
    root = tempfile.mkdtemp(prefix="bench-precision-")
    try:
        for q in modes:  # a bad mode fails before any run
            load_config(args.config, [*args.overrides, f"model.quant={q}"])
        run = functools.partial(losses, Runs(args.config, args.overrides, args.steps, root, args.seeds))
        f32 = None if modes else run("float32")
        if args.grad_reduce:
            reduced = run("float32", grad_reduce="bfloat16")
            lines, ok = judge(f32, reduced, args.tolerance, ("float32", "float32, bf16 gradient reductions"))
            print("\n".join(lines))
            return 0 if ok else 1
        bf16 = run("bfloat16")
        quantized = {q: run("bfloat16", quant=q) for q in modes}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:  # the runs' directories: only their loss curves are kept, above
        shutil.rmtree(root, ignore_errors=True)
    lines, ok = ([], True) if f32 is None else judge(f32, bf16, args.tolerance)
    for q, got in quantized.items():
        more, good = judge(bf16, got, args.tolerance, ("bfloat16", f"bfloat16 {q}"))
        lines += ["", *more]
        ok = ok and good
    print("\n".join(lines))
    return 0 if ok else 1


def judge(ref: np.ndarray, got: np.ndarray, tolerance: float, names: tuple[str, str] = ("float32", "bfloat16")
          ) -> tuple[list[str], bool]:
    """`compare` on one run's curves ([steps]), or on the mean over seeds of several ([seeds,
    steps]), then each seed's own largest windowed gap, for the record (the verdict is the mean's)."""
    if ref.ndim == 1:
        return compare(ref, got, tolerance, names)
    lines, ok = compare(ref.mean(0), got.mean(0), tolerance, (f"{names[0]} (mean of {len(ref)} seeds)", f"{names[1]} (mean)"))
    for s, (r, g) in enumerate(zip(ref, got)):
        gap = windowed_gap(r, g)
        w = int(np.argmax(np.abs(gap)))
        lines.append(f"run.seed={s} alone: largest {WINDOW}-step gap {gap[w]:+.2%} (steps {w + 1}-{w + WINDOW})")
    return lines, ok


def windowed_gap(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """(got - ref) / ref of their WINDOW-step running means (signed; fewer steps: one window)."""
    window = min(WINDOW, len(ref))
    mean = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")  # noqa: E731
    return (mean(got) - mean(ref)) / mean(ref)


def compare(f32: np.ndarray, bf16: np.ndarray, tolerance: float,
            names: tuple[str, str] = ("float32", "bfloat16")) -> tuple[list[str], bool]:
    """(the report's lines, whether the gap between WINDOW-step means stays within tolerance):
    `bf16` judged against the reference `f32`, the columns titled by `names`."""
    gap = np.abs(bf16 - f32) / np.abs(f32)
    steps = len(f32)
    lines = [f"| step | {names[0]} loss | {names[1]} loss | relative gap |", "| --- | --- | --- | --- |"]
    for s in sorted({1, *range(10, steps + 1, 10), steps, int(np.argmax(gap)) + 1}):
        lines.append(f"| {s} | {f32[s - 1]:.6f} | {bf16[s - 1]:.6f} | {gap[s - 1]:.3%} |")
    worst = int(np.argmax(gap))
    window = min(WINDOW, steps)
    windowed = np.abs(windowed_gap(f32, bf16))
    w = int(np.argmax(windowed))
    ok = bool(windowed[w] <= tolerance)
    lines.append(f"per step: largest gap {gap[worst]:.2%} at step {worst + 1}, mean {gap.mean():.2%}")
    lines.append(f"{window}-step means: largest gap {windowed[w]:.2%} (steps {w + 1}-{w + window}); "
                 f"tolerance {tolerance:.2%}: {'within' if ok else 'EXCEEDED'}")
    return lines, ok

if __name__ == "__main__":
    sys.exit(main())
