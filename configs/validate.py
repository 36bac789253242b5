"""Static checks of a config: what bad input can be refused from the config alone, before any
device is asked for or anything is compiled or written (checks that need the device count live in
`sharding.mesh`). Each failure is one `ConfigError` line naming the key.
"""

from __future__ import annotations

from configs.schema import (
    ATTENTION_IMPLS,
    CONTEXT_STRATEGIES,
    CPU_MATMULS,
    DATA_SOURCES,
    DTYPES,
    FLAT_WEIGHT_GRADS,
    GATHER_DTYPES,
    GRAD_REDUCE_DTYPES,
    LOGITS_DTYPES,
    GROUPED_MATMULS,
    LOGICAL_AXES,
    MESH_AXES,
    OPTIMIZERS,
    PACKINGS,
    PIPELINE_SCHEDULES,
    QUANT_MODES,
    REMAT_POLICIES,
    REUSE_HOST_MEMORY,
    ROUTERS,
    SCHEDULES,
    TRACKERS,
    Config,
    ConfigError,
    closest,
    nan_steps,
)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _one_of(d.source, "data.source", DATA_SOURCES)
    _one_of(d.packing, "data.packing", PACKINGS)
    _require(d.workers >= 0, "data.workers", f"must be >= 0, got {d.workers}")
    _require(0 <= d.eval_fraction < 1, "data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}")
    _require(not d.mixture or d.source == "prepared", "data.mixture", "needs data.source=prepared")
    _require(not (d.mixture and d.path), "data.mixture", "set either data.path or data.mixture, not both")
    _require(d.source != "prepared" or bool(d.path or d.mixture), "data.path", "data.source=prepared needs a directory")
    _require(d.source != "synthetic" or d.packing == "concat", "data.packing", "synthetic data has no documents")
    _require(cfg.eval.every >= 0, "eval.every", f"must be >= 0 (0: off), got {cfg.eval.every}")
    _require(cfg.eval.batches > 0, "eval.batches", f"must be > 0, got {cfg.eval.batches}")


def _check_profile(cfg: Config) -> None:
    steps = cfg.profile.steps
    if not steps:
        return
    _require(len(steps) == 2, "profile.steps", f"expected [first, last] (two steps), got {steps}")
    first, last = steps
    _require(
        1 <= first <= last <= cfg.train.steps,
        "profile.steps",
        f"{steps} must satisfy 1 <= first <= last <= train.steps={cfg.train.steps}",
    )


def _check_moe(cfg: Config) -> None:
    e = cfg.model.moe
    _require(e.num_experts >= 0, "model.moe.num_experts", f"must be >= 0 (0: dense), got {e.num_experts}")
    _require(cfg.mesh.expert == 1 or e.enabled, "mesh.expert", f"{cfg.mesh.expert} needs model.moe.num_experts > 0")
    _one_of(e.router, "model.moe.router", ROUTERS)
    _one_of(e.grouped_matmul, "model.moe.grouped_matmul", GROUPED_MATMULS)
    _require(e.every >= 1, "model.moe.every", f"must be >= 1 (1: every layer is an MoE), got {e.every}")
    if not e.enabled:
        return
    _require(cfg.model.num_layers % e.every == 0, "model.moe.every",
             f"{e.every} does not divide model.num_layers={cfg.model.num_layers}")
    # The pipeline splits the stack by layers; a group of `every` layers is one scanned step.
    _require(e.every == 1 or cfg.mesh.pipeline == 1, "model.moe.every",
             f"{e.every} with mesh.pipeline={cfg.mesh.pipeline}: layer groups are not split into stages yet")
    _require(
        1 <= e.experts_per_token <= e.num_experts,
        "model.moe.experts_per_token",
        f"must be in [1, model.moe.num_experts={e.num_experts}], got {e.experts_per_token}",
    )
    _require(e.d_ff >= 0, "model.moe.d_ff", f"must be >= 0 (0: model.d_ff), got {e.d_ff}")
    _require(e.shared_experts >= 0, "model.moe.shared_experts", f"must be >= 0, got {e.shared_experts}")
    _require(e.capacity_factor >= 0, "model.moe.capacity_factor", f"must be >= 0 (0: dropless), got {e.capacity_factor}")
    _require(e.aux_loss_coef >= 0, "model.moe.aux_loss_coef", f"must be >= 0, got {e.aux_loss_coef}")
    _require(e.router_z_loss_coef >= 0, "model.moe.router_z_loss_coef", f"must be >= 0, got {e.router_z_loss_coef}")
    _require(
        cfg.mesh.expert <= 0 or e.num_experts % cfg.mesh.expert == 0,
        "mesh.expert",
        f"{cfg.mesh.expert} does not divide model.moe.num_experts={e.num_experts}",
    )


