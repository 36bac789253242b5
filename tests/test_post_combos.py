"""Post-training combinations: LoRA (with dropout) DPO on a mixture of experts, multi-token
prediction under SFT, and DPO with MTP refused.

Anchors: DPO's first step, where the LoRA policy is its reference (B = 0) and the rewards are 0
exactly; the depth-1 MTP weights of a real SFT batch against the NumPy product of the
assistant-token weights; the one-device run for the 8-device layouts.
"""

from __future__ import annotations

import os

import jax
import numpy as np

import trainer
from conftest import ROOT
from data import open_source, process_dataset
from model.loss import model_inputs
from model.mtp import mtp_targets
from trainer.program import abstract_program
from test_post_training import STEPS, column, corpora  # noqa: F401  (corpora: a fixture)
from test_post_training import config as post_config

MOE = ["model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=64", "model.moe.router=softmax_topk",
       "model.moe.capacity_factor=0.0"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,k,v,o]", "model.lora.dropout=0.1"]
DPO_KEYS = ("loss", "reward_margin", "reward_chosen", "reward_rejected", "reward_accuracy")


def config(objective: str, corpora: dict[str, str], run_dir, *extra: str):
    return post_config(objective, corpora, run_dir, "eval.every=0", *extra)


def test_lora_dpo_on_an_expert_parallel_moe_gives_the_one_device_run(corpora, tmp_path):
    """Adapters (under dropout) on the attention of an MoE; the reference is the base itself."""
    def run(name: str, devices: int, *layout: str) -> list[dict]:
        cfg = config("dpo", corpora, tmp_path / name, "optim.lr=3e-2", f"optim.decay_steps={STEPS}", *MOE, *LORA,
                     *layout)
        return trainer.run(cfg, devices=jax.devices()[:devices])

    cfg = config("dpo", corpora, tmp_path / "abstract", *MOE, *LORA, "mesh.data=2", "mesh.expert=2", "mesh.fsdp=2")
    assert abstract_program(cfg).abstract_state().ref_params is None  # no copy: the base with B = 0
    one = run("one", 1, "mesh.data=1")
    other = run("ep", 8, "mesh.data=2", "mesh.expert=2", "mesh.fsdp=2")
    assert column(one, "reward_margin")[0] == 0 and column(one, "reward_chosen")[0] == 0
    assert abs(column(one, "reward_margin")[-1]) > 1e-3  # the policy has left its reference
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(other, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)


def test_dpo_refuses_multi_token_prediction_with_exit_2(corpora, tmp_path, capsys):
    import train

    run_dir = tmp_path / "run"
    assert train.main(["--config", os.path.join(ROOT, "configs", "dpo-tiny.yaml"), f"run.dir={run_dir}",
                       f"data.path={corpora['dpo']}", "model.mtp_depth=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.mtp_depth: 1 with train.objective=dpo"), err
    assert not run_dir.exists()


def test_mtp_under_sft_predicts_assistant_tokens_ahead(corpora):
    """Depth k's target at position i weighs 1 only where the main targets i .. i + k are all
    assistant tokens of one conversation (the main weights, loss mask included)."""
    cfg = config("sft", corpora, "unused")
    batch = process_dataset(open_source(cfg), cfg.train.global_batch, cfg.run.seed, 0, 1)[0]
    b = model_inputs({k: np.asarray(v) for k, v in batch.items()})
    w = np.asarray(b["weights"], np.float64)
    extra = mtp_targets(b["inputs"], b["targets"], b["weights"], 2)
    ahead1 = np.concatenate([w[:, 1:], np.zeros_like(w[:, :1])], axis=1)
    ahead2 = np.concatenate([w[:, 2:], np.zeros_like(w[:, :2])], axis=1)
    np.testing.assert_array_equal(np.asarray(extra["mtp_weights"][0]), w * ahead1)
    np.testing.assert_array_equal(np.asarray(extra["mtp_weights"][1]), w * ahead1 * ahead2)
    assert 0 < np.sum(w * ahead1) < np.sum(w) < w.size  # the loss mask leaves out the prompts


def test_sft_with_mtp_on_8_devices_gives_the_one_device_run(corpora, tmp_path):
    def run(name: str, devices: int, *layout: str) -> list[dict]:
        cfg = config("sft", corpora, tmp_path / name, "optim.lr=1e-2", f"optim.decay_steps={STEPS}",
                     "model.mtp_depth=1", "model.mtp_loss_coef=0.3", *layout)
        return trainer.run(cfg, devices=jax.devices()[:devices])

    one = run("one", 1, "mesh.data=1")
    other = run("eight", 8, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    mtp = column(one, "mtp_loss")
    assert len(mtp) == STEPS and abs(mtp[0] - np.log(264)) < 0.5 and mtp[-1] < mtp[0] - 0.05, mtp
    for key in ("loss", "lm_loss", "mtp_loss", "trained_tokens"):
        np.testing.assert_allclose(column(other, key), column(one, key), rtol=2e-5, err_msg=key)
