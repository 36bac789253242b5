"""What a config means on a device count: mesh sizes, rules, and the layer runner.

Every check that the layout can fail (mesh product, batch divisibility, pipeline stages and
microbatches) raises ConfigError here, naming the key, before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
from flax import nnx

import pipeline
from configs import Config, ConfigError
from model import LayerRunner, scan_layers
from model.attention import block_mask, splash_attention
from sharding import Rules, axes_size, mesh_axes, resolve_mesh_shape, to_rules
from model.moe import DispatchFn, GroupedMatmul, local_dispatch, megablox_matmul, megablox_tile
from sharding.context import SequenceSplit, balanced_order, check_context, per_device, sharded_ring
from sharding.experts import expert_parallel
from trainer.step import GradFn


@dataclasses.dataclass(frozen=True)
class Layout:
    sizes: dict[str, int]
    param_rules: Rules
    act_rules: Rules  # activations outside the layer stack, and the input batch
    stage_rules: Rules  # activations inside a pipeline stage (= act_rules without pipelining)
    stages: int
    repeats: int
    microbatches: int
    schedule: str  # pipeline.schedule, a name in the pipeline package's registry

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def bubble(self) -> float:
        return pipeline.get(self.schedule).bubble(self.stages, self.repeats, self.microbatches)


def _with_batch_axis(rules: Rules, axis: str) -> Rules:
    """`rules` with `axis` appended to the mesh axes of `batch`."""
    return _with_axis(rules, "batch", axis)


def _with_axis(rules: Rules, name: str, axis: str) -> Rules:
    """`rules` with `axis` appended to the mesh axes of the logical `name`."""
    out = []
    for logical, entry in rules:
        if logical == name:
            entry = (entry if isinstance(entry, tuple) else (() if entry is None else (entry,))) + (axis,)
        out.append((logical, entry))
    return tuple(out)


def plan_layout(cfg: Config, num_devices: int) -> Layout:
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    param_rules, act_rules = to_rules(cfg.sharding.params), to_rules(cfg.sharding.activations)
    t = cfg.train
    batch_axes = mesh_axes("batch", act_rules)
    if "pipeline" in batch_axes:
        raise ConfigError("sharding.activations.batch: must not use the pipeline axis (it indexes stages)")
    shards = axes_size(batch_axes, sizes)
    need = shards * t.grad_accum
    if t.global_batch % need:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by {need} = batch shards "
            f"({' x '.join(f'{a}={sizes[a]}' for a in batch_axes) or '1'}) x train.grad_accum={t.grad_accum}"
        )
    check_context(cfg, sizes, act_rules)
    experts = cfg.model.moe.num_experts
    if sizes["expert"] > 1 and experts % sizes["expert"]:
        raise ConfigError(f"mesh.expert={sizes['expert']} does not divide model.moe.num_experts={experts}")
    if sizes["expert"] > 1 and "expert" not in batch_axes:
        raise ConfigError("sharding.activations.batch: must include the expert axis when mesh.expert > 1 "
                          "(each device sends its own tokens to the experts)")
    if sizes["context"] > 1:
        # A context group's devices hold different positions of the same rows: the parameters
        # they would each hold whole are sharded over them as well, FSDP-style.
        param_rules = _with_axis(param_rules, "embed", "context")
    if cfg.model.gather_dtype != "compute" and not _gathered_axes(param_rules, act_rules, sizes):
        raise ConfigError(
            f"model.gather_dtype={cfg.model.gather_dtype}: this layout gathers no parameter (no mesh axis > 1 shards "
            "them for storage only, as mesh.fsdp does), so the weights would be rounded to save nothing; use "
            "model.gather_dtype=compute"
        )
    stages, repeats = sizes["pipeline"], cfg.pipeline.repeats
    micro = cfg.pipeline.microbatches or stages
    stage_rules = act_rules
    if stages > 1:
        _check_pipeline(cfg, stages, repeats, micro, t.global_batch // need, shards)
        # Outside the stack (embedding, head, loss) the stages split the batch instead of
        # repeating the same work, where the rows divide evenly.
        if (t.global_batch // need) % stages == 0:
            act_rules = _with_batch_axis(act_rules, "pipeline")
    elif repeats > 1:
        raise ConfigError(f"pipeline.repeats={repeats} needs mesh.pipeline > 1")
    elif pipeline.get(cfg.pipeline.schedule).computes_grads:  # the 1F1B family needs stages to schedule
        raise ConfigError(f"pipeline.schedule={cfg.pipeline.schedule} needs mesh.pipeline > 1")
    if cfg.model.moe.enabled and cfg.model.moe.grouped_matmul == "megablox":
        misfit = megablox_misfit(cfg, sizes, stage_rules)
        if misfit:
            raise ConfigError(misfit)
    return Layout(sizes, param_rules, act_rules, stage_rules, stages, repeats, micro, cfg.pipeline.schedule)


def _gathered_axes(param_rules: Rules, act_rules: Rules, sizes: dict[str, int]) -> set[str]:
    """The mesh axes (of size > 1) that shard a parameter for storage but not for compute: the
    partitioner gathers parameters over them (FSDP)."""
    return {a for name, _ in param_rules for a in mesh_axes(name, param_rules)
            if a not in mesh_axes(name, act_rules) and sizes[a] > 1}


def _check_pipeline(cfg: Config, stages: int, repeats: int, micro: int, per_replica: int, shards: int) -> None:
    layers = cfg.model.num_layers
    if layers % (stages * repeats):
        raise ConfigError(
            f"model.num_layers={layers} is not divisible by mesh.pipeline={stages} x pipeline.repeats={repeats}"
        )
    pipeline.get(cfg.pipeline.schedule).check(cfg, stages, repeats, micro)
    if micro < stages:
        raise ConfigError(
            f"pipeline.microbatches={micro} is fewer than mesh.pipeline={stages} stages: every stage needs a "
            "microbatch, and with repeats a microbatch must leave the last stage before stage 0 needs it again"
        )
    if per_replica % micro:
        raise ConfigError(
            f"pipeline.microbatches={micro} does not divide the per-replica batch {per_replica} "
            f"(train.global_batch={cfg.train.global_batch} / {shards} batch shards / "
            f"train.grad_accum={cfg.train.grad_accum})"
        )


def attention_notes(cfg: Config) -> list[str]:
    """What the run's attention falls back to, said at start (train.py) and in plans."""
    m = cfg.model
    if m.attention == "cudnn" and cfg.data.packing == "document" and m.max_documents == 0:
        return ["model.attention=cudnn with data.packing=document builds a dense [batch, 1, T, T] mask of the "
                "documents; set model.max_documents (the most documents a row may hold) for cuDNN's packed "
                "layout, no mask"]
    return []


