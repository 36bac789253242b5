"""Every check of a config against the devices it runs on, in one place.

`configs/validate.py` refuses what the config alone makes impossible. What needs the device count
or the platform is checked here: the layout (batch divisibility, pipeline stages and microbatches,
the sequence split, experts, FSDP gathers, the megablox kernel's tiles) by `check_layout`, and the
devices themselves (their count against the mesh, the matmul units `model.quant` needs, the nodes
a hybrid mesh spans, kernels the platform cannot run) by `check_devices`. Each failure is one
`ConfigError` line naming the key, raised before anything is compiled or written. The pipeline
schedule's own constraints live with the schedule (`pipeline.Schedule.check`), called from here.
"""

from __future__ import annotations

import math

import jax

import pipeline
from configs import Config, ConfigError
from model import attn_kernels, stack_layers
from model.attention import query_chunk
from model.moe import megablox_tile
from sharding.hardware import check_quant, hardware_of_kind
from sharding import Rules, axes_size, logical_to_spec, mesh_axes, resolve_mesh_shape
from sharding.mesh import check_nodes
from ops.xla_env import device_count_hint


# Which config key sets the size of each logical dim, for error messages.
DIM_KEYS = {
    "vocab": "model.vocab_size",
    "embed": "model.d_model",
    "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads",
    "head_dim": "model.head_dim",
    "mlp": "model.d_ff",
    "layers": "model.num_layers",
    "expert": "model.moe.num_experts",
    "latent": "model.mla.kv_lora_rank or model.mla.q_lora_rank",
}


def check_divisible(
    shapes: dict, axes: dict, rules: Rules, sizes: dict[str, int]
) -> None:
    """Every sharded dim of every parameter must split evenly. Raises ConfigError naming the key."""
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, shape), names in zip(flat_shapes, flat_axes):
        spec = logical_to_spec(names, rules)
        for dim, logical, entry in zip(shape.shape, names, spec):
            n = axes_size(entry, sizes)
            if dim % n:
                key = DIM_KEYS.get(logical, logical)
                where = "/".join(str(getattr(p, "key", p)) for p in path)
                raise ConfigError(
                    f"{key}={dim} is not divisible by {n}, the size of mesh axes {entry} that shard "
                    f"the '{logical}' dim of parameter {where}"
                )


def check_batch(cfg: Config, sizes: dict[str, int], act_rules: Rules, processes: int) -> int:
    """Raises unless the global batch divides over the batch shards, micro-batches and processes;
    returns the rows each batch shard gets per micro-batch."""
    t = cfg.train
    batch_axes = mesh_axes("batch", act_rules)
    if "pipeline" in batch_axes:
        raise ConfigError("sharding.activations.batch: must not use the pipeline axis (it indexes stages)")
    need = axes_size(batch_axes, sizes) * t.grad_accum
    if t.global_batch % need:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by {need} = batch shards "
            f"({' x '.join(f'{a}={sizes[a]}' for a in batch_axes) or '1'}) x train.grad_accum={t.grad_accum}"
        )
    if t.global_batch % processes:
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by the {processes} processes")
    return t.global_batch // need


def check_context(cfg: Config, sizes: dict[str, int], act_rules: Rules) -> None:
    """The sequence split (`mesh.context`), and the attention kernel's tiles and whether it takes
    the split (model/attn_kernels)."""
    c, m, kernel = sizes["context"], cfg.model, attn_kernels.get(cfg.model.attention)
    kernel.check_tile(cfg)
    if c == 1:
        return
    if mesh_axes("length", act_rules) != ("context",):
        raise ConfigError(f"sharding.activations.length: must be 'context' when mesh.context={c} > 1 "
                          f"(got {mesh_axes('length', act_rules) or None})")
    if m.attention_chunk > 0 and cfg.context.strategy == "ring":
        raise ConfigError(f"model.attention_chunk={m.attention_chunk}: the ring (context.strategy=ring) scores "
                          "its own key blocks; set 0")
    chunk = query_chunk(m.attention_chunk, m.seq_len) if kernel.chunks and cfg.context.strategy != "ring" else 0
    if chunk % c:
        auto = f" (-1 runs {chunk} queries at a time at this length)" if m.attention_chunk < 0 else ""
        raise ConfigError(f"model.attention_chunk={m.attention_chunk}{auto}: each query block is spread over the "
                          f"sequence split, so it must be a multiple of mesh.context={c}; set one, or 0")
    kernel.check_split(cfg, c)
    parts = 2 * c if cfg.context.load_balance else c
    if m.seq_len % parts:
        why = f"2 x mesh.context={c} (context.load_balance=true)" if cfg.context.load_balance else f"mesh.context={c}"
        raise ConfigError(f"model.seq_len={m.seq_len} is not divisible by {why}")


def check_experts(cfg: Config, sizes: dict[str, int], act_rules: Rules) -> None:
    """Expert parallelism: the experts split evenly, and every device sends its own tokens."""
    experts = cfg.model.moe.num_experts
    if sizes["expert"] > 1 and experts % sizes["expert"]:
        raise ConfigError(f"mesh.expert={sizes['expert']} does not divide model.moe.num_experts={experts}")
    if sizes["expert"] > 1 and "expert" not in mesh_axes("batch", act_rules):
        raise ConfigError("sharding.activations.batch: must include the expert axis when mesh.expert > 1 "
                          "(each device sends its own tokens to the experts)")


def gathered_axes(param_rules: Rules, act_rules: Rules, sizes: dict[str, int]) -> set[str]:
    """The mesh axes (of size > 1) that shard a parameter for storage but not for compute: the
    partitioner gathers parameters over them (FSDP)."""
    return {a for name, _ in param_rules for a in mesh_axes(name, param_rules)
            if a not in mesh_axes(name, act_rules) and sizes[a] > 1}


