"""Compiled temporaries per device of the tiny train step against the number of microbatches,
for each pipeline schedule, on 8 fake CPU devices, 2 rows per microbatch and data replica:
gpipe and 1f1b on mesh.pipeline=4 mesh.data=2, then gpipe (circular) and interleaved_1f1b on
mesh.pipeline=2 mesh.data=4 pipeline.repeats=2:

    python -m bench.pipeline_memory
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from configs import load_config  # noqa: E402
from trainer import abstract_program  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
LAYOUTS = {  # mesh overrides -> the schedules compared on it
    ("mesh.pipeline=4", "mesh.data=2"): ("gpipe", "1f1b"),
    ("mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2"): ("gpipe", "interleaved_1f1b"),
}


def temp_bytes(layout: tuple[str, ...], schedule: str, microbatches: int) -> int:
    data = int(next(o for o in layout if o.startswith("mesh.data=")).split("=")[1])
    cfg = load_config(TINY, ["data.source=synthetic", *layout, f"pipeline.microbatches={microbatches}",
                             f"train.global_batch={2 * data * microbatches}", f"pipeline.schedule={schedule}"])
    return abstract_program(cfg).lower().compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    for layout, schedules in LAYOUTS.items():
        for schedule in schedules:
            print(" ".join(layout), schedule, *(f"M={m}: {temp_bytes(layout, schedule, m):,}" for m in (4, 8, 16)),
                  flush=True)


if __name__ == "__main__":
    main()
