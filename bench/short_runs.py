"""Does a short run report its speed? A 20-step tiny run's tokens/s against a 200-step run's steady state.

    python -m bench.short_runs [--pairs 6] [--out DIR]

Each pair runs `python train.py --config configs/tiny.yaml train.steps=N run.dir=DIR/sN-i` for
N = 20, then 200, as real processes, and reads each run's `summary.json` and `metrics.jsonl`:
the 20-step run's summary tokens/s (productive step time only; the first execution's one-time
set-up has its own goodput bucket), its logged steps 1, 5 and 10, that bucket, and the 200-step
run's median logged tokens/s over steps 25-200 (its steady state). Prints a markdown table and
the ratio per pair (the aim: 0.8 or above). CPU figures: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(steps: int, run_dir: str) -> tuple[dict, dict[int, float]]:
    """One tiny run of `steps` steps: its summary and its logged tokens/s by step."""
    subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", f"train.steps={steps}",
                    f"run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return summary, {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="short_runs_")
    print("| pair | 20-step run | its logged steps 1, 5, 10 | its first execution | 200-step run, all steps "
          "| 200-step steady state | 20-step / steady |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i in range(1, args.pairs + 1):
        short, short_tps = train(20, os.path.join(out, f"s20-{i}"))
        long, long_tps = train(200, os.path.join(out, f"s200-{i}"))
        steady = statistics.median(v for step, v in long_tps.items() if step >= 25)
        first = short["invocations"][-1]["seconds"].get("first_execution", 0.0)
        logged = ", ".join(f"{short_tps[s]:,.0f}" for s in (1, 5, 10) if s in short_tps)
        print(f"| {i} | {short['tokens_per_s']:,.0f} | {logged} | {first:.3f} s | {long['tokens_per_s']:,.0f} "
              f"| {steady:,.0f} | {short['tokens_per_s'] / steady:.2f} |", flush=True)
    print(f"(CPU figures; runs in {out})")


if __name__ == "__main__":
    main()
