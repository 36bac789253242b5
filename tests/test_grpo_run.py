"""`train.objective=grpo` end to end on the toy addition task (data/addition.py), a tiny model on
2 fake CPU devices: the run samples, scores and updates each step, logs the rollout metrics and
the held-out exact-match accuracy, trains `rl.updates_per_rollout` steps on one rollout batch,
resumes bitwise at and between rollout batches, and bad GRPO input stops with one line before
anything is compiled."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterator

import jax
import numpy as np
import pytest

import train
import trainer
from bench.procs import two_processes
from configs import ConfigError, load_config
from conftest import ROOT
from data.addition import addition_rows, write
from data.prepare import prepare
from trainer.checkpoint import check_resumable
from trainer.rewards import RewardError

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
COMMON = ["train.objective=grpo", "data.source=prepared", "train.steps=4", "train.log_every=1",
          "optim.warmup_steps=1", "checkpoint.every=100", "eval.every=2", "eval.batches=1", "model.num_layers=2",
          "model.seq_len=16", "train.global_batch=4", "mesh.data=2", "rl.group_size=4", "rl.max_new_tokens=4",
          "rl.updates_per_rollout=2", "rl.kl_coef=0.1", "optim.decay_steps=4"]  # a resumed run keeps the horizon


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("addition")
    write(str(root / "rl.jsonl"), addition_rows()[:64])
    prepare([str(root / "rl.jsonl")], str(root / "rl"), progress=False, objective="rl", eval_fraction=0.2)
    return str(root / "rl")


# A reward the untrained model's samples earn unevenly (exact_match would score them all 0 and
# teach nothing): exact match, plus a little per lower-case letter, by path as a user's would be.
REWARD = "def letters(prompt, completion, example):\n    return 0.1 * sum('a' <= c <= 'z' for c in completion)\n"
# A reward that fails in the second rollout batch (past the 16 completions of the first).
FLAKY = ("calls = 0\n\ndef flaky(prompt, completion, example):\n    global calls\n    calls += 1\n"
         "    if calls > 16:\n        raise RuntimeError('scorer down')\n    return 0.0\n")


@pytest.fixture(scope="module")
def grpo_run(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., list[dict]]]:
    """run(run_dir, *overrides) -> the history of a GRPO run of COMMON on 2 devices."""
    root = tmp_path_factory.mktemp("grpo")
    (root / "grpo_run_reward.py").write_text(REWARD)
    (root / "grpo_flaky_reward.py").write_text(FLAKY)
    sys.path.insert(0, str(root))

    def run(run_dir: str | os.PathLike, *extra: str, devices: int = 2) -> list[dict]:
        cfg = load_config(TINY, [f"run.dir={run_dir}", f"data.path={corpus}", *COMMON,
                                 "rl.reward=exact_match,grpo_run_reward:letters", *extra])
        return trainer.run(cfg, devices=jax.devices()[:devices])

    yield run
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def history(grpo_run: Callable[..., list[dict]], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return grpo_run(run_dir), str(run_dir)


def test_a_grpo_run_samples_scores_and_updates(history):
    records, run_dir = history
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert np.isfinite(r["loss"]) and 0 <= r["no_spread_groups"] <= 1 and 0 < r["completion_length"] <= 4
        assert r["logp_gap_max"] < 1e-4 and r["rollout_tokens_per_s"] > 0 and r["entropy"] > 0
    # The first update trains on the policy's own samples: every ratio exactly 1, no KL yet; the
    # rewards differ within some groups, so it has a gradient.
    assert steps[0]["ratio"] == 1.0 and steps[0]["kl"] == 0.0 and steps[0]["clip_fraction"] == 0.0
    assert steps[0]["no_spread_groups"] < 1 and steps[0]["reward_std"] > 0 and steps[0]["grad_norm"] > 0
    # rl.updates_per_rollout=2: steps 1 and 2 train on one rollout batch, 3 and 4 on the next.
    assert steps[0]["reward_mean"] == steps[1]["reward_mean"] and steps[0]["rollout_s"] == steps[1]["rollout_s"]
    assert steps[1]["rollout_s"] != steps[2]["rollout_s"]
    evals = [r for r in records if "eval_accuracy" in r]
    # Measured before the first update too (step 0), then at eval.every and the last step.
    assert [r["step"] for r in evals] == [0, 2, 4] and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert any("eval_accuracy" in json.loads(line) for line in f)
    # Goodput counts the rollouts (sampling, rewards, old log-probs) apart from the updates.
    with open(os.path.join(run_dir, "summary.json")) as f:
        seconds = json.load(f)["invocations"][0]["seconds"]
    assert seconds["rollout"] > 0 and seconds["productive"] > 0


def test_a_rollout_starts_once_the_update_before_it_has_finished(grpo_run, tmp_path):
    """Each rollout samples from the state the previous update computes (dispatched
    asynchronously): the loop waits for that update before the rollout's goodput phase opens, so
    the update's time is counted as the steps' and the rollout's `rollout_s` holds its own time
    only. Seen at the stage: every rollout finds its parameters computed."""
    from trainer.objectives.grpo import RolloutStage

    found: dict[int, bool] = {}
    made = RolloutStage.__call__

    def watched(stage: RolloutStage, state, next_batch, step: int):
        if stage.makes_batch(step):  # a new rollout batch (updates_per_rollout=1: every step)
            found[step] = all(leaf.is_ready() for leaf in jax.tree.leaves(state.params))
        return made(stage, state, next_batch, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RolloutStage, "__call__", watched)
        grpo_run(tmp_path / "run", "rl.updates_per_rollout=1", "eval.every=0", "train.log_every=100",
                 "train.steps=4")
    assert found == {1: True, 2: True, 3: True, 4: True}, found


def test_a_run_whose_groups_never_spread_says_so_once(grpo_run, tmp_path, capfd):
    """The untrained model never earns exact_match: every group scores 0 alike and nothing is
    learned. After FLAT_ROLLOUTS such rollout batches in a row the run says so, once."""
    from trainer.objectives.grpo import FLAT_ROLLOUTS

    capfd.readouterr()
    records = grpo_run(tmp_path / "run", "rl.reward=exact_match", "rl.updates_per_rollout=1", "eval.every=0",
                       f"train.steps={FLAT_ROLLOUTS + 2}")
    assert {r["no_spread_groups"] for r in records if "loss" in r} == {1.0}
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert said == [f"warning: step {FLAT_ROLLOUTS}: in each of the last {FLAT_ROLLOUTS} rollout batches every "
                    "group's completions scored alike (reward 0.000), so the updates learn nothing; a larger "
                    "rl.group_size, a lower optim.lr or a reward with partial credit gives groups spread"], said


def test_data_parallel_samples_and_updates_as_one_device(grpo_run, history, tmp_path):
    """The 2-device run (data=2) draws the one-device run's completions and makes its updates
    (bench/grpo_layouts.py does the same for data x fsdp x tensor on 8 devices; test_grpo_layouts
    compares the updates of more layouts given the same rollouts)."""
    sharded = [r for r in history[0] if "loss" in r]
    one = [r for r in grpo_run(tmp_path / "run", "mesh.data=1", devices=1) if "loss" in r]
    for a, b in zip(one, sharded, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"]
        for key in ("loss", "grad_norm", "kl", "entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-7, err_msg=f"step {a['step']} {key}")


def test_a_run_resumed_at_a_rollout_boundary_is_bitwise_the_straight_one(grpo_run, history, tmp_path):
    straight = {r["step"]: r for r in history[0] if "loss" in r}
    grpo_run(tmp_path / "run", "train.steps=2")
    resumed = {r["step"]: r for r in grpo_run(tmp_path / "run") if "loss" in r}
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # the same draw (the step's key), prompts (the data position) and update
        for key in ("loss", "grad_norm", "reward_mean", "kl", "ratio"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_a_run_resumed_between_the_updates_of_a_rollout_batch_is_bitwise_the_straight_one(grpo_run, history,
                                                                                          tmp_path):
    straight = {r["step"]: r for r in history[0] if "loss" in r}
    # Its last step saves: after the first of the two updates of the first rollout batch.
    first = {r["step"]: r for r in grpo_run(tmp_path / "run", "train.steps=1") if "loss" in r}
    resumed = {r["step"]: r for r in grpo_run(tmp_path / "run") if "loss" in r}
    assert sorted(resumed) == [2, 3, 4]
    # Step 2 trains on the batch the checkpoint held (the weights that sampled it are gone), with
    # its rollout's metrics, timings too; step 3 samples the next prompts (the data position).
    assert resumed[2]["rollout_s"] == first[1]["rollout_s"]
    for step in (2, 3, 4):
        for key in ("loss", "grad_norm", "reward_mean", "kl", "ratio", "entropy"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_a_two_process_grpo_job_is_refused_before_compiling(corpus, tmp_path):
    """Rollouts run on one process for now: both processes of a 2 x 4 job say so in one line once
    they have met, exit 2, and nothing is written."""
    run_dir = tmp_path / "run"
    procs = two_processes("--config", TINY, f"run.dir={run_dir}", f"data.path={corpus}", *COMMON, "mesh.data=-1",
                          "train.global_batch=8", "rl.reward=exact_match", heartbeat=5)
    codes = [p.finish(120) for p in procs]
    for p in procs:
        assert "error: dist.num_processes: 2 processes with train.objective=grpo: rollouts run on one process" in p.output
        assert "compiled" not in p.output and "Traceback" not in p.output, p.output
    assert codes == [2, 2] and not run_dir.exists(), [p.output for p in procs]


def test_a_resumed_run_that_drops_or_adds_the_reference_is_refused_naming_the_key(corpus, history):
    """rl.kl_coef=0 holds no frozen copy of the starting weights, the run's checkpoints do (0.1):
    one line naming the key, not a checkpoint that reads as unreadable. DPO's LoRA switch likewise."""
    def cfg(*extra: str):
        return load_config(TINY, [f"run.dir={history[1]}", f"data.path={corpus}", *COMMON,
                                  "rl.reward=exact_match,grpo_run_reward:letters", *extra])

    check_resumable(cfg())
    with pytest.raises(ConfigError, match=r"^rl.kl_coef=0.0 drops the frozen copy of the starting weights, which the "
                                          r"checkpoints of run.dir=.* hold; resume with rl.kl_coef=0.1 or use a new"):
        check_resumable(cfg("rl.kl_coef=0"))
    with pytest.raises(ConfigError, match=r"^train.objective='lm' drops the frozen copy"):
        check_resumable(cfg("train.objective=lm"))


