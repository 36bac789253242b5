"""SFT and DPO runs end to end on 8 fake CPU devices: each layout gives the one-device run's
losses step by step, a resumed DPO run (its frozen reference restored from the checkpoint) is
bitwise the straight one; anchors: the trained-token counts read from the batches themselves and
DPO's first loss, log 2 (the policy is its reference), with rewards 0."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

import trainer
from configs import load_config
from conftest import ROOT
from data import open_source, process_dataset
from data.examples import dpo_rows, sft_rows, write
from data.prepare import prepare

STEPS = 3
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "optim.warmup_steps=1", "checkpoint.every=100",
          "model.num_layers=2", "model.seq_len=32", "train.global_batch=8"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Prepared SFT and DPO corpora of data.examples rows."""
    root = tmp_path_factory.mktemp("post")
    write(str(root / "sft.jsonl"), sft_rows(64))
    write(str(root / "dpo.jsonl"), dpo_rows(32))
    for objective in ("sft", "dpo"):
        prepare([str(root / f"{objective}.jsonl")], str(root / objective), progress=False, objective=objective)
    return {k: str(root / k) for k in ("sft", "dpo")}


def config(objective: str, corpora: dict[str, str], run_dir, *extra: str):
    return load_config(os.path.join(ROOT, "configs", f"{objective}-tiny.yaml"),
                       [f"run.dir={run_dir}", f"data.path={corpora[objective]}", *COMMON, *extra])


def column(history: list[dict], key: str) -> np.ndarray:
    return np.array([r[key] for r in history if key in r])


@pytest.fixture(scope="module")
def sft_one(corpora, tmp_path_factory) -> list[dict]:
    cfg = config("sft", corpora, tmp_path_factory.mktemp("sft") / "run", "mesh.data=1", "eval.every=0")
    return trainer.run(cfg, devices=jax.devices()[:1])


def test_sft_trains_the_assistant_tokens_the_batches_hold(corpora, tmp_path, sft_one):
    cfg = config("sft", corpora, tmp_path / "run")
    ds = process_dataset(open_source(cfg, cfg.train.objective), cfg.train.global_batch, cfg.run.seed, 0, 1)
    counts = []
    for step in range(STEPS):
        b = ds[step]
        s = b["segment_ids"]
        counts.append(int(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0) & (b["loss_mask"][:, 1:] == 1)).sum()))
    np.testing.assert_array_equal(column(sft_one, "trained_tokens"), counts)
    assert 0 < max(counts) < cfg.train.global_batch * cfg.model.seq_len / 2  # most tokens are not trained


SFT_LAYOUTS = {"fsdp=2,tensor=4": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"],
               "pipeline=2 (1f1b),data=4": ["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b"]}


@pytest.fixture(scope="module")
def sft_fsdp_tensor(corpora, tmp_path_factory) -> list[dict]:
    cfg = config("sft", corpora, tmp_path_factory.mktemp("sft") / "run", "eval.every=0", *SFT_LAYOUTS["fsdp=2,tensor=4"])
    return trainer.run(cfg)


@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_on_8_devices_gives_the_one_device_losses(corpora, tmp_path, sft_one, sft_fsdp_tensor, layout):
    if layout == "fsdp=2,tensor=4":
        history = sft_fsdp_tensor
    else:
        history = trainer.run(config("sft", corpora, tmp_path / "run", "eval.every=0", *SFT_LAYOUTS[layout]))
    assert np.ptp(column(sft_one, "loss")) > 0.01  # the runs train
    np.testing.assert_allclose(column(history, "loss"), column(sft_one, "loss"), rtol=2e-5)
    np.testing.assert_array_equal(column(history, "trained_tokens"), column(sft_one, "trained_tokens"))