def check_gather(cfg: Config, param_rules: Rules, act_rules: Rules, sizes: dict[str, int]) -> None:
    """`model.gather_dtype` other than compute rounds weights for a gather the layout must have."""
    if cfg.model.gather_dtype != "compute" and not gathered_axes(param_rules, act_rules, sizes):
        raise ConfigError(
            f"model.gather_dtype={cfg.model.gather_dtype}: this layout gathers no parameter (no mesh axis > 1 shards "
            "them for storage only, as mesh.fsdp does), so the weights would be rounded to save nothing; use "
            "model.gather_dtype=compute"
        )


def check_pipeline(cfg: Config, stages: int, micro: int, per_replica: int) -> None:
    """The pipeline's stages, repeats and microbatches (`per_replica`: the rows each batch shard
    gets per micro-batch), then the schedule's own constraints."""
    repeats, schedule = cfg.pipeline.repeats, pipeline.get(cfg.pipeline.schedule)
    if schedule.computes_grads and cfg.model.mtp_depth:
        raise ConfigError(f"model.mtp_depth={cfg.model.mtp_depth}: pipeline.schedule={cfg.pipeline.schedule} computes "
                          "the loss stage by stage without the multi-token prediction modules; use pipeline.schedule=gpipe")
    if stages == 1:
        if repeats > 1:
            raise ConfigError(f"pipeline.repeats={repeats} needs mesh.pipeline > 1")
        if schedule.computes_grads:  # the 1F1B family needs stages to schedule
            raise ConfigError(f"pipeline.schedule={cfg.pipeline.schedule} needs mesh.pipeline > 1")
        return
    layers = stack_layers(cfg.model)  # the dense first layers run before the stages
    if layers % (stages * repeats):
        dense = cfg.model.num_layers - layers
        first = f" - model.moe.first_k_dense_replace={dense}" if dense else ""
        raise ConfigError(f"model.num_layers={cfg.model.num_layers}{first} is not divisible by "
                          f"mesh.pipeline={stages} x pipeline.repeats={repeats}")
    schedule.check(cfg, stages, repeats, micro)
    if micro < stages:
        raise ConfigError(
            f"pipeline.microbatches={micro} is fewer than mesh.pipeline={stages} stages: every stage needs a "
            "microbatch, and with repeats a microbatch must leave the last stage before stage 0 needs it again"
        )
    if per_replica % micro:
        shards = cfg.train.global_batch // (per_replica * cfg.train.grad_accum)
        raise ConfigError(
            f"pipeline.microbatches={micro} does not divide the per-replica batch {per_replica} "
            f"(train.global_batch={cfg.train.global_batch} / {shards} batch shards / "
            f"train.grad_accum={cfg.train.grad_accum})"
        )


def megablox_misfit(cfg: Config, sizes: dict[str, int], stage_rules: Rules) -> str | None:
    """Why the megablox kernel cannot run the config's experts (None: it can): its tiles (128 at
    least) must divide the rows of each device's grouped matmuls (a multiple of the positions it
    holds x top-k) and both weight dims; on several devices it runs per device, in the expert
    dispatcher, so the rules must give the `expert` dim a mesh axis."""
    m, e = cfg.model, cfg.model.moe
    dims = {"model.d_model": m.d_model, "model.moe.d_ff" if e.d_ff else "model.d_ff": e.d_ff or m.d_ff,
            "model.seq_len / mesh.context x model.moe.experts_per_token": m.seq_len // sizes["context"] * e.experts_per_token}
    for key, size in dims.items():
        if not megablox_tile(size):
            return f"{key}={size} is not a multiple of 128, the tile of model.moe.grouped_matmul=megablox"
    if math.prod(sizes.values()) > 1 and not mesh_axes("expert", stage_rules):
        return ("model.moe.grouped_matmul=megablox on several devices runs per device in the expert dispatcher: "
                "sharding.activations.expert must name a mesh axis")
    return None


def check_megablox(cfg: Config, sizes: dict[str, int], stage_rules: Rules) -> None:
    """`model.moe.grouped_matmul=megablox` asked for by name must fit the layout."""
    if cfg.model.moe.enabled and cfg.model.moe.grouped_matmul == "megablox":
        misfit = megablox_misfit(cfg, sizes, stage_rules)
        if misfit:
            raise ConfigError(misfit)


def check_devices(cfg: Config, devices: list, why_no_count: str = "") -> None:
    """The devices themselves: as many as the mesh names (with what to do where they are not), the
    matmul units `model.quant` needs, the nodes a hybrid mesh spans, and kernels the platform
    cannot run. `why_no_count`: why the CPU device count could not be set for the mesh ("": it was
    set, or not needed)."""
    platform = devices[0].platform
    try:
        resolve_mesh_shape(cfg.mesh, len(devices))
    except ConfigError as e:
        hint = device_count_hint(cfg, platform, len(devices), why_no_count)
        raise ConfigError(f"{e}; {hint}" if hint else str(e)) from None
    hw = hardware_of_kind(getattr(devices[0], "device_kind", ""))
    why = check_quant(cfg.model.quant, hw) if hw else None
    if why:
        raise ConfigError(f"model.quant: {why}")
    if cfg.model.moe.enabled and cfg.model.moe.grouped_matmul == "megablox" and platform not in ("tpu", "cpu"):
        raise ConfigError(f"model.moe.grouped_matmul=megablox is a TPU kernel (interpreted on CPU for tests), not "
                          f"for {platform}: use ragged_dot or auto")
    attn_kernels.get(cfg.model.attention).check_platform(platform)
    check_nodes(devices, cfg.mesh.nodes)
