"""Static checks of a config that its types cannot state: rules between keys, and the few rules of
one key that are neither a choice nor a range. Pydantic has already checked every type, choice
(`Literal`) and range (`Range`) of configs/schema.py by the time these run. All of them run before
any device is asked for or anything is compiled or written (checks that need the device count live
in `sharding.mesh`). Each failure is one `ConfigError` line naming the key.
"""

from __future__ import annotations

import re

from configs.lora import LORA_TARGETS
from configs.moe import MoEConfig
from configs.schema import LOGICAL_AXES, MESH_AXES, Config, ConfigError, closest, nan_steps


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _require(not d.mixture or d.source == "prepared", "data.mixture", "needs data.source=prepared")
    _require(not (d.mixture and d.path), "data.mixture", "set either data.path or data.mixture, not both")
    _require(d.source != "prepared" or bool(d.path or d.mixture), "data.path", "data.source=prepared needs a directory")
    _require(d.source != "synthetic" or d.packing == "concat", "data.packing", "synthetic data has no documents")


# One part of `rl.reward`: a registered reward's name, or a function by path `pkg.module:fn`.
# Whether the name is registered, or the function imports, is trainer/rewards.py's check.
_REWARD_PART = re.compile(r"[A-Za-z_]\w*|[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _check_rl(cfg: Config) -> None:
    rl = cfg.rl
    parts = rl.reward.split(",")
    bad = next((p for p in parts if not _REWARD_PART.fullmatch(p.strip())), None)
    _require(bad is None, "rl.reward", f"{bad!r} is neither a reward's name nor a function's path pkg.module:fn "
             f"(in {rl.reward!r}; several are comma-separated)")
    try:
        re.compile(rl.answer_format)
    except re.error as e:
        raise ConfigError(f"rl.answer_format: {rl.answer_format!r} is not a regular expression ({e})") from None
    _require(rl.top_k < cfg.model.vocab_size, "rl.top_k",
             f"{rl.top_k} must be below model.vocab_size={cfg.model.vocab_size} (0: all tokens)")


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
    _require(cfg.mesh.expert == 1 or e.enabled, "mesh.expert", f"{cfg.mesh.expert} needs model.moe.num_experts > 0")
    if not e.enabled:
        return
    _require(e.first_k_dense_replace < cfg.model.num_layers, "model.moe.first_k_dense_replace",
             f"{e.first_k_dense_replace} leaves no MoE layer of model.num_layers={cfg.model.num_layers}")
    _require(e.first_k_dense_replace == 0 or e.every == 1, "model.moe.first_k_dense_replace",
             f"{e.first_k_dense_replace} with model.moe.every={e.every}: one way of placing dense layers at a time")
    _require(cfg.model.num_layers % e.every == 0, "model.moe.every",
             f"{e.every} does not divide model.num_layers={cfg.model.num_layers}")
    _check_sigmoid_router(e)
    # The pipeline splits the stack by layers; a group of `every` layers is one scanned step.
    _require(e.every == 1 or cfg.mesh.pipeline == 1, "model.moe.every",
             f"{e.every} with mesh.pipeline={cfg.mesh.pipeline}: layer groups are not split into stages yet")
    _require(
        1 <= e.experts_per_token <= e.num_experts,
        "model.moe.experts_per_token",
        f"must be in [1, model.moe.num_experts={e.num_experts}], got {e.experts_per_token}",
    )
    _require(
        cfg.mesh.expert <= 0 or e.num_experts % cfg.mesh.expert == 0,
        "mesh.expert",
        f"{cfg.mesh.expert} does not divide model.moe.num_experts={e.num_experts}",
    )


def _check_sigmoid_router(e: MoEConfig) -> None:
    """Grouped top-k (DeepSeek-V3): whole groups, and enough experts in the chosen ones."""
    if e.router != "sigmoid":
        _require(e.n_group == 1, "model.moe.n_group", f"{e.n_group} needs model.moe.router=sigmoid")
        return
    _require(e.num_experts % e.n_group == 0, "model.moe.n_group",
             f"{e.n_group} does not divide model.moe.num_experts={e.num_experts}")
    _require(e.topk_group <= e.n_group, "model.moe.topk_group",
             f"{e.topk_group} is more than model.moe.n_group={e.n_group}")
    allowed = e.topk_group * e.num_experts // e.n_group
    _require(e.experts_per_token <= allowed, "model.moe.experts_per_token",
             f"{e.experts_per_token} is more than the {allowed} experts of model.moe.topk_group={e.topk_group} groups")


def _check_model(cfg: Config) -> None:
    m = cfg.model
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
        m.loss_chunk == 0 or m.seq_len % m.loss_chunk == 0,
        "model.loss_chunk",
        f"{m.loss_chunk} must be 0 (off) or divide model.seq_len={m.seq_len}",
    )
    _require(m.attention_chunk <= 0 or m.seq_len % m.attention_chunk == 0, "model.attention_chunk",
             f"{m.attention_chunk} must be 0 (off), -1 (auto) or divide model.seq_len={m.seq_len}")
    # A kernel's `chunks` (model/attn_kernels), named here: the configs cannot import the model.
    _require(m.attention_chunk <= 0 or m.attention == "xla", "model.attention_chunk",
             f"chunks model.attention=xla only (model.attention={m.attention} never forms the scores); set 0")


