"""Compiled temporaries per device of the tiny train step against the number of microbatches,
for each pipeline schedule, on 8 fake CPU devices (mesh.pipeline=4 mesh.data=2, 2 rows per
microbatch and data replica):

    python -m bench.pipeline_memory
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from configs import load_config  # noqa: E402
from trainer import abstract_program  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")


def temp_bytes(schedule: str, microbatches: int) -> int:
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.pipeline=4", "mesh.data=2",
                             f"pipeline.microbatches={microbatches}", f"train.global_batch={4 * microbatches}",
                             f"pipeline.schedule={schedule}"])
    return abstract_program(cfg).lower().compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    for schedule in ("gpipe", "1f1b"):
        print(schedule, *(f"M={m}: {temp_bytes(schedule, m):,}" for m in (4, 8, 16)), flush=True)


if __name__ == "__main__":
    main()