def test_sft_resume_is_bitwise_exact(corpora, tmp_path, capsys, sft_fsdp_tensor):
    common = ["eval.every=0", f"optim.decay_steps={STEPS}", "checkpoint.every=2", *SFT_LAYOUTS["fsdp=2,tensor=4"]]
    first = trainer.run(config("sft", corpora, tmp_path / "run", *common, "train.steps=2"))
    second = trainer.run(config("sft", corpora, tmp_path / "run", *common))
    assert "resumed from step 2" in capsys.readouterr().out
    for key in ("loss", "trained_tokens", "grad_norm"):
        np.testing.assert_array_equal(column(first + second, key), column(sft_fsdp_tensor, key), err_msg=key)


DPO_LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
DPO_KEYS = ("loss", "reward_margin", "reward_chosen", "reward_rejected", "reward_accuracy")


@pytest.fixture(scope="module")
def dpo_runs(corpora, tmp_path_factory) -> dict[str, list[dict]]:
    """The DPO run on one device and on DPO_LAYOUT (a learning rate that moves the rewards in 3 steps)."""
    out = {}
    for name, layout in (("one", ["mesh.data=1"]), ("eight", DPO_LAYOUT)):
        cfg = config("dpo", corpora, tmp_path_factory.mktemp("dpo") / "run", "optim.lr=1e-2", *layout)
        out[name] = trainer.run(cfg, devices=jax.devices()[:1] if name == "one" else None)
    return out


def test_dpo_starts_at_log_2_and_8_devices_give_the_one_device_run(dpo_runs):
    one, eight = dpo_runs["one"], dpo_runs["eight"]
    assert column(one, "loss")[0] == pytest.approx(math.log(2), abs=1e-6)
    assert column(one, "reward_margin")[0] == 0 and column(one, "reward_chosen")[0] == 0
    assert abs(column(one, "reward_margin")[-1]) > 1e-3  # the policy has left its reference
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(eight, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)


def test_dpo_resume_is_bitwise_exact(corpora, tmp_path, capsys, dpo_runs):
    common = ["optim.lr=1e-2", f"optim.decay_steps={STEPS}", "checkpoint.every=2", *DPO_LAYOUT]
    first = trainer.run(config("dpo", corpora, tmp_path / "run", *common, "train.steps=2"))
    second = trainer.run(config("dpo", corpora, tmp_path / "run", *common))
    assert "resumed from step 2" in capsys.readouterr().out
    for key in DPO_KEYS:
        np.testing.assert_array_equal(column(first + second, key), column(dpo_runs["eight"], key), err_msg=key)


def test_dpo_refuses_a_schedule_with_its_own_lm_gradients(corpora, tmp_path):
    from configs import ConfigError

    cfg = config("dpo", corpora, tmp_path / "run", "mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b")
    with pytest.raises(ConfigError, match="^pipeline.schedule=1f1b computes the language-model loss itself; "
                                          "train.objective=dpo pipelines with pipeline.schedule=gpipe$"):
        trainer.run(cfg)
    assert not os.path.exists(tmp_path / "run")


def test_dpo_under_a_gpipe_pipeline_gives_the_one_device_run(corpora, tmp_path, dpo_runs):
    history = trainer.run(config("dpo", corpora, tmp_path / "run", "optim.lr=1e-2", "mesh.pipeline=2", "mesh.data=4"))
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(history, key), column(dpo_runs["one"], key), rtol=2e-5, atol=1e-6,
                                   err_msg=key)


def test_dpo_accumulation_equals_one_big_batch(corpora, tmp_path, dpo_runs):
    """8 pairs in 2 micro-batches of 4 (the reference's log-probs computed per micro-batch too)."""
    history = trainer.run(config("dpo", corpora, tmp_path / "run", "optim.lr=1e-2", "train.grad_accum=2", *DPO_LAYOUT))
    for key in (*DPO_KEYS, "grad_norm"):
        np.testing.assert_allclose(column(history, key), column(dpo_runs["eight"], key), rtol=2e-5, atol=1e-6,
                                   err_msg=key)