def test_a_failing_reward_stops_the_run_before_the_update_with_the_checkpoint_intact(grpo_run, tmp_path):
    with pytest.raises(RewardError) as err:
        grpo_run(tmp_path / "run", "rl.reward=grpo_flaky_reward:flaky", "checkpoint.every=2")
    assert str(err.value).startswith("rl.reward: grpo_flaky_reward:flaky raised RuntimeError: scorer down on prompt ")
    assert "\n" not in str(err.value)
    # Step 3's rollout failed: the checkpoint of step 2 is the newest, and no step 3 was logged.
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert max(json.loads(line)["step"] for line in f) == 2


def test_the_planner_compiles_the_rollout_decoding_beside_the_step(corpus):
    from planner.compiled import compiled_stats
    from trainer.program import abstract_program

    cfg = load_config(TINY, [f"data.path={corpus}", *COMMON, "rl.max_new_tokens=6"])
    side = compiled_stats(abstract_program(cfg, jax.devices()[:2]).compile_side())
    # Its temporaries hold the KV cache: layers x rows per device (4 prompts x 4 completions over
    # data=2) x (prompt room 11 + 6 new) slots x kv heads x head dim, keys and values, float32.
    m = cfg.model
    cache = m.num_layers * 8 * 17 * m.num_kv_heads * m.resolved_head_dim * 2 * 4
    assert side["temp_bytes"] >= cache and side["argument_bytes"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["rl.max_new_tokens=16"], "rl.max_new_tokens: 16 leaves no room for a prompt in model.seq_len=16"),
    (["rl.reward=exact_match,nowhere_xyz:fn"], "rl.reward: cannot import 'nowhere_xyz:fn'"),
    (["data.packing=document"], "data.packing: train.objective=grpo pads each prompt"),
    (["mesh.pipeline=2"], "mesh.pipeline: 2 with train.objective=grpo: rollouts decode with the whole layer stack"),
    (["model.lora.rank=4", "model.lora.dropout=0.1"], "model.lora.dropout: train.objective=grpo compares log-probs"),
    (["checkpoint.local_dir={tmp}/local", "checkpoint.local_every=3"],
     "checkpoint.local_every: 3 is not a multiple of rl.updates_per_rollout=2"),
])
def test_bad_grpo_input_exits_2_naming_the_key(corpus, tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    code = train.main(["--config", TINY, f"run.dir={run_dir}", f"data.path={corpus}", *COMMON, "mesh.data=-1", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not run_dir.exists()
