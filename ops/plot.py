"""Loss curves from run directories: `python -m ops.plot RUN_DIR... [--out FILE.png]`.

Without `--out` the PNG goes beside the runs, not into the working directory (often a checkout):
`RUN_DIR/loss_curves.png` for one run, `loss_curves.png` in the runs' common parent for several.

One colour per run: the training loss as a line, the held-out loss (`eval_loss`, where the run
logged one) as dashed markers. Reads metrics.jsonl the way `ops.observe.read_metrics`
merges it (after a resume, the last line for a step wins). Uses matplotlib's Agg canvas
directly, so it needs no display and leaves pyplot's global state alone.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import storage
from ops.observe import read_metrics


def plot_runs(run_dirs: list[str], out: str, labels: list[str] | None = None, title: str = "") -> int:
    """Draws every run that has a logged loss into `out` (PNG). Returns how many it drew."""
    labels = labels or [storage.basename(d) if storage.is_remote(d) else os.path.basename(os.path.normpath(d)) or d
                        for d in run_dirs]
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = 0
    for run_dir, label in zip(run_dirs, labels):
        records = read_metrics(run_dir)
        # A skipped step's loss is null in metrics.jsonl: it leaves a point out, not a gap.
        train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        held_out = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
        if not train and not held_out:
            continue
        color = f"C{drawn % 10}"
        if train:
            ax.plot(*zip(*train), color=color, label=label)
        if held_out:
            ax.plot(*zip(*held_out), color=color, linestyle="--", marker="o", markersize=3, label=f"{label} (eval)")
        drawn += 1
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title or "loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        if storage.is_remote(out):  # one object, written whole
            png = io.BytesIO()
            fig.savefig(png, format="png")
            storage.write_bytes(out, png.getvalue())
        else:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            fig.savefig(out)
    return drawn


def default_out(run_dirs: list[str]) -> str:
    """RUN_DIR/loss_curves.png for one run; for several, the same name in their common parent."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "loss_curves.png")
    parent = os.path.commonpath([os.path.dirname(os.path.abspath(d)) for d in run_dirs])
    return os.path.join(os.path.relpath(parent), "loss_curves.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.plot", description="Loss curves of runs, as a PNG.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/loss_curves.png, or for several runs "
                                      "loss_curves.png in their common parent directory)")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    args.out = args.out or default_out(args.run_dirs)
    if plot_runs(args.run_dirs, args.out, title=args.title) == 0:
        print(f"error: no logged loss in {', '.join(args.run_dirs)} (metrics.jsonl missing or empty)", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
