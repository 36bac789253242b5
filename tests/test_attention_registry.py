"""The attention-kernel registry (model/attn_kernels) agrees with the config and is what the checks,
the trainer, the schedules and the planner ask: every `model.attention` choice has one registered
kernel and every kernel is a choice; a kernel's facts give the one-line ConfigErrors (no sequence
split, tiles, platforms) and agree with the two rules configs/validate.py keeps (it cannot import
the model); the mesh-bound forms and the layers' call come from the kernel. No compile heavier
than one tiny attention."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import pytest

import pipeline
from bench.procs import TINY
from configs import ConfigError, load_config
from configs.schema import ATTENTION_KERNELS
from model import attn_kernels
from model import TokenInputs
from model.attention import attend, xla_attention
from trainer.checks import check_devices
from trainer.kernels import attention_kernel
from trainer.layout import plan_layout

SPLIT = ["mesh.data=4", "mesh.context=2", "model.seq_len=128"]
MLA_WIDE_V = ["model.attention_type=mla", "model.num_kv_heads=16", "model.mla.qk_rope_head_dim=4",
              "model.mla.qk_nope_head_dim=4", "model.mla.v_head_dim=16"]


def _refusal(fn: Callable[..., object], *args: object) -> str | None:
    """The ConfigError `fn(*args)` raises (None: it passes); the message is one line."""
    try:
        fn(*args)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    return None


def test_every_attention_choice_has_one_registered_kernel_and_every_kernel_is_a_choice() -> None:
    assert attn_kernels.names() == ATTENTION_KERNELS
    assert [attn_kernels.get(name).name for name in ATTENTION_KERNELS] == list(ATTENTION_KERNELS)
    assert _refusal(attn_kernels.get, "flash") == "model.attention: 'flash' is not one of " + ", ".join(ATTENTION_KERNELS)


@pytest.mark.parametrize("name", ATTENTION_KERNELS)
def test_a_kernel_that_cannot_take_a_sequence_split_is_refused_in_one_line(name: str) -> None:
    why = _refusal(plan_layout, load_config(TINY, [*SPLIT, f"model.attention={name}"]), 8)
    assert attn_kernels.get(name).splits_sequence == (name == "xla")  # the one kernel that gathers or rings
    if name == "xla":
        assert why is None
    elif name in ("cudnn", "splash"):  # only as the ring's blocks (tests/test_fused_ring.py)
        assert why == (f"model.attention={name} takes a sequence split (mesh.context=2) only as ring attention's "
                       "blocks: set context.strategy=ring, or model.attention=xla for the all-gather strategy")
    else:
        assert why == (f"model.attention={name}: the kernel cannot take a sequence split (mesh.context=2); "
                       "use model.attention=xla with context.strategy=allgather or ring")


@pytest.mark.parametrize("name", ATTENTION_KERNELS)
def test_the_length_must_fill_the_kernels_tiles(name: str) -> None:
    tile = attn_kernels.get(name).tile
    why = _refusal(plan_layout, load_config(TINY, ["model.seq_len=64", f"model.attention={name}"]), 8)
    assert why == (None if 64 % tile == 0 else
                   f"model.seq_len=64 is not a multiple of {tile}, the tile of model.attention={name}")
    assert _refusal(plan_layout, load_config(TINY, [f"model.seq_len={tile * 2}", f"model.attention={name}"]), 8) is None


@pytest.mark.parametrize("name", ATTENTION_KERNELS)
def test_the_platforms_a_kernel_names_are_the_only_ones_that_run_it(name: str) -> None:
    kernel = attn_kernels.get(name)
    why = _refusal(check_devices, load_config(TINY, [f"model.attention={name}"]), jax.devices())
    assert (why is None) == (not kernel.platforms or "cpu" in kernel.platforms), why
    if why:
        assert why.startswith(f"model.attention={name} runs on gpu devices only, not on cpu: choose one of ")


@pytest.mark.parametrize("name", ATTENTION_KERNELS)
def test_the_kernels_facts_agree_with_the_rules_configs_validate_keeps(name: str) -> None:
    kernel = attn_kernels.get(name)
    chunked = _refusal(load_config, TINY, [f"model.attention={name}", "model.attention_chunk=8"])
    assert (chunked is None) == kernel.chunks, chunked
    wide_v = _refusal(load_config, TINY, [f"model.attention={name}", *MLA_WIDE_V])
    assert (wide_v is None) == (not kernel.one_head_dim), wide_v


def test_the_mesh_bound_forms_and_the_schedules_that_refuse_them() -> None:
    """xla is bound (the ring) under context.strategy=ring only, splash always (per device);
    1F1B refuses a kernel that is always per device, by its name."""
    def bound(*overrides: str) -> bool:
        cfg = load_config(TINY, ["mesh.data=8", "model.seq_len=128", *overrides])
        return attention_kernel(cfg, plan_layout(cfg, 8), "cpu") is not None

    assert not bound() and bound("context.strategy=ring") and bound("model.attention=splash")
    assert not bound("model.attention=dot_product") and not bound("model.attention=dot_product", "context.strategy=ring")
    cfg = load_config(TINY, ["mesh.pipeline=2", "mesh.data=4", "model.seq_len=128", "model.attention=splash",
                             "pipeline.schedule=1f1b"])
    assert _refusal(pipeline.get("1f1b").check, cfg, 2, 1, 2) == (
        "pipeline.schedule=1f1b does not yet run the sequence split or sharded attention that model.attention=splash "
        "needs; use pipeline.schedule=gpipe")


@pytest.mark.parametrize("name, target, stand_in", [
    ("xla", None, None), ("dot_product", "tpu", None), ("cudnn", "cuda", None), ("cudnn", "tpu", "xla"),
    ("cudnn", None, "xla"), ("splash", "tpu", None), ("splash", "cuda", "cudnn"), ("splash", None, "xla")])
def test_the_planner_compiles_a_stand_in_where_the_target_cannot_run_the_kernel(name: str, target: str | None,
                                                                               stand_in: str | None) -> None:
    planned = attn_kernels.get(name).planned_as(target)
    assert (planned and planned[0]) == stand_in
    if planned:
        assert planned[1].startswith(f"model.attention={name} ")


@pytest.mark.parametrize("name", ["xla", "dot_product"])
def test_the_layers_call_runs_the_named_kernel(name: str) -> None:
    """`attend` with a kernel's name runs that kernel (the two that run on CPU without Pallas):
    both equal the reference, with a value head narrower than the query head too (padded for
    dot_product, which takes one head dim)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    b, t, h, kvh, d = 2, 8, 4, 2, 8
    q, k = jax.random.normal(kq, (b, t, h, d)), jax.random.normal(kk, (b, t, kvh, d))
    pos = jax.numpy.broadcast_to(jax.numpy.arange(t), (b, t))
    for dv in (d, d // 2):
        v = jax.random.normal(kv, (b, t, kvh, dv))
        ours = jax.jit(lambda q, k, v: attend(q, k, v, TokenInputs(pos), impl=name))(q, k, v)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(xla_attention(q, k, v, None, pos)), rtol=2e-5, atol=2e-5)
