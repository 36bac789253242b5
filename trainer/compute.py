"""How a run computes its step: one frozen `Compute`, built once by `build_compute`.

The config says what to train and the layout where; `Compute` says how: the compute-dtype view
of the parameters, the layer runner (the model's scan, or a pipeline schedule's), the gradient
function (autodiff, or a 1F1B-family schedule's own), the kernels bound into the model while it
traces (sharded attention under a sequence split, expert dispatch under expert parallelism, the
embedding lookup under FSDP), the load-balanced order of a sequence split, the loss chunk, the
micro-batches. What the run trains (its objective, the model's loss terms) is not here:
trainer/objectives/ says it.
`build_compute` is the one place these are decided, from the config, the layout and the devices'
platform; `trainer.forward.forward`, the objectives and `make_train_step` take the result by name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, TypeVar

import jax
import numpy as np
from flax import nnx

import pipeline
from configs import Config
from model import LayerRunner, scan_layers
from model.kernels import Kernels
from model.loss import GradFn
from sharding import axes_size, mesh_axes
from sharding.context import balanced_order
from trainer.kernels import bound_kernels
from trainer.layout import Layout

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Compute:
    """How a run computes its step and its eval loss. The defaults are one device's plain step."""

    grad_accum: int = 1  # micro-batches per step, their gradients summed (train.grad_accum)
    loss_chunk: int = 0  # > 0: the output head and loss this many positions at a time (model.loss_chunk)
    cast: Callable[[dict], dict] | None = None  # float32 parameters -> their compute-dtype view
    runner: LayerRunner | None = None  # applies the layer stack (None: the model's own scan)
    grad_fn: GradFn | None = None  # the loss and gradients a schedule computes itself (None: autodiff)
    kernels: Kernels = Kernels()  # bound into the model while it traces (model/kernels.py)
    order: np.ndarray | None = None  # the load-balanced order of a sequence split's positions

    def in_order(self, tree: T, axis: int = 1) -> T:
        """Every array of `tree` with its sequence axis `axis` in the sequence split's
        load-balanced order; all unchanged without one. The losses are sums over tokens and the
        model masks by position, so every per-token input may be permuted alike."""
        if self.order is None:
            return tree
        return jax.tree.map(lambda a: a[(slice(None),) * axis + (self.order,)], tree)


def build_compute(cfg: Config, layout: Layout, graphdef: nnx.GraphDef, platform: str,
                  cast: Callable[[dict], dict] | None = None) -> Compute:
    """How `cfg` computes on `layout` over devices of `platform` ("cpu", "gpu", "tpu"); `cast`: the
    parameters' compute-dtype view (sharding.cast, bound to the state's shardings)."""
    m = cfg.model
    return Compute(
        grad_accum=cfg.train.grad_accum,
        loss_chunk=m.loss_chunk,
        cast=cast,
        runner=layer_runner(layout, m.remat),
        grad_fn=scheduled_grads(layout, graphdef, m.remat, m.loss_chunk, cast),
        kernels=bound_kernels(cfg, layout, platform),
        order=balanced_order(m.seq_len, layout.sizes["context"]) if layout.sizes["context"] > 1
        and cfg.context.load_balance else None,
    )


def layer_runner(layout: Layout, remat_policy: str) -> LayerRunner | None:
    """None (the model's own scan) unless the layout pipelines the stack."""
    if not layout.pipelined:
        return None
    stage_fn = functools.partial(scan_layers, remat_policy=remat_policy)
    return pipeline.get(layout.schedule).layer_runner(layout.stages, layout.repeats, layout.microbatches, stage_fn,
                                                      layout.stage_rules)


def scheduled_grads(layout: Layout, graphdef: nnx.GraphDef, remat_policy: str, loss_chunk: int,
                    cast: Callable[[dict], dict] | None) -> GradFn | None:
    """None (autodiff through the layer runner: GPipe) unless the schedule computes the gradients."""
    schedule = pipeline.get(layout.schedule)
    if not layout.pipelined or not schedule.computes_grads:
        return None
    return schedule.grad_fn(graphdef, pipeline.GradSpec(
        layout.stages, layout.repeats, layout.microbatches, remat_policy, layout.stage_rules, loss_chunk, cast,
        axes_size(mesh_axes("length", layout.stage_rules), layout.sizes)))
