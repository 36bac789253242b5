"""The kernels a run binds into the model (`model.kernels.Kernels`), built from its layout and
the devices' platform: attention that must see the mesh (the registered kernel's mesh-bound form,
model/attn_kernels/), the experts' dispatch and grouped matmul, and the FSDP embedding lookup.
`trainer.compute.build_compute` puts them in the run's `Compute`.
"""

from __future__ import annotations

import functools
import math

import jax

from configs import Config
from model import attn_kernels
from model.kernels import AttentionFn, DispatchFn, Kernels
from model.moe import GroupedMatmul, local_dispatch, megablox_matmul
from sharding import mesh_axes
from sharding.context import mesh_binders
from sharding.experts import expert_parallel
from sharding.lookup import traded_lookup
from trainer.checks import megablox_misfit
from trainer.layout import Layout


def bound_kernels(cfg: Config, layout: Layout, platform: str) -> Kernels:
    """What replaces the model's own kernels on `layout` over devices of `platform`."""
    return Kernels(attention=attention_kernel(cfg, layout, platform),
                   dispatch=expert_dispatcher(layout, grouped_matmul(cfg, layout, platform),
                                              ragged_exchange(cfg, platform)),
                   lookup=traded_lookup(layout.param_rules, layout.act_rules, layout.sizes))


def attention_notes(cfg: Config) -> list[str]:
    """What the run's attention falls back to, said at start (train.py) and in plans: the
    kernel's own notes (model/attn_kernels)."""
    return attn_kernels.get(cfg.model.attention).notes(cfg)


def attention_kernel(cfg: Config, layout: Layout, platform: str) -> AttentionFn | None:
    """The attention kernel that must see the mesh (None: the model's own), as the registered
    kernel of `model.attention` builds it from the layout's shard_map wrappers: ring attention
    for xla under context.strategy=ring, or splash per device (the TPU kernel on "tpu",
    interpreted elsewhere)."""
    binders = mesh_binders(layout.stage_rules, layout.sizes["context"])
    return attn_kernels.get(cfg.model.attention).mesh_bound(cfg, platform, binders)


def grouped_matmul(cfg: Config, layout: Layout, platform: str) -> GroupedMatmul:
    """The dropless experts' grouped matmul on devices of `platform` (`model.moe.grouped_matmul`):
    megablox is the TPU kernel on "tpu" and interpreted elsewhere (tests; trainer/checks.py
    refuses it on GPUs); auto takes it on TPU where it fits, else jax.lax.ragged_dot."""
    choice = cfg.model.moe.grouped_matmul
    if choice == "auto":
        fits = platform == "tpu" and megablox_misfit(cfg, layout.sizes, layout.stage_rules) is None
        choice = "megablox" if fits else "ragged_dot"
    if choice == "ragged_dot" or not cfg.model.moe.enabled:
        return jax.lax.ragged_dot
    return functools.partial(megablox_matmul, interpret=platform != "tpu")


def ragged_exchange(cfg: Config, platform: str) -> str:
    """How expert parallelism moves routed rows on devices of `platform` (`model.moe.dispatch`):
    "native" (only the routed rows, the platform's ragged all-to-all: TPU and GPU), "emulated"
    (the same code, its exchange built from a dense all-to-all: XLA:CPU has no ragged one) or ""
    (buffers padded to the worst case; auto's choice on CPU)."""
    choice = cfg.model.moe.dispatch
    if choice == "dense" or (choice == "auto" and platform == "cpu"):
        return ""
    return "emulated" if platform == "cpu" else "native"


def expert_dispatcher(layout: Layout, matmul: GroupedMatmul = jax.lax.ragged_dot,
                      ragged: str = "") -> DispatchFn | None:
    """The MoE dispatch of a multi-device layout: each device routes its own tokens (over
    `expert` when mesh.expert > 1; with one expert shard the all-to-alls are no-ops and the
    experts' weights are gathered, as FSDP gathers a dense MLP's). Left to the partitioner, the
    sort of the assignments would run over the global batch. On one device, or when the rules
    give the `expert` dim no mesh axis, every expert runs on the one device (None with
    ragged_dot, the model's default). `matmul`: the dropless experts' grouped matmul; `ragged`:
    `ragged_exchange`'s choice (it matters only under mesh.expert > 1)."""
    if math.prod(layout.sizes.values()) == 1 or not mesh_axes("expert", layout.stage_rules):
        return None if matmul is jax.lax.ragged_dot else functools.partial(local_dispatch, matmul=matmul)
    return expert_parallel(layout.stage_rules, layout.sizes["expert"], matmul,
                           ragged if layout.sizes["expert"] > 1 else "")