def sequence_split(cfg: Config, layout: Layout, platform: str) -> SequenceSplit | None:
    """The load-balanced order and the attention kernel the layout needs (None: neither), for
    devices of `platform`: a sharded kernel under a sequence split (splash runs as the TPU kernel
    on "tpu", interpreted elsewhere)."""
    shards = layout.sizes["context"]
    order = balanced_order(cfg.model.seq_len, shards) if shards > 1 and cfg.context.load_balance else None
    attention = None
    if cfg.context.strategy == "ring" and cfg.model.attention == "xla":
        attention = sharded_ring(layout.stage_rules, shards, block_mask)
    elif cfg.model.attention == "splash":
        kernel = functools.partial(splash_attention, interpret=platform != "tpu")
        attention = per_device(kernel, layout.stage_rules)
    return None if order is None and attention is None else SequenceSplit(order, attention)


def scheduled_grads(
    layout: Layout, graphdef: nnx.GraphDef, remat_policy: str, loss_chunk: int, cast: Callable[[dict], dict]
) -> GradFn | None:
    """None (autodiff through the layer runner: GPipe) unless the schedule computes the gradients."""
    schedule = pipeline.get(layout.schedule)
    if not layout.pipelined or not schedule.computes_grads:
        return None
    return schedule.grad_fn(
        graphdef, layout.stages, layout.repeats, layout.microbatches, remat_policy, layout.stage_rules, loss_chunk, cast,
        axes_size(mesh_axes("length", layout.stage_rules), layout.sizes),
    )


