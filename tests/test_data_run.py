"""The data features inside real runs: eval on the held-out split, data-wait timing, document
packing that trains and resumes exactly, and training from prepared corpora and mixtures."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import jax
import numpy as np

import trainer
from conftest import stdlib_glob

# The learning-rate horizon of tests/test_faults.py's runs (the schedule is a constant of the
# compiled step): runs on the preset's mesh with it run their program, compiled once for the
# suite (the shared compilation cache), whatever their length.
HORIZON = "optim.decay_steps=12"


def _losses(history: list[dict]) -> list[float]:
    return [r["loss"] for r in history if "loss" in r]


def test_eval_reads_the_held_out_split_and_leaves_training_alone(tiny):
    common = ["train.steps=6", f"data.path={stdlib_glob('email')}", "data.eval_fraction=0.3", HORIZON]
    with_eval = trainer.run(tiny(*common, "eval.every=3", "eval.batches=2"))
    evals = [r for r in with_eval if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_perplexity"] > 1 for r in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # the model learns what it was not shown
    trained = [r for r in with_eval if "loss" in r]
    assert all(r["data_wait_s"] >= 0 for r in trained if "step_s" in r) and "data_wait_s" in trained[-1]
    without = trainer.run(tiny(*common, "eval.every=0", "run.dir=" + str(tiny().run.dir) + "-plain"))
    assert not any("eval_loss" in r for r in without)
    np.testing.assert_array_equal(_losses(with_eval), _losses(without))


def _final_params(run_dir) -> list[np.ndarray]:
    import orbax.checkpoint as ocp

    step = max(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit())
    return jax.tree.leaves(ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")["params"])


def test_document_packing_trains_and_resumes_bitwise(tiny, tmp_path):
    """Stopped at step 3 and resumed on the same layout: the losses and the final parameters are
    bitwise those of the straight run. Resumed on another layout instead, the losses agree to
    float32 rounding (a different sharding sums in another order)."""
    common = ["data.packing=document", "optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=3",
              "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    straight = trainer.run(tiny("train.steps=6", *common, f"run.dir={tmp_path / 'a'}"))
    first = trainer.run(tiny("train.steps=3", *common, f"run.dir={tmp_path / 'b'}"))
    shutil.copytree(tmp_path / "b", tmp_path / "moved")
    second = trainer.run(tiny("train.steps=6", *common, f"run.dir={tmp_path / 'b'}"))
    assert [r["step"] for r in second if "loss" in r] == [4, 5, 6], "the second run resumed"
    np.testing.assert_array_equal(_losses(first + second), _losses(straight))
    for resumed, reference in zip(_final_params(tmp_path / "b"), _final_params(tmp_path / "a"), strict=True):
        np.testing.assert_array_equal(resumed, reference)
    moved = trainer.run(tiny("train.steps=6", *common, f"run.dir={tmp_path / 'moved'}", "mesh.data=4", "mesh.fsdp=1"))
    np.testing.assert_allclose(_losses(moved), _losses(straight)[3:], rtol=2e-5)
    concat = trainer.run(tiny("train.steps=3", *common, "data.packing=concat", f"run.dir={tmp_path / 'c'}"))
    assert _losses(concat)[0] != _losses(straight)[0]  # the packings really feed different rows


def _prepare(tmp_path, name: str, package: str, *extra: str) -> str:
    from data.prepare import main as prepare

    out = str(tmp_path / name)
    args = ["--input", stdlib_glob(package), "--output", out, "--eval-fraction", "0.2", "--workers", "1", *extra]
    assert prepare(args) == 0
    return out


def test_training_from_a_prepared_corpus_and_a_mixture(tiny, tmp_path):
    import pytest

    from configs import ConfigError

    json_dir, email_dir = _prepare(tmp_path, "json", "json"), _prepare(tmp_path, "email", "email")
    common = ["train.steps=3", "data.source=prepared", "data.path=", "eval.every=3", "data.packing=document"]
    history = trainer.run(tiny(*common, f"data.path={email_dir}", f"run.dir={tmp_path / 'one'}"))
    assert len(_losses(history)) == 3 and [r["step"] for r in history if "eval_loss" in r] == [3]
    mixed = trainer.run(tiny(*common, f"data.mixture={email_dir}:0.8,{json_dir}:0.2", f"run.dir={tmp_path / 'mix'}"))
    assert _losses(mixed) != _losses(history) and np.isfinite(_losses(mixed)).all()
    # A corpus tokenized otherwise, or a model whose vocabulary does not fit the tokenizer, is refused.
    with pytest.raises(ConfigError, match="model.vocab_size=512"):
        trainer.run(tiny(*common, f"data.path={email_dir}", "model.vocab_size=512", f"run.dir={tmp_path / 'x'}"))
    import json
    import shutil

    other = shutil.copytree(json_dir, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"], manifest["tokenizer"]["path"] = "hf:0123", "/models/other/tokenizer.json"
    (other / "manifest.json").write_text(json.dumps(manifest))
    # The key, both tokenizers' files and both fingerprints.
    with pytest.raises(ConfigError, match=r"^data.tokenizer=byte: '.*' was prepared with tokenizer 'hf:0123' "
                                          r"\(from /models/other/tokenizer.json\), this config's is 'byte'; set data"):
        trainer.run(tiny(*common, f"data.path={other}", f"run.dir={tmp_path / 'z'}"))
    with pytest.raises(ConfigError, match="no manifest.json"):
        trainer.run(tiny(*common, f"data.path={tmp_path}", f"run.dir={tmp_path / 'y'}"))


def test_worker_processes_feed_the_same_batches_and_resume(tiny, tmp_path):
    common = [HORIZON, "checkpoint.every=2", "mesh.data=8"]
    threads = trainer.run(tiny("train.steps=4", *common, f"run.dir={tmp_path / 't'}"))
    first = trainer.run(tiny("train.steps=2", *common, "data.workers=1", f"run.dir={tmp_path / 'w'}"))
    second = trainer.run(tiny("train.steps=4", *common, "data.workers=1", f"run.dir={tmp_path / 'w'}"))
    np.testing.assert_array_equal(_losses(first + second), _losses(threads))


def test_no_held_out_document_reaches_a_training_batch(tiny, tmp_path, monkeypatch):
    """A real run with eval on: every row the loop trains on and every row eval scores is
    recorded, and each is traced back to its documents. Document i is `<i>` repeated (3 digits),
    so any 5 bytes of a row name it; the run covers an epoch of each split, so every document
    must turn up in exactly one of them."""
    import re

    import trainer.loop as loop
    from data import to_global

    docs = 30
    for i in range(docs):
        (tmp_path / f"doc{i:03d}.txt").write_text(f"<{i:03d}>" * (16 + i % 7))
    fed, held = [], []
    eval_batches = loop.eval_batches

    def recorded_batches(local: Iterator[dict], sharding: Any, global_batch: int) -> Iterator[dict]:
        for rows in local:
            fed.append(rows["tokens"].copy())
            yield to_global(rows, sharding, global_batch)

    def recorded_eval(*args: Any) -> list[dict]:
        rows = eval_batches(*args)
        held.extend(r["tokens"].copy() for r in rows)
        return rows

    monkeypatch.setattr(loop, "global_batches", recorded_batches)
    monkeypatch.setattr(loop, "eval_batches", recorded_eval)
    history = trainer.run(tiny("train.steps=5", f"data.path={tmp_path / '*.txt'}", "data.eval_fraction=0.3",
                               "eval.every=5", "eval.batches=2", HORIZON))
    assert [r["step"] for r in history if "eval_loss" in r] == [5] and len(fed) == 5 and len(held) == 2

    def documents(batches: list[np.ndarray]) -> set[int]:
        text = b"|".join(bytes(t if t < 256 else ord("|") for t in row) for batch in batches for row in batch)
        return {int(i) for i in re.findall(rb"<(\d{3})>", text)}

    trained, evaluated = documents(fed), documents(held)
    assert trained and evaluated, (trained, evaluated)
    assert not trained & evaluated, f"held-out documents {sorted(trained & evaluated)} were trained on"
    assert trained | evaluated == set(range(docs)), f"documents {set(range(docs)) - trained - evaluated} were never read"
