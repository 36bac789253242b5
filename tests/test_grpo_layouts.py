"""GRPO updates on every layout, given the same rollouts: one rollout batch (completions drawn
once on one device, fixed rewards) trained twice by the real compiled step on data x fsdp x
tensor and on an expert-parallel mixture of experts gives the one-device losses, metrics and
parameters; each layout takes its old and reference log-probs from its own forward, as a run
does. And LoRA-GRPO: only the adapters train, and the KL reference is the frozen base (the
adapters switched off), with no copy of the weights held."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import pytest

from configs import load_config
from conftest import ROOT
from model.lora import split, switched_off
from model.rollout import Rollout
from trainer import abstract_program
from trainer.objectives.dpo import reference_params
from trainer.state import init_state

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# 4 prompts x 4 completions of at most 4 tokens: rows of 16 tokens (model.seq_len). optim.eps=1
# makes AdamW's first updates follow the gradients linearly: at 1e-8 an element whose gradient is
# near zero moves by about the whole rate either way on a rounding (1e-5 apart across layouts), so
# the parameters would not show what the layouts' gradients agree to.
COMMON = ["train.objective=grpo", "data.source=prepared", "data.path=no-corpus-read", "train.global_batch=4", "model.num_layers=2",
          "model.seq_len=16", "rl.group_size=4", "rl.max_new_tokens=4", "rl.kl_coef=0.1", "rl.temperature=1.0",
          "optim.warmup_steps=1", "optim.decay_steps=4", "optim.lr=0.1", "optim.eps=1.0", "mesh.data=1"]
MOE = ["model.moe.num_experts=8", "model.moe.experts_per_token=2", "model.moe.d_ff=32"]
LORA = ["model.lora.rank=4"]
PROMPTS = ["1+2=", "37+48=", "9+90=", "55+5="]
METRICS = ("loss", "grad_norm", "pg_loss", "kl", "ratio", "clip_fraction", "entropy")


def program_of(overrides: list[str], devices: int) -> Any:  # a trainer Program
    return abstract_program(load_config(TINY, [*COMMON, *overrides]), jax.devices()[:devices])


def stage_of(program: Any) -> Any:  # the objective's RolloutStage
    return program.spec.objective.stage(program.spec.model.graphdef, program.compute)


_INITIAL: dict[str, Any] = {}  # each model's seed-0 state, on the host


def initial_state(program: Any) -> Any:
    """The model's seed-0 train state, drawn once on one device and placed as `program` shards it."""
    key = repr(program.spec.model.shapes)
    if key not in _INITIAL:
        one = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), program.state_sh)
        _INITIAL[key] = jax.tree.map(np.asarray, init_state(program.spec.cfg.model, program.tx, 0, one))
    return jax.device_put(_INITIAL[key], program.state_sh)


@pytest.fixture(scope="module")
def rollout() -> tuple[Rollout, np.ndarray]:
    """One rollout batch drawn by the tiny dense model on one device, on the host, with rewards
    that differ within each group."""
    program = program_of([], 1)
    stage = stage_of(program)
    tokens = [list(p.encode()) for p in PROMPTS]
    length = program.spec.cfg.model.seq_len + 1 - program.spec.cfg.rl.max_new_tokens
    prompts = np.array([[stage.tokenizer.eod_id] * (length - len(t)) + t for t in tokens], np.int32)
    pad = np.array([length - len(t) for t in tokens], np.int32)
    r = stage.grpo.sample(initial_state(program).params, prompts, pad, jax.random.key(3))
    rewards = np.random.default_rng(1).normal(size=len(PROMPTS) * 4).astype(np.float32)
    return jax.tree.map(np.asarray, r), rewards