def _check_lora(cfg: Config) -> None:
    lo, moe = cfg.model.lora, cfg.model.moe
    _require(lo.enabled or lo.dropout == 0, "model.lora.dropout",
             f"{lo.dropout} drops the adapters' input, and model.lora.rank=0 gives no adapters")
    if not lo.enabled:
        return
    _require(bool(lo.targets), "model.lora.targets", f"names no projection; choose from {', '.join(LORA_TARGETS)}")
    _require(len(set(lo.targets)) == len(lo.targets), "model.lora.targets", f"names a projection twice: {lo.targets}")
    mlp = [t for t in lo.targets if t in ("gate", "up", "down")]
    _require(not (mlp and moe.enabled and moe.every == 1), "model.lora.targets",
             f"{', '.join(mlp)} adapt dense SwiGLU layers, and with model.moe.every=1 every layer is an MoE; "
             "adapt q, k, v, o")
    if cfg.model.attention_type == "mla":
        # MLA's keys and values come from one shared latent (kv_a, kv_b): there is no k or v projection.
        latent_q = cfg.model.mla.q_lora_rank > 0
        bad = [t for t in lo.targets if t in ("k", "v") or (t == "q" and latent_q)]
        _require(not bad, "model.lora.targets",
                 f"{', '.join(bad)}: multi-head latent attention (model.attention_type=mla) has an adaptable o, and q "
                 "where model.mla.q_lora_rank=0; its keys and values come from a shared latent")


def _check_mla(cfg: Config) -> None:
    m = cfg.model
    # YaRN is built as DeepSeek applies it (its softmax factor on the latent attention's queries).
    _require(m.rope_scaling.type == "none" or m.attention_type == "mla", "model.rope_scaling.type",
             f"{m.rope_scaling.type} is built for multi-head latent attention (DeepSeek-V2/V3): set "
             "model.attention_type=mla, or model.rope_scaling.type=none")
    if m.attention_type != "mla":
        return
    # Every query head has its own key and value head, all expanded from one shared latent.
    _require(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
             f"{m.num_kv_heads} must equal model.num_heads={m.num_heads} under model.attention_type=mla")
    _require(m.mla.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim",
             f"must be even for rotary embeddings, got {m.mla.qk_rope_head_dim}")
    _require(not m.qk_norm, "model.qk_norm", "has no meaning under model.attention_type=mla (its latents are normed)")
    # jax.nn.dot_product_attention and cuDNN take one head dim: v is padded up to q's (a kernel's
    # `one_head_dim`, model/attn_kernels/registry.py; tests/test_attention_registry.py checks they agree).
    _require(m.attention not in ("dot_product", "cudnn") or m.mla.v_head_dim <= m.mla.qk_head_dim,
             "model.mla.v_head_dim", f"{m.mla.v_head_dim} is wider than qk_nope_head_dim + qk_rope_head_dim="
             f"{m.mla.qk_head_dim}, which model.attention={m.attention} cannot take")


def _check_dist(cfg: Config) -> None:
    d = cfg.dist
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


def _check_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    _require(bool(c.local_dir) or c.local_every == 0, "checkpoint.local_dir",
             f"empty, but checkpoint.local_every={c.local_every} asks for a local tier: set a node-local directory")
    _require(not c.local_dir or c.local_every > 0, "checkpoint.local_every",
             f"0, but checkpoint.local_dir={c.local_dir} asks for a local tier: set the steps between its checkpoints")
    f = cfg.straggler.factor
    _require(f == 0 or f > 1, "straggler.factor", f"must be 0 (off) or above 1, got {f}")
    _require(c.local_every < c.every or not c.local_dir, "checkpoint.local_every",
             f"{c.local_every} is not below checkpoint.every={c.every}: the local tier would save no more often "
             "than the persistent one")


def _check_logical_name(key: str, logical: str) -> None:
    if logical in LOGICAL_AXES:
        return
    guess = closest(logical, LOGICAL_AXES)
    hint = f"did you mean {guess!r}?" if guess else f"the model's names are {', '.join(LOGICAL_AXES)}"
    raise ConfigError(f"{key}: unknown logical name; {hint}")


def _check_sharding(cfg: Config) -> None:
    # The rules tables stay `dict[str, Any]` in the schema: their lines suggest the closest
    # logical name, which a Literal key type would not.
    for table in ("params", "activations"):
        for logical, mesh_axes in getattr(cfg.sharding, table).items():
            _check_logical_name(f"sharding.{table}.{logical}", logical)
            for axis in mesh_axes if isinstance(mesh_axes, list) else [mesh_axes]:
                _require(
                    axis is None or axis in MESH_AXES,
                    f"sharding.{table}.{logical}",
                    f"{axis!r} is not a mesh axis ({', '.join(MESH_AXES)})",
                )


def validate_static(cfg: Config) -> None:
    """Checks that need no devices. Raises ConfigError naming the first bad key."""
    _check_model(cfg)
    _check_mla(cfg)
    _check_data(cfg)
    _check_moe(cfg)
    _check_lora(cfg)
    trackers = cfg.run.trackers
    _require(len(set(trackers)) == len(trackers), "run.trackers", f"names a tracker twice: {trackers}")
    _check_dist(cfg)
    _check_checkpoint(cfg)
    nan_steps(cfg)
    _check_profile(cfg)
    _check_rl(cfg)
    _check_sharding(cfg)
