"""Save and restore throughput of a checkpoint on local disk and on the two object stores.

    python -m bench.storage [--gb 1.0] [--repeat 3] [--only local,s3,gs]

A train state of about `--gb` GB (float32 parameters shaped like the model of `model_keys`, with
AdamW's two moments, every array random so no codec shortens it) on the CPU device is saved and
restored through the run's own `trainer.checkpoint.Checkpointer` (Orbax, asynchronous saves, the
commit-file protocol on a bucket), once per target: a local temporary directory, moto's S3 server
and fake-gcs-server, each started here on 127.0.0.1 (bench/object_servers.py) as the storage tests
start them. `--repeat` saves (steps 1, 2, ...: nothing deleted between them) and as many restores
per target; printed per target, medians over them: the state's size, the loop's blocking time of
the asynchronous save (the `save` call, as the training loop times it; the first save's includes
Orbax's one-time set-up, which the median leaves out from 3 repeats on), the save's total time
(until `wait` returns: the step committed), its throughput, and the restore's time and throughput
(a new Checkpointer, as a resumed run opens one).

The servers run on this host over loopback: the figures bound what the checkpoint code and the
clients sustain, not a cloud store's throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Iterator

import grain
import jax
import numpy as np
import optax

from bench.object_servers import TARGETS, bench_bucket, parse_targets
from configs import load_config
from configs.schema import CheckpointConfig
from trainer.checkpoint import Checkpointer
from trainer.state import TrainState, abstract_model

# Layers of width 1024 (d_ff 4096), as many as the state's size asks (`layers_for`): 0.15 GB each
# with AdamW's two moments.
MODEL_KEYS = ["model.num_layers=5", "model.d_model=1024", "model.d_ff=4096", "model.num_heads=8", "model.num_kv_heads=8"]


@dataclasses.dataclass
class Row:
    target: str
    gb: float
    blocking_s: float
    save_s: float
    restore_s: float


def _shapes(layers: int) -> dict:
    return abstract_model(load_config("tiny", MODEL_KEYS + [f"model.num_layers={layers}"]).model).shapes


def layers_for(gb: float) -> int:
    """The layer count whose parameters and two moments come nearest `gb` (at least 1)."""
    size = [3 * sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(_shapes(n))) / 1e9 for n in (1, 2)]
    return max(1, round((gb - size[0]) / (size[1] - size[0])) + 1)


def make_state(layers: int) -> TrainState:
    """A random TrainState on the CPU device: the model's parameter shapes and AdamW's moments."""
    shapes = _shapes(layers)
    rng = np.random.default_rng(0)
    device = jax.devices("cpu")[0]

    def fill(x: jax.ShapeDtypeStruct) -> jax.Array:
        return jax.device_put(rng.standard_normal(x.shape, dtype=np.float32), device)

    params = jax.tree.map(fill, shapes)
    opt_state = optax.adamw(1e-3).init(params)
    # The moments start as zeros, which a codec could shorten: random, like a trained run's.
    opt_state = jax.tree.map(lambda a: fill(a) if a.ndim else a, opt_state)
    return TrainState(step=jax.device_put(np.int32(1), device), params=params, opt_state=opt_state)


def state_gb(state: TrainState) -> float:
    return sum(a.nbytes for a in jax.tree.leaves(state)) / 1e9


def _iterator() -> grain.DatasetIterator:
    """A data position to save beside the state, as a run's Checkpointer does."""
    return iter(grain.MapDataset.range(8).to_iter_dataset())


def measure(target: str, directory: str, state: TrainState, repeat: int) -> Row:
    """Saves `state` at steps 1..`repeat` of `directory`, then restores each with a fresh
    Checkpointer; the medians."""
    cfg = CheckpointConfig(every=1, keep=repeat, async_save=True)
    blocking, save, restore = [], [], []
    ckpt = Checkpointer(directory, cfg)
    for step in range(1, repeat + 1):
        start = time.perf_counter()
        ckpt.save(step, state, _iterator())
        blocking.append(time.perf_counter() - start)
        ckpt.wait()
        save.append(time.perf_counter() - start)
    ckpt.close()
    target_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    first = np.asarray(jax.tree.leaves(state.params)[0])
    for step in range(1, repeat + 1):
        ckpt = Checkpointer(directory, cfg)
        start = time.perf_counter()
        restored = ckpt.restore(step, target_state, _iterator())
        jax.block_until_ready(restored)
        restore.append(time.perf_counter() - start)
        ckpt.close()
        # A restore that read the wrong bytes must not pass for a fast one.
        assert np.array_equal(np.asarray(jax.tree.leaves(restored.params)[0]), first), (target, step)
        del restored
    median = statistics.median
    return Row(target, state_gb(state), median(blocking), median(save), median(restore))


@contextlib.contextmanager
def _target(target: str) -> Iterator[str]:
    """Starts `target`'s server (none for local), yields the checkpoint directory, stops it."""
    if target == "local":
        tmp = tempfile.mkdtemp(prefix="meshlm-bench-storage-")
        try:
            yield os.path.join(tmp, "checkpoints")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    with bench_bucket(target) as root:
        yield f"{root}/run/checkpoints"


def table(rows: list[Row]) -> str:
    lines = ["| target | state GB | save blocking s | save total s | save GB/s | restore s | restore GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.target} | {r.gb:.2f} | {r.blocking_s:.2f} | {r.save_s:.1f} | {r.gb / r.save_s:.2f} | "
                     f"{r.restore_s:.1f} | {r.gb / r.restore_s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="the state's size, in GB (rounded to whole layers)")
    parser.add_argument("--repeat", type=int, default=3, help="saves and restores per target (medians)")
    parser.add_argument("--only", default=",".join(TARGETS), help="targets, comma-separated: local, s3, gs")
    args = parser.parse_args(argv)
    targets = parse_targets(parser, args.only)
    if args.repeat < 1:
        parser.error(f"--repeat: at least 1, got {args.repeat}")
    state = make_state(layers_for(args.gb))
    rows = []
    for target in targets:
        with _target(target) as directory:
            rows.append(measure(target, directory, state, args.repeat))
    out(table(rows))
    return rows


if __name__ == "__main__":
    main()