def _check_logical_name(key: str, logical: str) -> None:
    if logical in LOGICAL_AXES:
        return
    guess = closest(logical, LOGICAL_AXES)
    hint = f"did you mean {guess!r}?" if guess else f"the model's names are {', '.join(LOGICAL_AXES)}"
    raise ConfigError(f"{key}: unknown logical name; {hint}")


def validate_static(cfg: Config) -> None:
    """Checks that need no devices. Raises ConfigError naming the first bad key."""
    t, m, o = cfg.train, cfg.model, cfg.optim
    _require(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
    _require(t.batch_streams >= 0, "train.batch_streams", f"must be >= 0 (0: the stack picks), got {t.batch_streams}")
    for key, value in [
        ("train.global_batch", t.global_batch),
        ("train.grad_accum", t.grad_accum),
        ("train.log_every", t.log_every),
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep", cfg.checkpoint.keep),
        ("model.num_layers", m.num_layers),
        ("model.d_model", m.d_model),
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
        ("model.seq_len", m.seq_len),
        ("data.read_threads", cfg.data.read_threads),
    ]:
        _require(value > 0, key, f"must be > 0, got {value}")
    _require(cfg.pipeline.repeats > 0, "pipeline.repeats", f"must be > 0, got {cfg.pipeline.repeats}")
    _require(
        cfg.pipeline.microbatches >= 0,
        "pipeline.microbatches",
        f"must be >= 0 (0: one per stage), got {cfg.pipeline.microbatches}",
    )
    _require(m.head_dim >= 0, "model.head_dim", f"must be >= 0 (0: d_model // num_heads), got {m.head_dim}")
    _require(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_kv_heads",
        f"{m.num_kv_heads} does not divide model.num_heads={m.num_heads} (grouped-query attention)",
    )
    _require(
        m.head_dim > 0 or m.d_model % m.num_heads == 0,
        "model.num_heads",
        f"{m.num_heads} does not divide model.d_model={m.d_model}; set model.head_dim explicitly",
    )
    _require(m.resolved_head_dim % 2 == 0, "model.head_dim", f"must be even for rotary embeddings, got {m.resolved_head_dim}")
    _require(
        m.loss_chunk >= 0 and (m.loss_chunk == 0 or m.seq_len % m.loss_chunk == 0),
        "model.loss_chunk",
        f"{m.loss_chunk} must be 0 (off) or divide model.seq_len={m.seq_len}",
    )
    _require(m.max_documents >= 0, "model.max_documents", f"must be >= 0 (0: no bound), got {m.max_documents}")
    _require(m.scan_unroll >= 0, "model.scan_unroll", f"must be >= 0 (0: the stack picks), got {m.scan_unroll}")
    _require(m.attention_block >= 0, "model.attention_block",
             f"must be >= 0 (0: the stack picks), got {m.attention_block}")
    _require(m.attention_block == 0 or m.attention == "xla", "model.attention_block",
             f"blocks model.attention=xla only, not {m.attention}: leave it 0")
    _require(cfg.mesh.nodes > 0, "mesh.nodes", f"must be > 0 (1: one node or slice), got {cfg.mesh.nodes}")
    _one_of(cfg.mesh.across, "mesh.across", MESH_AXES)
    _one_of(m.dtype, "model.dtype", DTYPES)
    _one_of(m.remat, "model.remat", REMAT_POLICIES)
    _one_of(cfg.pipeline.schedule, "pipeline.schedule", PIPELINE_SCHEDULES)
    _one_of(m.attention, "model.attention", ATTENTION_IMPLS)
    _one_of(m.quant, "model.quant", QUANT_MODES)
    _one_of(m.grad_reduce, "model.grad_reduce", GRAD_REDUCE_DTYPES)
    _one_of(m.gather_dtype, "model.gather_dtype", GATHER_DTYPES)
    _one_of(m.logits_dtype, "model.logits_dtype", LOGITS_DTYPES)
    _one_of(m.flat_weight_grads, "model.flat_weight_grads", FLAT_WEIGHT_GRADS)
    _one_of(m.cpu_matmul, "model.cpu_matmul", CPU_MATMULS)
    _one_of(cfg.run.reuse_host_memory, "run.reuse_host_memory", REUSE_HOST_MEMORY)
    _one_of(cfg.context.strategy, "context.strategy", CONTEXT_STRATEGIES)
    _check_data(cfg)
    _check_moe(cfg)
    _one_of(o.schedule, "optim.schedule", SCHEDULES)
    _one_of(o.name, "optim.name", OPTIMIZERS)
    for name in cfg.run.trackers:
        _one_of(name, "run.trackers", TRACKERS)
    _require(len(set(cfg.run.trackers)) == len(cfg.run.trackers), "run.trackers", f"names a tracker twice: {cfg.run.trackers}")
    _require(t.step_timeout_s >= 0, "train.step_timeout_s", f"must be >= 0 (0: off), got {t.step_timeout_s}")
    _require(t.max_bad_steps > 0, "train.max_bad_steps", f"must be > 0, got {t.max_bad_steps}")
    _require(0 <= t.preempt_exit_code < 256, "train.preempt_exit_code", f"must be in [0, 256), got {t.preempt_exit_code}")
    d = cfg.dist
    _require(d.num_processes >= 0, "dist.num_processes", f"must be >= 0 (0: detect), got {d.num_processes}")
    _require(
        d.process_id == -1 or 0 <= d.process_id < max(d.num_processes, 1),
        "dist.process_id",
        f"{d.process_id} is not in [0, dist.num_processes={d.num_processes})",
    )
    _require(
        not d.coordinator or (":" in d.coordinator and d.coordinator.rsplit(":", 1)[1].isdigit()),
        "dist.coordinator",
        f"expected host:port, got {d.coordinator!r}",
    )
    _require(d.heartbeat_timeout_s > 0, "dist.heartbeat_timeout_s", f"must be > 0, got {d.heartbeat_timeout_s}")
    _require(d.init_timeout_s > 0, "dist.init_timeout_s", f"must be > 0, got {d.init_timeout_s}")
    nan_steps(cfg)
    _check_profile(cfg)
    _require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _require(o.muon_lr > 0, "optim.muon_lr", f"must be > 0, got {o.muon_lr}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(o.decay_steps >= 0, "optim.decay_steps", f"must be >= 0 (0: train.steps at the run's start), got {o.decay_steps}")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.clip >= 0, "optim.clip", f"must be >= 0, got {o.clip}")
    _require(cfg.data.prefetch >= 0, "data.prefetch", f"must be >= 0, got {cfg.data.prefetch}")
    _require(bool(cfg.run.dir), "run.dir", "must not be empty")
    _require(cfg.run.lock_timeout_s > 0, "run.lock_timeout_s", f"must be > 0, got {cfg.run.lock_timeout_s}")
    for table in ("params", "activations"):
        for logical, mesh_axes in getattr(cfg.sharding, table).items():
            _check_logical_name(f"sharding.{table}.{logical}", logical)
            for axis in mesh_axes if isinstance(mesh_axes, list) else [mesh_axes]:
                _require(
                    axis is None or axis in MESH_AXES,
                    f"sharding.{table}.{logical}",
                    f"{axis!r} is not a mesh axis ({', '.join(MESH_AXES)})",
                )
    _require(0 <= cfg.run.seed < 2**32, "run.seed", f"must be in [0, 2**32), got {cfg.run.seed}")