def layer_runner(layout: Layout, remat_policy: str) -> LayerRunner | None:
    """None (the model's own scan) unless the layout pipelines the stack."""
    if not layout.pipelined:
        return None
    stage_fn = functools.partial(scan_layers, remat_policy=remat_policy)
    return pipeline.get(layout.schedule).layer_runner(layout.stages, layout.repeats, layout.microbatches, stage_fn,
                                                      layout.stage_rules)


def megablox_misfit(cfg: Config, sizes: dict[str, int], stage_rules: Rules) -> str | None:
    """Why the megablox kernel cannot run the config's experts (None: it can): its tiles (128 at
    least) must divide the rows of each device's grouped matmuls (a multiple of the positions it
    holds x top-k) and both weight dims; on several devices it runs per device, in the expert
    dispatcher, so the rules must give the `expert` dim a mesh axis."""
    m, e = cfg.model, cfg.model.moe
    dims = {"model.d_model": m.d_model, "model.moe.d_ff" if e.d_ff else "model.d_ff": e.d_ff or m.d_ff,
            f"model.seq_len / mesh.context x model.moe.experts_per_token": m.seq_len // sizes["context"] * e.experts_per_token}
    for key, size in dims.items():
        if not megablox_tile(size):
            return f"{key}={size} is not a multiple of 128, the tile of model.moe.grouped_matmul=megablox"
    if math.prod(sizes.values()) > 1 and not mesh_axes("expert", stage_rules):
        return ("model.moe.grouped_matmul=megablox on several devices runs per device in the expert dispatcher: "
                "sharding.activations.expert must name a mesh axis")
    return None


def grouped_matmul(cfg: Config, layout: Layout, platform: str) -> GroupedMatmul:
    """The dropless experts' grouped matmul on devices of `platform` (`model.moe.grouped_matmul`):
    megablox is the TPU kernel on "tpu", interpreted on "cpu" (tests), refused elsewhere; auto
    takes it on TPU where it fits, else jax.lax.ragged_dot."""
    choice = cfg.model.moe.grouped_matmul
    if choice == "auto":
        fits = platform == "tpu" and megablox_misfit(cfg, layout.sizes, layout.stage_rules) is None
        choice = "megablox" if fits else "ragged_dot"
    if choice == "ragged_dot" or not cfg.model.moe.enabled:
        return jax.lax.ragged_dot
    if platform not in ("tpu", "cpu"):
        raise ConfigError(f"model.moe.grouped_matmul=megablox is a TPU kernel (interpreted on CPU for tests), not "
                          f"for {platform}: use ragged_dot or auto")
    return functools.partial(megablox_matmul, interpret=platform != "tpu")


def expert_dispatcher(layout: Layout, matmul: GroupedMatmul = jax.lax.ragged_dot) -> DispatchFn | None:
    """The MoE dispatch of a multi-device layout: each device routes its own tokens (over
    `expert` when mesh.expert > 1; with one expert shard the all-to-alls are no-ops and the
    experts' weights are gathered, as FSDP gathers a dense MLP's). Left to the partitioner, the
    sort of the assignments would run over the global batch (the Mixtral plan at fsdp=64 needed
    300 GB of temporaries per device). On one device, or when the rules give the `expert` dim no
    mesh axis, every expert runs on the one device (None with ragged_dot, the model's default).
    `matmul`: the dropless experts' grouped matmul (`grouped_matmul`)."""
    if math.prod(layout.sizes.values()) == 1 or not mesh_axes("expert", layout.stage_rules):
        return None if matmul is jax.lax.ragged_dot else functools.partial(local_dispatch, matmul=matmul)
    return expert_parallel(layout.stage_rules, layout.sizes["expert"], matmul)
