"""GRPO raises held-out exact-match accuracy on a short run: the recipe of configs/grpo-tiny.yaml
(an SFT warm-up, its export, GRPO from the exported weights with `rl.reward=exact_match`) in
miniature, on one CPU device.

The task is small enough to learn in seconds: one-digit sums of operands below 4 ("2+3=" -> "5"),
each row written three times with a different `copy` field, so the content hash that splits off
the eval rows (data.sources.held_out) puts most prompts on both sides. The eval accuracy then
measures how often greedy decoding gives the answers the rewards teach, not generalization to
unseen sums (BENCHMARKS.md measures that on the full task). A short SFT leaves the model right on
some prompts and wrong on others; GRPO must raise the accuracy well above where it starts, which
an update with the advantages' sign flipped does not (it lowers it)."""

from __future__ import annotations

import os

import jax
import pytest

import hf
import trainer
from configs import load_config
from conftest import ROOT
from data.addition import write
from data.prepare import prepare

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MODEL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
         "model.d_ff=64", "model.seq_len=8"]
SFT = ["train.objective=sft", "data.packing=document", "train.steps=100", "train.global_batch=8",
       "optim.lr=3e-3", "optim.warmup_steps=5", "checkpoint.every=1000", "train.log_every=1000"]
GRPO = ["train.objective=grpo", "train.steps=60", "train.global_batch=16", "rl.group_size=16",
        "rl.max_new_tokens=2", "rl.kl_coef=0", "rl.reward=exact_match", "rl.updates_per_rollout=2", "optim.lr=3e-3",
        "optim.warmup_steps=2", "checkpoint.every=1000", "train.log_every=1000", "eval.every=1000", "eval.batches=2"]


def rows() -> list[dict[str, str]]:
    sums = [(a, b) for a in range(4) for b in range(4)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b), "completion": str(a + b), "copy": k}
            for k in range(3) for a, b in sums]


@pytest.fixture(scope="module")
def start(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the prepared rl corpus, the SFT warm-up exported as Hugging Face weights)."""
    root = tmp_path_factory.mktemp("learns")
    write(str(root / "sums.jsonl"), rows())
    for objective in ("sft", "rl"):
        prepare([str(root / "sums.jsonl")], str(root / objective), progress=False, objective=objective,
                eval_fraction=0.3)
    cfg = load_config(TINY, [f"run.dir={root / 'sft'}-run", "data.source=prepared", f"data.path={root / 'sft'}",
                             *MODEL, *SFT])
    trainer.run(cfg, devices=jax.devices()[:1])
    hf.export(str(root / "sft-run"), str(root / "exported"))
    return str(root / "rl"), str(root / "exported")


def test_grpo_raises_the_held_out_accuracy_of_a_short_sft_run(start, tmp_path):
    corpus, exported = start
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "data.source=prepared", f"data.path={corpus}",
                             f"init.from_hf={exported}", *MODEL, *GRPO])
    records = trainer.run(cfg, devices=jax.devices()[:1])
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert len(evals) == 2 and evals[0] < 0.6, evals  # the warm-up leaves room to learn
    # Seen: 0.125 -> 0.44; with the advantages' sign flipped, 0.125 -> 0.
    assert evals[1] >= evals[0] + 0.25, evals


def test_the_headroom_bench_reads_the_warm_up_checkpoint(start, capsys):
    """bench.grpo_headroom end to end on the warm-up's run directory and the task's rows: greedy
    exact match and pass@k of the checkpoint's own samples (the table's arithmetic is checked on
    given rewards in test_bench_headroom)."""
    from bench.grpo_headroom import main

    root = os.path.dirname(start[0])
    assert main(["--run-dir", os.path.join(root, "sft-run"), "--prompts", os.path.join(root, "sums.jsonl"),
                 "--n", "16", "--k", "4", "--max-new-tokens", "2"]) == 0
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    rows = {what: value for what, value in cells[2:]}
    assert rows["checkpoint"].endswith(f"step 100, 16 prompts of {os.path.join(root, 'sums.jsonl')}")
    passes = [float(rows[f"pass@{k}"]) for k in (1, 2, 4)]
    assert passes == sorted(passes) and 0 < passes[-1] <= 1, rows
    assert 0 <= float(rows["greedy exact match"]) <= 1, rows