def two_updates(program: Any, r: Rollout, rewards: np.ndarray, nudge: float = 0.0) -> dict:
    """The compiled step's metrics of two updates on the rollout batch (the second with ratios off
    1 and a KL), and the parameters after them, on the host. `nudge`: each parameter scaled by
    1 +- nudge (random signs) between the updates."""
    state = initial_state(program)
    stage = stage_of(program)
    with program.tracing():
        ref = reference_params(state.params, state.ref_params)
        batch = jax.device_put(stage.grpo.training_batch(state.params, ref, r, rewards), program.batch_sh)
    step, _ = program.compile(state)
    metrics = []
    signs = np.random.default_rng(0)
    for _ in range(2):
        state, m = step(state, batch)
        metrics.append({k: float(m[k]) for k in METRICS})
        if nudge:
            nudged = jax.tree.map(lambda a: np.asarray(a) * (1 + nudge * signs.choice([-1, 1], np.shape(a))).astype(a.dtype),
                                  state.params)
            state = state.replace(params=jax.device_put(nudged, program.state_sh.params))
    return {"metrics": metrics, "params": jax.tree.map(np.asarray, state.params), "batch": batch}


@pytest.fixture(scope="module")
def dense_one(rollout: tuple[Rollout, np.ndarray]) -> dict:
    return two_updates(program_of([], 1), *rollout)


@pytest.fixture(scope="module")
def moe_one(rollout: tuple[Rollout, np.ndarray]) -> dict:
    return two_updates(program_of(MOE, 1), *rollout)


def _compare(got: dict, want: dict) -> None:
    for step, (a, b) in enumerate(zip(got["metrics"], want["metrics"], strict=True), 1):
        for key in METRICS:
            np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=1e-7, err_msg=f"update {step} {key}")
    flat = jax.tree_util.tree_leaves_with_path(want["params"])
    for (path, w), g in zip(flat, jax.tree.leaves(got["params"]), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_the_updates_are_real(dense_one):
    first, second = dense_one["metrics"]
    # The first update trains on its own samples (ratio 1, no KL); the second has moved off them.
    assert first["ratio"] == 1.0 and first["kl"] == 0.0 and first["grad_norm"] > 0
    assert second["ratio"] != 1.0 and second["kl"] > 0 and second["loss"] != first["loss"]


def test_data_fsdp_tensor_updates_as_one_device(rollout, dense_one):
    program = program_of(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 8)
    assert program.spec.layout.sizes["tensor"] == 2 and program.spec.layout.sizes["fsdp"] == 2
    _compare(two_updates(program, *rollout), dense_one)


def test_the_moe_comparison_is_not_on_a_routing_tie(rollout, moe_one):
    """A layout sums in its own order, which moves the parameters by about an ulp. Where a token's
    router scores nearly tie for the top k, that flips the token's experts: the layouts would then
    agree or not by chance, whatever their code. The one-device run, nudged by an ulp between its
    updates one way and the other (a tie is crossed from one side only), gives its own second update."""
    for nudge in (1.2e-7, -1.2e-7):
        _compare(two_updates(program_of(MOE, 1), *rollout, nudge=nudge), moe_one)


def test_an_expert_parallel_moe_updates_as_one_device(rollout, moe_one):
    program = program_of([*MOE, "mesh.expert=2", "mesh.data=2"], 4)
    assert program.spec.layout.sizes["expert"] == 2
    got = two_updates(program, *rollout)
    assert moe_one["metrics"][1]["kl"] > 0
    _compare(got, moe_one)


def test_lora_grpo_trains_the_adapters_against_the_frozen_base(rollout):
    program = program_of(LORA, 1)
    start = initial_state(program)
    # No copy of the weights is held: the reference is the policy's base, adapters switched off.
    assert start.ref_params is None
    before = jax.tree.map(np.asarray, start.params)
    got = two_updates(program, *rollout)
    (adapters, base), (adapters0, base0) = split(got["params"]), split(before)
    jax.tree.map(np.testing.assert_array_equal, base, base0)  # the base is frozen, bit for bit
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(adapters0)))
    assert got["metrics"][0]["kl"] == 0.0 and got["metrics"][1]["kl"] > 0
    # A rollout batch made by the trained policy: its reference log-probs are the base's, exactly,
    # and no longer the policy's.
    stage = stage_of(program)
    params = jax.device_put(got["params"], program.state_sh.params)
    batch = stage.grpo.training_batch(params, reference_params(params, None), *rollout)
    base_logps = stage.grpo.logps(jax.device_put(switched_off(before), program.state_sh.params),
                                   {k: batch[k] for k in ("inputs", "targets", "weights")})
    np.testing.assert_array_equal(batch["ref_logps"], base_logps)
    assert not np.array_equal(batch["ref_logps"], batch["old_logps"])
