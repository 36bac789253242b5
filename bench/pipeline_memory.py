"""Compiled temporaries per device of the tiny train step against the number of microbatches,
for each pipeline schedule, on 8 fake CPU devices, 2 rows per microbatch and data replica:
gpipe and 1f1b on mesh.pipeline=4 mesh.data=2, then gpipe (circular) and interleaved_1f1b on
mesh.pipeline=2 mesh.data=4 pipeline.repeats=2; zero_bubble with the first. Then each schedule's
bubble on 4 stages measured from its tick table (pipeline/ticks.py), with `--bubble` that alone:

    python -m bench.pipeline_memory [--bubble]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from configs import load_config  # noqa: E402
import pipeline  # noqa: E402
from trainer import abstract_program  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
LAYOUTS = {  # mesh overrides -> the repeats; each schedule that takes them is compared on it
    ("mesh.pipeline=4", "mesh.data=2"): 1,
    ("mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2"): 2,
}


def temp_bytes(layout: tuple[str, ...], schedule: str, microbatches: int) -> int:
    data = int(next(o for o in layout if o.startswith("mesh.data=")).split("=")[1])
    cfg = load_config(TINY, ["data.source=synthetic", *layout, f"pipeline.microbatches={microbatches}",
                             f"train.global_batch={2 * data * microbatches}", f"pipeline.schedule={schedule}"])
    return abstract_program(cfg).lower().compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    if "--bubble" not in sys.argv:
        memory()
    for name in pipeline.names():
        schedule = pipeline.get(name)
        repeats = 1 if schedule.takes_repeats(1) else 2
        print(f"S=4 R={repeats}", name, *(f"M={m}: {schedule.bubble(4, repeats, m):.3f}" for m in (4, 8, 16)),
              "=", schedule.formula(4, repeats, 16))


def memory() -> None:
    for layout, repeats in LAYOUTS.items():
        for schedule in (n for n in pipeline.names() if pipeline.get(n).takes_repeats(repeats)):
            print(" ".join(layout), schedule, *(f"M={m}: {temp_bytes(layout, schedule, m):,}" for m in (4, 8, 16)),
                  flush=True)


if __name__ == "__main__":
    main()
